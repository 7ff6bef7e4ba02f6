"""The NVLink runtime: the window of one buffer and the launch sequence of its kernels.

One `NvlinkRuntime` per `ElasticBuffer` whose ranks reach each other's windows by loads and
stores: one NVLink domain through NCCL's LSA pointers (`deep_ep.backends.kernels.nccl.peer_windows`), or the virtual
ranks of one GPU (`deep_ep.loopback`). It takes the windows (`PeerWindows`) and the part of the GPU
the rank's kernels may use (`DeviceShare`), owns the host-mapped error block and the count blocks,
and runs dispatch and combine as a fixed sequence of kernels on the stream it is given:

    dispatch: dispatch (layout + NVLink + counts) -> [expand ranks] -> [host waits for counts] -> epilogue
    cached dispatch: dispatch (NVLink) -> epilogue            (slots and counts from the handle)
    combine:  combine (NVLink) -> combine epilogue

Epilogues are launched with programmatic dependent launch and follow the senders' arrival
counters, so they run while the data is still on the wire; each ends by posting this rank's
window credit, which the peers' next communication kernel waits for instead of an entry barrier.
Without CPU sync nothing waits on the host, so the sequence can be captured in a CUDA graph.

Every kernel of an operation is loaded, and every output whose shape is known allocated, before its
first launch: an exception after it would leave the window half-way through an operation, so one
marks the buffer dead (`dead_reason`) instead of letting a retry run at the same epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deep_ep.backends.base import check_topk_idx_values
from deep_ep.errors import EPError, EPOperationMismatchError, EPTimeoutError
from deep_ep.host_reads import wait_for_stream
from deep_ep.jit import I32, U64, Opaque

from . import specs
from .layout import (
    DISPATCH_SCRATCH_INTS,
    ERROR_REPORTED_BY_PEER,
    ERROR_WORDS,
    INPUT_OUT_OF_RANGE,
    MAX_LOCAL_EXPERTS,
    MAX_RANKS,
    NUM_RANKS_OFFSET,
    PEER_WINDOWS_OFFSET,
    PHASES,
    RANK_OFFSET,
    WORKSPACE_BYTES,
    CombineSlotLayout,
    DispatchRecordLayout,
    align,
    arrival_block,
    tokens_per_group,
)

# How long a host wait busy-polls before it starts sleeping between polls
_SPIN_S = 0.05
# The error block words of an input error (`report_input_error` in fault.cuh)
_INPUT_WORDS = slice(ERROR_WORDS.index("input_status"), len(ERROR_WORDS))
_OP_MISMATCH_PHASE = 8


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


class PeerWindows(Protocol):
    """Every rank's window of one buffer, as this rank sees them.

    Attributes:
        rank: this rank.
        num_ranks: the number of ranks.
        ptr: this rank's window base, the address its kernels write it through.
        num_bytes: the window size (the same on every rank).
        bytes: `[num_bytes]` `torch.uint8`, this rank's window.
        peer_ptrs: every rank's window base as this rank's kernels reach it (`peer_ptrs[rank] == ptr`).
    """

    rank: int
    num_ranks: int
    ptr: int
    num_bytes: int
    bytes: torch.Tensor
    peer_ptrs: list[int]

    def destroy(self) -> None: ...


def _load_each(kernel_specs: Sequence[Any]) -> list[Any]:
    return [specs.load(spec) for spec in kernel_specs]


@dataclass(frozen=True)
class DeviceShare:
    """The part of the GPU one rank's kernels may use, and where they get kernels and memory.

    Attributes:
        num_sms: the SMs one rank's kernels may use (the device's, or a virtual rank's share).
        exclusive: the communication kernel and its epilogue must fit `num_sms` together (virtual
            ranks share the GPU: a grid waiting for a peer on SMs that the peer's kernels need would
            starve it); otherwise an epilogue may queue behind a running communication kernel.
        empty: allocates a tensor (`torch.empty`'s `(shape, dtype=..., device=...)`).
        load: loads the kernels of `specs` (one operation's, before its first launch).
    """

    num_sms: int
    exclusive: bool = False
    empty: Callable[..., torch.Tensor] = torch.empty
    load: Callable[[Sequence[Any]], list[Any]] = _load_each

    @classmethod
    def whole_device(cls) -> DeviceShare:
        """The whole current CUDA device, for a rank that has a GPU of its own."""
        return cls(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


def rows_per_task(num_rows: int, num_sms: int, max_rows: int) -> int:
    """Rows (or tokens) a communication warp sends between two releases: one when there are few
    per warp (decode: spread them over every warp), up to `max_rows` when there are many (each
    release fence stalls its warp for about one NVLink round trip)."""
    num_warps = num_sms * (specs.NUM_THREADS // 32)
    rows = 1
    while rows < max_rows and num_rows >= 8 * rows * num_warps:
        rows *= 2
    return rows


def describe_fault(words: dict[str, int], timeout_s: float) -> str:
    """The text of a device-side failure recorded in an error block (fault.cuh)."""
    phase = PHASES.get(words["phase"], f"phase {words['phase']}")
    rank, peer = words["rank"], words["peer"]
    if words["phase"] == _OP_MISMATCH_PHASE:
        text = f"rank {peer} ran a different operation than rank {rank}"
        if words["channel"] >= 0:  # recorded where it was found (a peer's posted fault carries no words)
            text += f" (signature {words['observed'] & 0xFFFFFFFF:#x}, expected {words['expected'] & 0xFFFFFFFF:#x})"
        text += ": the ranks' sequences of dispatches and combines diverged"
    else:
        text = f"{phase} timed out on rank {rank} waiting for rank {peer} after {timeout_s:g} s"
        if words["channel"] >= 0:
            text += f" (channel {words['channel']}, counter {words['observed']}, expected >= {words['expected']})"
    if words["status"] == ERROR_REPORTED_BY_PEER:
        text += f"; rank {rank} told rank {words['reporter']}"
    return text + "; the buffer is unusable: destroy it and create a new one"


def describe_input_error(words: dict[str, int], num_experts: int) -> str:
    """The text of an invalid `topk_idx` value that a dispatch found on the device."""
    where = f"at [{words['input_row']}, {words['input_lane']}]"
    if words["input_reason"] == INPUT_OUT_OF_RANGE:
        what = (
            f"values must be in [-1, {num_experts}) (num_experts = {num_experts}), got {words['input_value']} {where}"
        )
    else:
        what = f"rows must not repeat an expert, got {words['input_value']} again {where}"
    return (
        f"dispatch: `topk_idx` {what}; found on the device by a dispatch without CPU sync, "
        "which sent nothing (its handle routes nothing)"
    )


@dataclass
class NvlinkDispatchState:
    """What a handle keeps for combine and cached dispatch (device tensors, no host sync needed)."""

    slot_idx: torch.Tensor  # [num_tokens, num_ranks] int32, -1 where the token skips a rank
    num_tokens_per_rank: torch.Tensor  # [num_ranks] int32, tokens sent to each rank
    num_out_rows: int  # rows of recv_x (exact with CPU sync, worst case without)
    num_meta_rows: int  # rows of recv_src_metadata
    num_expanded_rows: int  # rows of the expanded layout (reported in both modes)


class NvlinkRuntime:
    """The window and kernel launches of one buffer.

    Arguments:
        open_windows: opens every rank's window of this buffer (collective); called once this rank's
            own memory is allocated (an allocation of pinned or device memory while a peer's kernel
            runs would keep them apart: see `deep_ep.loopback`).
        share: the part of the GPU this rank's kernels may use.
        num_gpu_timeout_secs: deadline of every device-side wait.
        num_cpu_timeout_secs: deadline of every host-side wait.
    """

    def __init__(
        self, open_windows: Callable[[], PeerWindows], share: DeviceShare, num_gpu_timeout_secs: float,
        num_cpu_timeout_secs: float,
    ) -> None:  # fmt: skip
        self.share = share
        self.num_device_sms = share.num_sms
        self.timeout_ns = int(num_gpu_timeout_secs * 1e9)
        self.cpu_timeout_s = float(num_cpu_timeout_secs)
        self.error_block = torch.zeros(len(ERROR_WORDS), dtype=torch.int64, pin_memory=True)
        # Received counts per source rank, then per local expert, then the invalid-input flag: the
        # dispatch kernel fills the device copy, a D2H copy brings them to pinned memory (device reads
        # of host memory are slow)
        num_count_words = MAX_RANKS + MAX_LOCAL_EXPERTS + 1
        self.device_counts = torch.zeros(num_count_words, dtype=torch.int32, device="cuda")
        self.host_counts = torch.zeros(num_count_words, dtype=torch.int32, pin_memory=True)
        self.dispatch_scratch = torch.zeros(DISPATCH_SCRATCH_INTS, dtype=torch.int32, device="cuda")
        self._expand_scratch: torch.Tensor | None = None
        self._num_experts_checked = 0  # of the last dispatch that validated routing on the device
        self.dead_reason: str | None = None
        self._dead_error: type[EPError] = EPError
        self.windows = open_windows()
        self.rank, self.num_ranks = self.windows.rank, self.windows.num_ranks
        if self.num_ranks > MAX_RANKS:
            self.windows.destroy()
            raise ValueError(f"NVLink kernels support at most {MAX_RANKS} ranks, the group has {self.num_ranks}")
        self._write_workspace()

    def _write_workspace(self) -> None:
        """This rank, the number of ranks and every rank's window base, into our window's workspace
        (fault.cuh and comm.cuh read them there)."""
        world = torch.tensor([self.rank, self.num_ranks], dtype=torch.int32).view(torch.uint8)
        peers = torch.tensor(self.windows.peer_ptrs, dtype=torch.int64).view(torch.uint8)
        window = self.windows.bytes
        window[RANK_OFFSET : NUM_RANKS_OFFSET + 4].copy_(world)
        window[PEER_WINDOWS_OFFSET : PEER_WINDOWS_OFFSET + peers.numel()].copy_(peers)
        torch.cuda.current_stream().synchronize()

    # ---------------------------------------------------------------- faults

    def check_error(self) -> None:
        """Raise if this buffer failed: `EPTimeoutError` for a device wait that expired here or on a
        peer, `EPOperationMismatchError` when the ranks ran different operations, `EPError` after an
        exception between two launches of one operation."""
        if self.dead_reason is None and int(self.error_block[0]) != 0:
            words = dict(zip(ERROR_WORDS, self.error_block.tolist(), strict=True))
            self.dead_reason = describe_fault(words, self.timeout_ns / 1e9)
            self._dead_error = EPOperationMismatchError if words["phase"] == _OP_MISMATCH_PHASE else EPTimeoutError
        if self.dead_reason is not None:
            raise self._dead_error(self.dead_reason)

    def take_input_error(self) -> None:
        """Raise the `ValueError` of an invalid `topk_idx` that an earlier dispatch found on the
        device (once; the buffer stays usable: that dispatch sent nothing). Called at the end of a
        call, once its own work is enqueued: raising before it would leave the peers waiting."""
        if int(self.error_block[_INPUT_WORDS.start]) == 0:
            return
        words = dict(zip(ERROR_WORDS, self.error_block.tolist(), strict=True))
        self.error_block[_INPUT_WORDS] = 0
        raise ValueError(describe_input_error(words, self._num_experts_checked))

    def _fail_between_launches(self, op: str, error: BaseException) -> None:
        if self.dead_reason is None:
            self.dead_reason = (
                f"{op} raised {type(error).__name__} ({error}) after its first kernel was launched, which leaves "
                "the window half-way through an operation; the buffer is unusable: destroy it and create a new one"
            )

    def wait(self, stream: torch.cuda.Stream, what: str) -> None:
        """Wait on the host, with a deadline, for everything queued on `stream`.

        Busy-polls first: a sleep costs at least a scheduler tick (milliseconds in a VM), far more
        than a dispatch; only waits longer than `_SPIN_S` back off to short sleeps.
        """
        if not wait_for_stream(stream, timeout_s=self.cpu_timeout_s, spin_s=_SPIN_S):
            self.dead_reason = f"host wait for {what} on rank {self.rank} passed {self.cpu_timeout_s:g} s"
            self._dead_error = EPTimeoutError
            raise EPTimeoutError(self.dead_reason)
        self.check_error()

    # ---------------------------------------------------------------- grids

    def comm_grid(self, num_sms: int) -> int:
        """CTAs of a communication kernel: at most the share, less one SM for the epilogue when the
        two must fit it together."""
        limit = self.num_device_sms - 1 if self.share.exclusive else self.num_device_sms
        return max(1, min(num_sms, limit))

    def _grid_for_rows(self, num_rows: int, num_busy_sms: int) -> int:
        """CTAs for an epilogue over `num_rows` rows: one warp per row, at most one CTA per SM, and
        only the SMs the running communication kernel (`num_busy_sms`) leaves free. An epilogue CTA
        cannot share an SM with a communication CTA (registers), so one placed behind it would hold
        its rows, spread over the whole batch, until the transfer ends. With an exclusive share, the
        free SMs are all there is."""
        rows_per_cta = specs.NUM_THREADS // 32
        num_free_sms = self.num_device_sms - num_busy_sms
        if self.share.exclusive or num_free_sms >= self.num_device_sms // 4:
            num_sms = max(1, num_free_sms)
        else:
            num_sms = self.num_device_sms
        return max(1, min(num_sms, (num_rows + rows_per_cta - 1) // rows_per_cta))

    # ---------------------------------------------------------------- barrier

    def barrier(self, stream: torch.cuda.Stream) -> None:
        self.check_error()
        (kernel,) = self.share.load([specs.barrier_spec(self.num_ranks)])
        kernel.launch(grid=(1,), block=(128,), stream=stream, args=(
            U64(self.windows.ptr), I32(self.rank), U64(_ptr(self.error_block)), U64(self.timeout_ns)))  # fmt: skip

    # ---------------------------------------------------------------- dispatch

    def check_capacity(self, slot_bytes: int, num_max_tokens_per_rank: int, what: str) -> None:
        needed = WORKSPACE_BYTES + self.num_ranks * num_max_tokens_per_rank * slot_bytes
        if needed > self.windows.num_bytes:
            raise ValueError(
                f"{what}: the buffer holds {self.windows.num_bytes} bytes per rank but this call needs {needed} "
                f"({num_max_tokens_per_rank} tokens x {self.num_ranks} ranks x {slot_bytes} bytes); create the buffer "
                "with ElasticBuffer.get_buffer_size_hint(...) for this shape"
            )

    def _expand_rank_scratch(self, num_elements: int) -> torch.Tensor:
        if self._expand_scratch is None or self._expand_scratch.numel() < num_elements:
            self._expand_scratch = self.share.empty((num_elements,), dtype=torch.int32, device="cuda")
        return self._expand_scratch

    def _dispatch_outputs(
        self, num_out_rows: int, x: torch.Tensor, x_scales: torch.Tensor | None, num_topk: int,
        has_weights: bool, do_expand: bool, col_major_scales: bool, num_local_experts: int,
    ) -> dict:  # fmt: skip
        """The output tensors of one dispatch with `num_out_rows` rows (exact or worst case)."""
        empty, device = self.share.empty, x.device
        out: dict[str, Any] = {"recv_x": empty((num_out_rows, x.shape[1]), dtype=x.dtype, device=device)}
        out["recv_scales"], out["scale_col_stride"] = None, 0
        if x_scales is not None:
            num_scales = x_scales.shape[1]
            if col_major_scales:
                out["scale_col_stride"] = align(num_out_rows, 4)
                storage = empty((num_scales * out["scale_col_stride"],), dtype=x_scales.dtype, device=device)
                out["recv_scales"] = storage.as_strided((num_out_rows, num_scales), (1, out["scale_col_stride"]))
            else:
                out["recv_scales"] = empty((num_out_rows, num_scales), dtype=x_scales.dtype, device=device)
        out["recv_topk_idx"] = None if do_expand else empty((num_out_rows, num_topk), dtype=torch.int64, device=device)
        out["recv_topk_weights"] = None
        if has_weights:
            shape = (num_out_rows,) if do_expand else (num_out_rows, num_topk)
            out["recv_topk_weights"] = empty(shape, dtype=torch.float32, device=device)
        out["psum_num_recv_tokens_per_rank"] = empty((self.num_ranks,), dtype=torch.int32, device=device)
        out["psum_num_recv_tokens_per_expert"] = empty((num_local_experts,), dtype=torch.int32, device=device)
        return out

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
            `num_recv_tokens` (int), `num_out_rows` (int), `dst_slot_idx` and `state`.
        """
        self.check_error()
        num_tokens, num_topk = topk_idx.shape
        hidden_bytes = x.shape[1] * x.element_size()
        scale_bytes = 0 if x_scales is None else x_scales.shape[1] * 4
        num_local_experts = num_experts // self.num_ranks
        record = DispatchRecordLayout(hidden_bytes, scale_bytes, num_topk)
        self.check_capacity(record.num_bytes, num_max_tokens_per_rank, "dispatch")
        device = x.device
        args_common = (self.num_ranks, hidden_bytes, scale_bytes, num_topk)
        num_sms = self.comm_grid(num_sms)
        fresh = cached is None
        expand_ranks = fresh and do_expand
        kernel_specs = [specs.dispatch_spec(*args_common, not fresh)]
        if expand_ranks:
            kernel_specs.append(specs.dispatch_expand_rank_spec(*args_common))
        kernel_specs.append(specs.dispatch_epilogue_spec(*args_common, do_expand))
        loaded = self.share.load(kernel_specs)
        dispatch_kernel, epilogue_kernel = loaded[0], loaded[-1]
        op_hash = specs.op_hash("dispatch", num_max_tokens_per_rank, record.num_bytes, num_topk)
        arrival_slots = arrival_block(num_max_tokens_per_rank)
        max_recv = self.num_ranks * num_max_tokens_per_rank
        empty = self.share.empty

        counts_list, expand_scratch, dst_slot_idx = None, None, None
        if fresh:
            slot_idx = empty((num_tokens, self.num_ranks), dtype=torch.int32, device=device)
            dst_slot_idx = empty((num_tokens, num_topk), dtype=torch.int32, device=device)
            num_tokens_per_rank = empty((self.num_ranks,), dtype=torch.int32, device=device)
            num_recv_per_expert = empty((num_local_experts,), dtype=torch.int32, device=device)
            if expand_ranks:
                expand_scratch = self._expand_rank_scratch(max_recv * num_topk)
            self._num_experts_checked = num_experts
        else:
            slot_idx, num_tokens_per_rank = cached.slot_idx, cached.num_tokens_per_rank
            num_recv_per_expert = cached_num_recv_tokens_per_expert
            if cumulative_stats is not None:
                cumulative_stats.add_(num_recv_per_expert)

        # Without a host wait every shape is known now: allocate before the first launch
        state = outputs = recv_src_metadata = None
        if not fresh:
            state, recv_src_metadata = cached, cached_recv_src_metadata
        elif not do_cpu_sync:
            num_expanded_rows = self.worst_case_expanded_rows(
                num_max_tokens_per_rank, num_topk, num_local_experts, expert_alignment
            )
            num_out_rows = num_expanded_rows if do_expand else max_recv
            state = NvlinkDispatchState(slot_idx, num_tokens_per_rank, num_out_rows, max_recv, num_expanded_rows)
            recv_src_metadata = empty((max_recv, 2 + num_topk), dtype=torch.int32, device=device)
        if state is not None:
            outputs = self._dispatch_outputs(state.num_out_rows, x, x_scales, num_topk, topk_weights is not None,
                                             do_expand, use_tma_aligned_col_major_sf, num_local_experts)  # fmt: skip

        dispatch_args = specs.DispatchArgs(
            window_base=self.windows.ptr, x=_ptr(x), x_scales=_ptr(x_scales), topk_idx=_ptr(topk_idx),
            topk_weights=_ptr(topk_weights), slot_idx=_ptr(slot_idx), dst_slot_idx=_ptr(dst_slot_idx),
            layout_scratch=_ptr(self.dispatch_scratch), num_tokens_per_rank=_ptr(num_tokens_per_rank),
            num_recv_tokens_per_expert=_ptr(num_recv_per_expert),
            counts_out=_ptr(self.device_counts) if (fresh and do_cpu_sync) else 0,
            cumulative_stats=_ptr(cumulative_stats) if fresh else 0, num_tokens=num_tokens,
            num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank, num_experts_per_rank=num_local_experts,
            tokens_per_group=tokens_per_group(num_tokens, self.num_ranks),
            tokens_per_task=rows_per_task(num_tokens, num_sms, 4), arrival_block=arrival_slots, op_hash=op_hash,
            error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
        # A fresh dispatch's grid barrier needs every CTA resident at once: a cooperative launch
        # makes the driver guarantee it (or refuse), whatever else holds SMs
        dispatch_kernel.launch(grid=(num_sms,), block=(specs.NUM_THREADS,), stream=stream,
                               args=(Opaque(bytes(dispatch_args)),), cooperative=fresh)  # fmt: skip

        rejected = False
        try:
            if expand_ranks:
                expand_grid = max(1, min(num_local_experts, num_sms if self.share.exclusive else self.num_device_sms))
                loaded[1].launch(
                    grid=(expand_grid,), block=(specs.NUM_EXPAND_RANK_THREADS,), stream=stream,
                    args=(U64(self.windows.ptr), I32(num_max_tokens_per_rank), I32(self.rank), I32(num_local_experts),
                          U64(_ptr(expand_scratch)), I32(arrival_slots), I32(op_hash), U64(_ptr(self.error_block)),
                          U64(self.timeout_ns)))  # fmt: skip
            if state is None:
                num_words = self.num_ranks + num_local_experts + 1
                self.host_counts[:num_words].copy_(self.device_counts[:num_words], non_blocking=True)
                self.wait(stream, "dispatch counts")
                counts = self.host_counts[:num_words].tolist()
                if counts[-1]:
                    # Our routing was rejected on the device (nothing sent), but peers sent us theirs
                    self._drain_dispatch(epilogue_kernel, stream, num_max_tokens_per_rank, num_local_experts,
                                         arrival_slots, op_hash)  # fmt: skip
                    rejected = True
                else:
                    num_recv_tokens = sum(counts[: self.num_ranks])
                    counts_list = [align(c, expert_alignment) for c in counts[self.num_ranks : -1]]
                    num_expanded_rows = sum(counts_list)
                    num_out_rows = num_expanded_rows if do_expand else num_recv_tokens
                    state = NvlinkDispatchState(slot_idx, num_tokens_per_rank, num_out_rows, num_recv_tokens,
                                                num_expanded_rows)  # fmt: skip
                    recv_src_metadata = empty((num_recv_tokens, 2 + num_topk), dtype=torch.int32, device=device)
                    outputs = self._dispatch_outputs(num_out_rows, x, x_scales, num_topk, topk_weights is not None,
                                                     do_expand, use_tma_aligned_col_major_sf, num_local_experts)  # fmt: skip
            if not rejected:
                # The epilogue runs next to the dispatch kernel unless a host wait (CPU sync) came
                # between; in an exclusive share its SMs count as busy anyway (it may still be sending)
                num_busy_sms = 0 if (fresh and do_cpu_sync and not self.share.exclusive) else num_sms
                self._launch_dispatch_epilogue(epilogue_kernel, stream, x, x_scales, state, outputs,
                                               recv_src_metadata, num_recv_per_expert, expand_scratch, cached,
                                               num_max_tokens_per_rank, num_local_experts, expert_alignment,
                                               do_zero_padding, arrival_slots, op_hash, num_busy_sms)  # fmt: skip
        except BaseException as error:
            self._fail_between_launches("dispatch", error)
            raise
        if rejected:
            # The device's record of the first bad value, else the host finds it
            self.take_input_error()
            check_topk_idx_values("dispatch", topk_idx, num_experts)
            raise ValueError(f"dispatch: `topk_idx` must hold distinct expert ids in [-1, {num_experts}) per row")
        self.take_input_error()
        return {
            **{name: outputs[name] for name in ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights")},
            "recv_src_metadata": recv_src_metadata,
            "psum_num_recv_tokens_per_rank": outputs["psum_num_recv_tokens_per_rank"],
            "num_recv_tokens_per_expert": num_recv_per_expert,
            "psum_num_recv_tokens_per_expert": outputs["psum_num_recv_tokens_per_expert"],
            "num_recv_tokens_per_expert_host": counts_list,
            "num_recv_tokens": state.num_meta_rows,
            "num_out_rows": state.num_out_rows,
            "dst_slot_idx": dst_slot_idx,
            "state": state,
        }

    def _launch_dispatch_epilogue(
        self, kernel: Any, stream: torch.cuda.Stream, x: torch.Tensor, x_scales: torch.Tensor | None,
        state: NvlinkDispatchState, outputs: dict, recv_src_metadata: torch.Tensor,
        num_recv_per_expert: torch.Tensor, expand_scratch: torch.Tensor | None, cached: NvlinkDispatchState | None,
        num_max_tokens_per_rank: int, num_local_experts: int, expert_alignment: int, do_zero_padding: bool,
        arrival_slots: int, op_hash: int, num_busy_sms: int,
    ) -> None:  # fmt: skip
        epilogue_args = specs.DispatchEpilogueArgs(
            window_base=self.windows.ptr, x=_ptr(x), x_scales=_ptr(x_scales),
            num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank,
            num_experts_per_rank=num_local_experts, expert_alignment=expert_alignment,
            num_out_rows=state.num_out_rows, num_meta_rows=state.num_meta_rows,
            scale_col_stride=outputs["scale_col_stride"], recv_x=_ptr(outputs["recv_x"]),
            recv_scales=_ptr(outputs["recv_scales"]), recv_topk_idx=_ptr(outputs["recv_topk_idx"]),
            recv_topk_weights=_ptr(outputs["recv_topk_weights"]), recv_src_metadata=_ptr(recv_src_metadata),
            psum_num_recv_tokens_per_rank=_ptr(outputs["psum_num_recv_tokens_per_rank"]),
            num_recv_tokens_per_expert=_ptr(num_recv_per_expert),
            psum_num_recv_tokens_per_expert=_ptr(outputs["psum_num_recv_tokens_per_expert"]),
            expand_rank_in_expert=_ptr(expand_scratch), is_cached=int(cached is not None),
            do_zero_padding=int(do_zero_padding), arrival_block=arrival_slots, op_hash=op_hash,
            error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
        grid = self._grid_for_rows(state.num_meta_rows, num_busy_sms)
        kernel.launch(grid=(grid,), block=(specs.NUM_THREADS,), stream=stream, args=(Opaque(bytes(epilogue_args)),),
                      pdl=True)  # fmt: skip

    def _drain_dispatch(
        self, kernel: Any, stream: torch.cuda.Stream, num_max_tokens_per_rank: int, num_local_experts: int,
        arrival_slots: int, op_hash: int,
    ) -> None:  # fmt: skip
        """Our input was rejected, but peers sent us their records: wait for them all and return the
        arrival counters to zero (the epilogue with no outputs), so the buffer stays usable."""
        drain_args = specs.DispatchEpilogueArgs(
            window_base=self.windows.ptr, num_max_tokens_per_rank=num_max_tokens_per_rank, rank=self.rank,
            num_experts_per_rank=num_local_experts, expert_alignment=1, drain_only=1, arrival_block=arrival_slots,
            op_hash=op_hash, error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
        kernel.launch(grid=(1,), block=(specs.NUM_THREADS,), stream=stream, args=(Opaque(bytes(drain_args)),),
                      pdl=True)  # fmt: skip

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
            recv_src_metadata: `[meta rows, 2 + num_topk]` int32 (from the handle).
            psum_num_recv_tokens_per_rank: `[num_ranks]` int32 (from the handle).

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
        num_sms = self.comm_grid(num_sms)
        combine_kernel, epilogue_kernel = self.share.load([
            specs.combine_spec(self.num_ranks, hidden, num_topk, num_rows, do_expand),
            specs.combine_epilogue_spec(self.num_ranks, hidden, num_topk, num_rows),
        ])  # fmt: skip
        op_hash = specs.op_hash("combine", num_max_tokens_per_rank, slot.num_bytes, num_topk)
        arrival_slots = arrival_block(num_max_tokens_per_rank)
        empty = self.share.empty
        combined_x = empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
        combined_w = None
        if topk_weights is not None:
            combined_w = empty((num_tokens, num_topk), dtype=torch.float32, device=x.device)

        combine_args = specs.CombineArgs(
            window_base=self.windows.ptr, x=_ptr(x), topk_weights=_ptr(topk_weights),
            recv_src_metadata=_ptr(recv_src_metadata),
            psum_num_recv_tokens_per_rank=_ptr(psum_num_recv_tokens_per_rank), num_x_rows=x.shape[0],
            num_meta_rows=recv_src_metadata.shape[0], num_max_tokens_per_rank=num_max_tokens_per_rank,
            rank=self.rank, rows_per_task=rows_per_task(num_tokens * self.num_ranks, num_sms, 2),
            arrival_block=arrival_slots, op_hash=op_hash, error_block=_ptr(self.error_block),
            timeout_ns=self.timeout_ns)  # fmt: skip
        combine_kernel.launch(grid=(num_sms,), block=(specs.NUM_THREADS,), stream=stream,
                              args=(Opaque(bytes(combine_args)),))  # fmt: skip
        try:
            # Always, even with no tokens here: the epilogue posts our window credit (credits.cuh)
            epilogue_args = specs.CombineEpilogueArgs(
                window_base=self.windows.ptr, topk_idx=_ptr(topk_idx), slot_idx=_ptr(state.slot_idx),
                bias_0=_ptr(bias_0), bias_1=_ptr(bias_1), combined_x=_ptr(combined_x),
                combined_topk_weights=_ptr(combined_w), local_x=0 if do_expand else _ptr(x),
                local_topk_weights=0 if do_expand else _ptr(topk_weights),
                psum_num_recv_tokens_per_rank=_ptr(psum_num_recv_tokens_per_rank),
                num_tokens_per_rank=_ptr(state.num_tokens_per_rank), num_local_rows=x.shape[0],
                num_tokens=num_tokens, num_max_tokens_per_rank=num_max_tokens_per_rank,
                num_experts_per_rank=num_local_experts, rank=self.rank, arrival_block=arrival_slots, op_hash=op_hash,
                error_block=_ptr(self.error_block), timeout_ns=self.timeout_ns)  # fmt: skip
            grid = self._grid_for_rows(num_tokens * ((hidden + 1023) // 1024), num_sms)  # (token, 1024-wide part) items
            epilogue_kernel.launch(grid=(grid,), block=(specs.NUM_THREADS,), stream=stream,
                                   args=(Opaque(bytes(epilogue_args)),), pdl=True)  # fmt: skip
        except BaseException as error:
            self._fail_between_launches("combine", error)
            raise
        self.take_input_error()
        return combined_x, combined_w

    # ---------------------------------------------------------------- teardown

    def destroy(self) -> None:
        """Release the windows (idempotent)."""
        self.windows.destroy()


def peer_store(runtime: NvlinkRuntime, stream: torch.cuda.Stream, src: torch.Tensor, num_sms: int) -> None:
    """Speed-of-light probe: stream `src` (uint8, a multiple of 16 bytes) into every peer's window.

    Every rank launching it at once loads the links in both directions, as dispatch and combine do.
    """
    if WORKSPACE_BYTES + src.numel() > runtime.windows.num_bytes:
        raise ValueError(f"peer_store: {src.numel()} bytes do not fit the window ({runtime.windows.num_bytes} bytes)")
    (kernel,) = runtime.share.load([specs.peer_store_spec()])
    kernel.launch(
        grid=(num_sms,), block=(specs.NUM_THREADS,), stream=stream,
        args=(U64(runtime.windows.ptr), I32(runtime.rank), I32(runtime.num_ranks), U64(WORKSPACE_BYTES), src,
              U64(src.numel())))  # fmt: skip
