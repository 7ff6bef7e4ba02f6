"""The NVLink runtime: NCCL resources of one buffer and the launch sequence of its kernels.

One `NvlinkRuntime` per `ElasticBuffer` on a single NVLink domain. It owns the communicator, the
device communicator, the symmetric window and the host-mapped error and count blocks, and runs
dispatch and combine as a fixed sequence of kernels on the stream it is given:

    dispatch: dispatch (layout + NVLink + counts) -> [expand ranks] -> [host waits for counts] -> epilogue
    cached dispatch: dispatch (NVLink) -> epilogue            (slots and counts from the handle)
    combine:  combine (NVLink) -> combine epilogue

Epilogues are launched with programmatic dependent launch and follow the senders' arrival
counters, so they run while the data is still on the wire; each ends by posting this rank's
window credit, which the peers' next communication kernel waits for instead of an entry barrier.
Without CPU sync nothing waits on the host, so the sequence can be captured in a CUDA graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import kernels
from .errors import EPTimeoutError
from .jit import I32, U64, Opaque
from .layout import (
    DISPATCH_SCRATCH_INTS,
    ERROR_WORDS,
    MAX_LOCAL_EXPERTS,
    MAX_RANKS,
    PHASES,
    WORKSPACE_BYTES,
    CombineSlotLayout,
    DispatchRecordLayout,
    align,
    arrival_block,
    tokens_per_group,
)
from .nccl.communicator import Communicator
from .nccl.device_comm import DeviceCommunicator
from .nccl.window import SymmetricWindow
from .validation import check_topk_idx_values

# How long a host wait busy-polls before it starts sleeping between polls
_SPIN_S = 0.05


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def rows_per_task(num_rows: int, num_sms: int, max_rows: int) -> int:
    """Rows (or tokens) a communication warp sends between two releases: one when there are few
    per warp (decode: spread them over every warp), up to `max_rows` when there are many (each
    release fence stalls its warp for about one NVLink round trip)."""
    num_warps = num_sms * (kernels.NUM_THREADS // 32)
    rows = 1
    while rows < max_rows and num_rows >= 8 * rows * num_warps:
        rows *= 2
    return rows


def raise_invalid_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> None:
    """The dispatch kernel flagged `topk_idx` (and sent nothing): raise the facade's precise error."""
    check_topk_idx_values("dispatch", topk_idx, num_experts)
    raise ValueError(f"dispatch: `topk_idx` must hold distinct expert ids in [-1, {num_experts}) per row")


@dataclass
class NvlinkDispatchState:
    """What a handle keeps for combine and cached dispatch (device tensors, no host sync needed)."""

    slot_idx: torch.Tensor  # [num_tokens, num_ranks] int32, -1 where the token skips a rank
    num_tokens_per_rank: torch.Tensor  # [num_ranks] int32, tokens sent to each rank
    num_out_rows: int  # rows of recv_x (exact with CPU sync, worst case without)
    num_meta_rows: int  # rows of recv_src_metadata
    num_expanded_rows: int  # rows of the expanded layout (reported in both modes)


class NvlinkRuntime:
    """NCCL resources and kernel launches of one buffer on one NVLink domain.

    Arguments:
        group: an NCCL process group whose ranks all share one NVLink (LSA) domain.
        num_bytes: window size per rank (workspace included).
        num_gpu_timeout_secs: deadline of every device-side wait.
        num_cpu_timeout_secs: deadline of every host-side wait.
        force_own_comm: create an own NCCL communicator instead of borrowing torch's.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int,
        num_gpu_timeout_secs: float,
        num_cpu_timeout_secs: float,
        force_own_comm: bool = False,
    ) -> None:
        self.rank, self.num_ranks = group.rank(), group.size()
        if self.num_ranks > MAX_RANKS:
            raise ValueError(f"NVLink kernels support at most {MAX_RANKS} ranks, the group has {self.num_ranks}")
        self.timeout_ns = int(num_gpu_timeout_secs * 1e9)
        self.cpu_timeout_s = float(num_cpu_timeout_secs)
        self.num_device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.comm = Communicator(group, force_own=force_own_comm)
        self.dev_comm = DeviceCommunicator(self.comm)
        if self.dev_comm.lsa_size != self.num_ranks or self.dev_comm.lsa_rank != self.rank:
            lsa = (self.dev_comm.lsa_rank, self.dev_comm.lsa_size)
            self.dev_comm.destroy()
            self.comm.destroy()
            raise ValueError(
                f"the group is not one NVLink domain: LSA (rank, size) = {lsa}, group = ({self.rank}, {self.num_ranks})"
            )
        self.window = SymmetricWindow(self.comm, num_bytes)
        self.error_block = torch.zeros(len(ERROR_WORDS) + 1, dtype=torch.int64, pin_memory=True)
        # Received counts per source rank, then per local expert, then the invalid-input flag: the
        # dispatch kernel fills the device copy, a D2H copy brings them to pinned memory (device reads
        # of host memory are slow)
        num_count_words = MAX_RANKS + MAX_LOCAL_EXPERTS + 1
        self.device_counts = torch.zeros(num_count_words, dtype=torch.int32, device="cuda")
        self.host_counts = torch.zeros(num_count_words, dtype=torch.int32, pin_memory=True)
        self.dispatch_scratch = torch.zeros(DISPATCH_SCRATCH_INTS, dtype=torch.int32, device="cuda")
        self._expand_scratch: torch.Tensor | None = None
        self.dead_reason: str | None = None

    # ---------------------------------------------------------------- faults

    def check_error(self) -> None:
        """Raise `EPTimeoutError` if any device wait of this buffer has expired (then or before)."""
        if self.dead_reason is None and int(self.error_block[0]) != 0:
            words = dict(zip(ERROR_WORDS, self.error_block.tolist(), strict=False))
            phase = PHASES.get(words["phase"], f"phase {words['phase']}")
            self.dead_reason = (
                f"{phase} timed out on rank {words['rank']} waiting for rank {words['peer']} "
                f"(channel {words['channel']}, semaphore {words['observed']}, expected >= {words['expected']}) "
                f"after {self.timeout_ns / 1e9:g} s; the buffer is unusable: destroy it and create a new one"
            )
        if self.dead_reason is not None:
            raise EPTimeoutError(self.dead_reason)

    def wait(self, stream: torch.cuda.Stream, what: str) -> None:
        """Wait on the host, with a deadline, for everything queued on `stream`.

        Busy-polls first: a sleep costs at least a scheduler tick (milliseconds in a VM), far more
        than a dispatch; only waits longer than `_SPIN_S` back off to short sleeps.
        """
        event = torch.cuda.Event()
        event.record(stream)
        started = time.monotonic()
        deadline = started + self.cpu_timeout_s
        while not event.query():
            now = time.monotonic()
            if now > deadline:
                self.dead_reason = f"host wait for {what} on rank {self.rank} passed {self.cpu_timeout_s:g} s"
                raise EPTimeoutError(self.dead_reason)
            if now - started > _SPIN_S:
                time.sleep(1e-4)
        self.check_error()

    # ---------------------------------------------------------------- barrier

    def barrier(self, stream: torch.cuda.Stream) -> None:
        self.check_error()
        kernel = kernels.load(kernels.barrier_spec(self.num_ranks))
        kernel.launch(grid=(1,), block=(128,), stream=stream, args=(
            Opaque(self.dev_comm.raw), U64(self.window.handle), I32(self.rank),
            U64(_ptr(self.error_block)), U64(self.timeout_ns)))  # fmt: skip

    # ---------------------------------------------------------------- dispatch

    def check_capacity(self, slot_bytes: int, num_max_tokens_per_rank: int, what: str) -> None:
        needed = WORKSPACE_BYTES + self.num_ranks * num_max_tokens_per_rank * slot_bytes
        if needed > self.window.num_bytes:
            raise ValueError(
                f"{what}: the buffer holds {self.window.num_bytes} bytes per rank but this call needs {needed} "
                f"({num_max_tokens_per_rank} tokens x {self.num_ranks} ranks x {slot_bytes} bytes); create the buffer "
                "with ElasticBuffer.get_buffer_size_hint(...) for this shape"
            )

    def _expand_rank_scratch(self, num_elements: int) -> torch.Tensor:
        if self._expand_scratch is None or self._expand_scratch.numel() < num_elements:
            self._expand_scratch = torch.empty(num_elements, dtype=torch.int32, device="cuda")
        return self._expand_scratch

    def dispatch(
        self,
        stream: torch.cuda.Stream,
        x: torch.Tensor,
        x_scales: torch.Tensor | None,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None,
        num_experts: int,
        num_max_tokens_per_rank: int,
        expert_alignment: int,
        num_sms: int,
        do_cpu_sync: bool,
        do_expand: bool,
        do_zero_padding: bool,
        use_tma_aligned_col_major_sf: bool,
        cumulative_stats: torch.Tensor | None,
        cached: NvlinkDispatchState | None,
        cached_num_recv_tokens_per_expert: torch.Tensor | None = None,
        cached_recv_src_metadata: torch.Tensor | None = None,
    ) -> dict:
        """Run one dispatch on `stream`; returns the output tensors and the new handle state.

        Arguments:
            x: `[num_tokens, hidden]` BF16, or FP8 (`torch.float8_e4m3fn`) with `x_scales`.
            x_scales: `[num_tokens, num_scales]` float32 (per 128) or int32 (packed UE8M0), or None.
            topk_idx: `[num_tokens, num_topk]` int64 global expert ids, -1 for none.
            topk_weights: `[num_tokens, num_topk]` float32, or None.
            cumulative_stats: `[num_local_experts]` int32, incremented in place, or None.
            cached: the state of a previous dispatch with the same routing, or None.

        Returns:
            A dict of `recv_x`, `recv_scales`, `recv_topk_idx`, `recv_topk_weights`,
            `recv_src_metadata`, `psum_num_recv_tokens_per_rank`, `num_recv_tokens_per_expert`,
            `psum_num_recv_tokens_per_expert`, `num_recv_tokens_per_expert_host` (list or None),
            `num_recv_tokens` (int) and `state`.
        """
        self.check_error()
        num_tokens, num_topk = topk_idx.shape
        hidden = x.shape[1]
        hidden_bytes = hidden * x.element_size()
        num_scales = 0 if x_scales is None else x_scales.shape[1]
        scale_bytes = num_scales * 4
        num_local_experts = num_experts // self.num_ranks
        record = DispatchRecordLayout(hidden_bytes, scale_bytes, num_topk)
        self.check_capacity(record.num_bytes, num_max_tokens_per_rank, "dispatch")
        device = x.device
        args_common = (self.num_ranks, hidden_bytes, scale_bytes, num_topk)
        # One CTA per destination at least: CTA d tells rank d its counts
        num_sms = max(self.num_ranks, min(num_sms, self.num_device_sms))

        counts_list = None
        arrival_slots = arrival_block(num_max_tokens_per_rank)
        if cached is None:
            slot_idx = torch.empty((num_tokens, self.num_ranks), dtype=torch.int32, device=device)
            dst_slot_idx = torch.empty((num_tokens, num_topk), dtype=torch.int32, device=device)
            num_tokens_per_rank = torch.empty(self.num_ranks, dtype=torch.int32, device=device)
            num_recv_per_expert = torch.empty(num_local_experts, dtype=torch.int32, device=device)
        else:
            slot_idx, num_tokens_per_rank = cached.slot_idx, cached.num_tokens_per_rank
            dst_slot_idx = None
            num_recv_per_expert = cached_num_recv_tokens_per_expert
            if cumulative_stats is not None:
                cumulative_stats.add_(num_recv_per_expert)
        dispatch_args = kernels.DispatchArgs(
            window_base=self.window.ptr, x=_ptr(x), x_scales=_ptr(x_scales), topk_idx=_ptr(topk_idx),
            topk_weights=_ptr(topk_weights), slot_idx=_ptr(slot_idx), dst_slot_idx=_ptr(dst_slot_idx),
            layout_scratch=_ptr(self.dispatch_scratch), num_tokens_per_rank=_ptr(num_tokens_per_rank),
            num_recv_tokens_per_expert=_ptr(num_recv_per_expert),
            counts_out=_ptr(self.device_counts) if (cached is None and do_cpu_sync) else 0,
            cumulative_stats=_ptr(cumulative_stats) if cached is None else 0, num_tokens=num_tokens,
            num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank, num_experts_per_rank=num_local_experts,
            tokens_per_group=tokens_per_group(num_tokens, self.num_ranks),
            tokens_per_task=rows_per_task(num_tokens, num_sms, 4), arrival_block=arrival_slots,
            error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
        kernels.load(kernels.dispatch_spec(*args_common, cached is not None)).launch(
            grid=(num_sms,), block=(kernels.NUM_THREADS,), stream=stream,
            args=(Opaque(self.dev_comm.raw), U64(self.window.handle), Opaque(bytes(dispatch_args))))  # fmt: skip

        if cached is None:
            max_recv = self.num_ranks * num_max_tokens_per_rank
            expand_scratch = None
            if do_expand:
                expand_scratch = self._expand_rank_scratch(max_recv * num_topk)
                kernels.load(kernels.dispatch_expand_rank_spec(*args_common)).launch(
                    grid=(num_local_experts,), block=(kernels.NUM_EXPAND_RANK_THREADS,), stream=stream,
                    args=(U64(self.window.ptr), I32(num_max_tokens_per_rank), I32(self.rank), I32(num_local_experts),
                          U64(_ptr(expand_scratch)), I32(arrival_slots), U64(_ptr(self.error_block)),
                          U64(self.timeout_ns)))  # fmt: skip
            if do_cpu_sync:
                num_words = self.num_ranks + num_local_experts + 1
                self.host_counts[:num_words].copy_(self.device_counts[:num_words], non_blocking=True)
                self.wait(stream, "dispatch counts")
                counts = self.host_counts[:num_words].tolist()
                if counts[-1]:
                    self._drain_dispatch(stream, args_common, num_max_tokens_per_rank, num_local_experts, arrival_slots)
                    raise_invalid_topk_idx(topk_idx, num_experts)
                num_recv_tokens = sum(counts[: self.num_ranks])
                counts_list = [align(c, expert_alignment) for c in counts[self.num_ranks : -1]]
                num_expanded_rows = sum(counts_list)
                num_meta_rows = num_recv_tokens
            else:
                num_meta_rows = num_recv_tokens = max_recv
                num_expanded_rows = self.worst_case_expanded_rows(
                    num_max_tokens_per_rank, num_topk, num_local_experts, expert_alignment
                )
            num_out_rows = num_expanded_rows if do_expand else num_recv_tokens
            state = NvlinkDispatchState(slot_idx, num_tokens_per_rank, num_out_rows, num_meta_rows, num_expanded_rows)
            recv_src_metadata = torch.empty((num_meta_rows, 2 + num_topk), dtype=torch.int32, device=device)
        else:
            state = cached
            recv_src_metadata = cached_recv_src_metadata
            expand_scratch = None
            num_out_rows, num_recv_tokens = cached.num_out_rows, cached.num_meta_rows

        # The epilogue runs next to the dispatch kernel unless a host wait (CPU sync) came between
        num_busy_sms = 0 if (cached is None and do_cpu_sync) else num_sms
        recv_x = torch.empty((num_out_rows, hidden), dtype=x.dtype, device=device)
        recv_scales, scale_col_stride = None, 0
        if x_scales is not None:
            if use_tma_aligned_col_major_sf:
                scale_col_stride = align(num_out_rows, 4)
                recv_scales = torch.empty((num_scales, scale_col_stride), dtype=x_scales.dtype, device=device)[
                    :, :num_out_rows
                ].t()
            else:
                recv_scales = torch.empty((num_out_rows, num_scales), dtype=x_scales.dtype, device=device)
        recv_topk_idx = None if do_expand else torch.empty((num_out_rows, num_topk), dtype=torch.int64, device=device)
        recv_topk_weights = None
        if topk_weights is not None:
            shape = (num_out_rows,) if do_expand else (num_out_rows, num_topk)
            recv_topk_weights = torch.empty(shape, dtype=torch.float32, device=device)
        psum_rank = torch.empty(self.num_ranks, dtype=torch.int32, device=device)
        psum_expert = torch.empty(num_local_experts, dtype=torch.int32, device=device)

        epilogue_args = kernels.DispatchEpilogueArgs(
            window_base=self.window.ptr, x=_ptr(x), x_scales=_ptr(x_scales),
            num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank,
            num_experts_per_rank=num_local_experts, expert_alignment=expert_alignment, num_out_rows=num_out_rows,
            scale_col_stride=scale_col_stride, recv_x=_ptr(recv_x), recv_scales=_ptr(recv_scales),
            recv_topk_idx=_ptr(recv_topk_idx), recv_topk_weights=_ptr(recv_topk_weights),
            recv_src_metadata=_ptr(recv_src_metadata), psum_num_recv_tokens_per_rank=_ptr(psum_rank),
            num_recv_tokens_per_expert=_ptr(num_recv_per_expert), psum_num_recv_tokens_per_expert=_ptr(psum_expert),
            expand_rank_in_expert=_ptr(expand_scratch), is_cached=int(cached is not None),
            do_zero_padding=int(do_zero_padding), arrival_block=arrival_slots, error_block=_ptr(self.error_block),
            timeout_ns=self.timeout_ns)  # fmt: skip
        kernels.load(kernels.dispatch_epilogue_spec(*args_common, do_expand)).launch(
            grid=(self._grid_for_rows(num_recv_tokens, num_busy_sms),), block=(kernels.NUM_THREADS,), stream=stream,
            args=(Opaque(bytes(epilogue_args)),), pdl=True)  # fmt: skip
        return {
            "recv_x": recv_x,
            "recv_scales": recv_scales,
            "recv_topk_idx": recv_topk_idx,
            "recv_topk_weights": recv_topk_weights,
            "recv_src_metadata": recv_src_metadata,
            "psum_num_recv_tokens_per_rank": psum_rank,
            "num_recv_tokens_per_expert": num_recv_per_expert,
            "psum_num_recv_tokens_per_expert": psum_expert,
            "num_recv_tokens_per_expert_host": counts_list,
            "num_recv_tokens": num_recv_tokens,
            "num_out_rows": num_out_rows,
            "dst_slot_idx": dst_slot_idx,
            "state": state,
        }

    def _drain_dispatch(
        self,
        stream: torch.cuda.Stream,
        args_common: tuple,
        num_max_tokens_per_rank: int,
        num_local_experts: int,
        arrival_slots: int,
    ) -> None:
        """Our input was rejected, but peers sent us their records: wait for them all and return the
        arrival counters to zero (the epilogue with no outputs), so the buffer stays usable."""
        drain_args = kernels.DispatchEpilogueArgs(
            window_base=self.window.ptr, num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank,
            num_experts_per_rank=num_local_experts, expert_alignment=1, drain_only=1, arrival_block=arrival_slots,
            error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
        kernels.load(kernels.dispatch_epilogue_spec(*args_common, False)).launch(
            grid=(1,), block=(kernels.NUM_THREADS,), stream=stream, args=(Opaque(bytes(drain_args)),), pdl=True
        )

    def _grid_for_rows(self, num_rows: int, num_busy_sms: int) -> int:
        """CTAs for an epilogue over `num_rows` rows: one warp per row, at most one CTA per SM, and
        only the SMs the running communication kernel (`num_busy_sms`) leaves free. An epilogue CTA
        cannot share an SM with a communication CTA (registers), so one placed behind it would hold
        its rows, spread over the whole batch, until the transfer ends."""
        rows_per_cta = kernels.NUM_THREADS // 32
        num_free_sms = self.num_device_sms - num_busy_sms
        num_sms = num_free_sms if num_free_sms >= self.num_device_sms // 4 else self.num_device_sms
        return max(1, min(num_sms, (num_rows + rows_per_cta - 1) // rows_per_cta))

    def worst_case_expanded_rows(
        self, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int, expert_alignment: int
    ) -> int:
        """Expanded rows without CPU sync: every rank sends us all its tokens, each hitting
        min(top-k, local experts) of ours, and every expert block is padded."""
        max_recv = self.num_ranks * num_max_tokens_per_rank
        return align(
            max_recv * min(num_topk, num_local_experts) + num_local_experts * (expert_alignment - 1), expert_alignment
        )

    # ---------------------------------------------------------------- combine

    def combine(
        self,
        stream: torch.cuda.Stream,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        bias_0: torch.Tensor | None,
        bias_1: torch.Tensor | None,
        topk_idx: torch.Tensor,
        recv_src_metadata: torch.Tensor,
        psum_num_recv_tokens_per_rank: torch.Tensor,
        state: NvlinkDispatchState,
        num_experts: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        do_expand: bool,
        allow_multiple_reduction: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one combine on `stream`.

        Arguments:
            x: `[rows, hidden]` BF16 (rows of the dispatch's `recv_x`).
            topk_weights: `[rows, num_topk]` (plain) or `[rows]` (expanded) float32, or None.
            bias_0, bias_1: `[num_tokens, hidden]` BF16, or None.
            topk_idx: the dispatching rank's `[num_tokens, num_topk]` int64 routing (from the handle).

        Returns:
            combined_x: `[num_tokens, hidden]` BF16.
            combined_topk_weights: `[num_tokens, num_topk]` float32, or None.
        """
        self.check_error()
        num_tokens, num_topk = topk_idx.shape
        hidden = x.shape[1]
        num_local_experts = num_experts // self.num_ranks
        num_rows = min(num_topk, num_local_experts) if (do_expand and not allow_multiple_reduction) else 1
        slot = CombineSlotLayout(hidden, num_rows, num_topk)
        self.check_capacity(slot.num_bytes, num_max_tokens_per_rank, "combine")
        num_sms = max(1, min(num_sms, self.num_device_sms))
        arrival_slots = arrival_block(num_max_tokens_per_rank)
        combined_x = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.empty((num_tokens, num_topk), dtype=torch.float32, device=x.device)

        combine_args = kernels.CombineArgs(
            window_base=self.window.ptr, x=_ptr(x), topk_weights=_ptr(topk_weights),
            recv_src_metadata=_ptr(recv_src_metadata),
            psum_num_recv_tokens_per_rank=_ptr(psum_num_recv_tokens_per_rank),
            num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank,
            rows_per_task=rows_per_task(num_tokens * self.num_ranks, num_sms, 2), arrival_block=arrival_slots,
            error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
        kernels.load(kernels.combine_spec(self.num_ranks, hidden, num_topk, num_rows, do_expand)).launch(
            grid=(num_sms,), block=(kernels.NUM_THREADS,), stream=stream,
            args=(Opaque(self.dev_comm.raw), U64(self.window.handle), Opaque(bytes(combine_args))))  # fmt: skip
        # Always, even with no tokens here: the epilogue posts our window credit (credits.cuh)
        epilogue_args = kernels.CombineEpilogueArgs(
            window_base=self.window.ptr, topk_idx=_ptr(topk_idx), slot_idx=_ptr(state.slot_idx),
            bias_0=_ptr(bias_0), bias_1=_ptr(bias_1), combined_x=_ptr(combined_x),
            combined_topk_weights=_ptr(combined_w), local_x=0 if do_expand else _ptr(x),
            local_topk_weights=0 if do_expand else _ptr(topk_weights),
            psum_num_recv_tokens_per_rank=_ptr(psum_num_recv_tokens_per_rank),
            num_tokens_per_rank=_ptr(state.num_tokens_per_rank), num_tokens=num_tokens,
            num_max_tokens_per_rank=num_max_tokens_per_rank, num_experts_per_rank=num_local_experts,
            rank=self.rank, arrival_block=arrival_slots, error_block=_ptr(self.error_block),
            timeout_ns=self.timeout_ns)  # fmt: skip
        grid = self._grid_for_rows(num_tokens * ((hidden + 1023) // 1024), num_sms)  # (token, 1024-wide part) items
        kernels.load(kernels.combine_epilogue_spec(self.num_ranks, hidden, num_topk, num_rows)).launch(
            grid=(grid,),
            block=(kernels.NUM_THREADS,),
            stream=stream,
            args=(Opaque(bytes(epilogue_args)),),
            pdl=True,
        )
        return combined_x, combined_w

    # ---------------------------------------------------------------- teardown

    def destroy(self) -> None:
        """Release device communicator, window, memory and own communicator, in that order; idempotent."""
        for resource in ("dev_comm", "window", "comm"):
            obj = getattr(self, resource, None)
            if obj is not None:
                obj.destroy()


def peer_store(runtime: NvlinkRuntime, stream: torch.cuda.Stream, src: torch.Tensor, num_sms: int) -> None:
    """Speed-of-light probe: stream `src` (uint8, a multiple of 16 bytes) into every peer's window.

    Every rank launching it at once loads the links in both directions, as dispatch and combine do.
    """
    if WORKSPACE_BYTES + src.numel() > runtime.window.num_bytes:
        raise ValueError(f"peer_store: {src.numel()} bytes do not fit the window ({runtime.window.num_bytes} bytes)")
    kernels.load(kernels.peer_store_spec()).launch(
        grid=(num_sms,), block=(kernels.NUM_THREADS,), stream=stream,
        args=(Opaque(runtime.dev_comm.raw), U64(runtime.window.handle), U64(WORKSPACE_BYTES), src,
              U64(src.numel())))  # fmt: skip
