"""`ReferenceBackend`: dispatch and combine with torch ops and torch.distributed collectives.

It runs on any process group (gloo on CPU, NCCL on GPUs) and computes exactly the contract of
`docs/semantics.md` in the documented order, so the GPU kernels can be compared with it bitwise.
Everything that travels is packed into one `torch.uint8` record per row (gloo cannot move FP8) and
exchanged with one `all_to_all_single`; the host learns the split sizes from one `all_gather` of
per-rank counts, which also checks that all ranks called with compatible arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from deep_ep.backends.base import (
    TMA_ALIGNED_SF_TOKENS,
    BufferConfig,
    CombineRequest,
    CombineResult,
    DispatchRequest,
    DispatchResult,
    EPBackend,
    ScaleKind,
    apply_rank_mask,
    worst_case_num_expanded_tokens,
    worst_case_num_recv_tokens,
)
from deep_ep.errors import EPPeerError, EPTimeoutError
from deep_ep.host_reads import host_list, to_host, wait_for_stream, wait_for_work
from deep_ep.utils.math import align

from .layout import RecvLayout, SendLayout, compute_recv_layout, compute_send_layout, send_offset

# The fields every rank sends before a dispatch; they must agree across ranks
# The text of a rank's rejection in the status exchange (`announce`)
_STATUS_BYTES = 256
_HEADER_FIELDS = (
    "cached",
    "num_experts",
    "num_max_tokens_per_rank",
    "num_topk",
    "expert_alignment",
    "do_expand",
    "hidden",
    "dtype",
    "scale_kind",
    "num_scale_packs",
    "has_weights",
)
# Every dtype of this torch, in a fixed order: `x` travels as raw bytes, and the ranks must agree on its dtype
_DTYPES = tuple(dict.fromkeys(v for n in sorted(dir(torch)) if isinstance(v := getattr(torch, n), torch.dtype)))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_SCALE_KIND_CODES = {ScaleKind.NONE: 0, ScaleKind.FP32: 1, ScaleKind.UE8M0: 2}
# How a disagreement on a header field is worded: the user's argument and its value per rank
_HEADER_ARGS = {
    "cached": ("`handle` (a cached dispatch)", lambda v: "given" if v else "None"),
    "hidden": ("`hidden` (x.shape[1])", str),
    "dtype": ("`x` dtype", lambda v: str(_DTYPES[v]).removeprefix("torch.")),
    "scale_kind": ("`x` scales (x[1])", lambda v: ("none", "float32", "int32 (UE8M0)")[v]),
    "num_scale_packs": ("number of scale packs (x[1].shape[1])", str),
    "has_weights": ("`topk_weights`", lambda v: "given" if v else "None"),
    "do_expand": ("`do_expand`", lambda v: str(bool(v))),
}


@dataclass
class ReferenceState:
    """The reference backend's part of an `EPHandle`."""

    send: SendLayout
    recv: RecvLayout
    num_masked_lanes: torch.Tensor | None = None  # with rank masking: the lanes its routing dropped


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of `t` (or `t` itself); unlike `contiguous()`, also fixes strides of size-1 dims."""
    if t.is_contiguous() and (t.dim() == 0 or t.stride(-1) == 1):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    """View a `[M, ...]` tensor as `[M, bytes per row]` `torch.uint8`."""
    num_row_bytes = t.element_size() * math.prod(t.shape[1:])
    return _dense(t).view(torch.uint8).reshape(t.shape[0], num_row_bytes)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, tail: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `_to_bytes`: `[M, bytes]` `torch.uint8` -> `[M, *tail]` of `dtype`."""
    # NOTES: a fresh copy, so that the storage offset is aligned for the wider dtype
    return torch.empty_like(b, memory_format=torch.contiguous_format).copy_(b).view(dtype).reshape(b.shape[0], *tail)


class _Unpacker:
    """Cuts consecutive byte columns out of received records."""

    def __init__(self, records: torch.Tensor) -> None:
        self.records = records
        self.offset = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        part = self.records[:, self.offset : self.offset + num_bytes]
        self.offset += num_bytes
        return part


def _empty_scales(num_rows: int, num_packs: int, like: torch.Tensor, col_major: bool, zero: bool) -> torch.Tensor:
    """Allocate `[num_rows, num_packs]` scales, row-major or TMA-aligned column-major."""
    strides = (1, align(num_rows, TMA_ALIGNED_SF_TOKENS)) if col_major else (num_packs, 1)
    scales = torch.empty_strided((num_rows, num_packs), strides, dtype=like.dtype, device=like.device)
    return scales.zero_() if zero else scales


class ReferenceBackend(EPBackend):
    """Dispatch and combine with torch collectives; the oracle of every other backend."""

    name = "reference"
    supports_rank_masking: ClassVar[bool] = True

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        super().__init__(group, config)
        self.rank_idx = config.rank_idx
        self.num_ranks = config.num_ranks
        self.device = config.device

    # Collectives with a host-side deadline
    def _wait(self, work: dist.Work, what: str, blocking: bool) -> None:
        # NOTES: NCCL work only needs a stream wait unless the host reads the result; gloo work blocks
        if (blocking or self.device.type == "cpu") and not wait_for_work(work, self.config.num_cpu_timeout_secs):
            raise EPTimeoutError(
                f"reference backend: rank {self.rank_idx} of {self.num_ranks} waited more than "
                f"{self.config.num_cpu_timeout_secs} s for {what}; a peer did not join "
                "(it failed, hangs, or called a different method)"
            )
        work.wait()

    def _all_gather(self, row: torch.Tensor, what: str) -> torch.Tensor:
        """All-gather a 1D int64 tensor into `[N, len]`, on the host."""
        outputs = [torch.empty_like(row) for _ in range(self.num_ranks)]
        work = dist.all_gather(outputs, row, group=self.group, async_op=True)
        self._wait(work, what, blocking=True)
        return to_host(torch.stack(outputs))

    def _all_to_all(
        self, records: torch.Tensor, send_counts: list[int], recv_counts: list[int], what: str
    ) -> torch.Tensor:
        """Exchange `[sum(send_counts), B]` uint8 records; returns `[sum(recv_counts), B]`."""
        output = torch.empty((sum(recv_counts), records.shape[1]), dtype=torch.uint8, device=self.device)
        work = dist.all_to_all_single(output, records, recv_counts, send_counts, group=self.group, async_op=True)
        self._wait(work, what, blocking=False)
        return output

    def _exchange_header(self, header: dict[str, int], send_counts: list[int]) -> list[int]:
        """All-gather the call's header and send counts; check agreement; return the receive counts."""
        row = torch.tensor(
            [header[name] for name in _HEADER_FIELDS] + send_counts, dtype=torch.int64, device=self.device
        )
        table = self._all_gather(row, "the dispatch count exchange").tolist()
        for i, name in enumerate(_HEADER_FIELDS):
            values = [table[rank][i] for rank in range(self.num_ranks)]
            if len(set(values)) != 1:
                label, show = _HEADER_ARGS.get(name, (f"`{name}`", str))
                shown = ", ".join(show(value) for value in values)
                raise ValueError(
                    f"dispatch: all ranks must pass the same {label}, got [{shown}] on ranks 0..{self.num_ranks - 1}"
                )
        return [table[rank][len(_HEADER_FIELDS) + self.rank_idx] for rank in range(self.num_ranks)]

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """See `EPBackend.dispatch`; the host synchronizes internally to learn the split sizes."""
        req = request
        if self.device.type == "cuda":
            wait_for_stream()  # torch's own host syncs below (nonzero) must find nothing queued
        handle = req.cached_handle
        num_local_experts = req.num_experts // self.num_ranks
        routing, num_masked_lanes = req.topk_idx, None
        if handle is None:
            if self.config.enable_rank_masking:
                routing, num_masked_lanes = apply_rank_mask(
                    req.topk_idx, req.masked_ranks, self.rank_idx, num_local_experts
                )
            send = compute_send_layout(
                routing, self.num_ranks, num_local_experts, self.rank_idx, req.num_max_tokens_per_rank
            )
        else:
            state: ReferenceState = handle.backend_state
            send = state.send
        header = {
            "cached": int(handle is not None),
            "num_experts": req.num_experts,
            "num_max_tokens_per_rank": req.num_max_tokens_per_rank,
            "num_topk": req.num_topk,
            "expert_alignment": req.expert_alignment,
            "do_expand": int(req.do_expand),
            "hidden": req.hidden,
            "dtype": _DTYPE_CODES[req.x.dtype],
            "scale_kind": _SCALE_KIND_CODES[req.scale_kind],
            "num_scale_packs": 0 if req.scales is None else req.scales.shape[1],
            "has_weights": int(req.topk_weights is not None),
        }
        recv_counts = self._exchange_header(header, send.send_counts)

        # Pack one record per (token, destination rank) and exchange them
        rows = send.send_token_idx
        parts = [_to_bytes(req.x)[rows]]
        if req.scales is not None:
            parts.append(_to_bytes(req.scales)[rows])
        if req.topk_weights is not None:
            parts.append(_to_bytes(req.topk_weights)[rows])
        if handle is None:
            parts.append(_to_bytes(routing)[rows])
            parts.append(_to_bytes(rows.to(torch.int64)))
        records = self._all_to_all(torch.cat(parts, dim=1), send.send_counts, recv_counts, "the dispatch data exchange")

        # Unpack
        unpacker = _Unpacker(records)
        num_topk, hidden = req.num_topk, req.hidden
        recv_x_bytes = unpacker.take(hidden * req.x.element_size())
        recv_scales = None
        if req.scales is not None:
            num_packs = req.scales.shape[1]
            recv_scales = _from_bytes(unpacker.take(4 * num_packs), req.scales.dtype, (num_packs,))
        recv_weights = None
        if req.topk_weights is not None:
            recv_weights = _from_bytes(unpacker.take(4 * num_topk), torch.float32, (num_topk,))
        if handle is None:
            recv_topk_idx = _from_bytes(unpacker.take(8 * num_topk), torch.int64, (num_topk,))
            src_token_idx = _from_bytes(unpacker.take(8), torch.int64, (1,))[:, 0]
            recv = compute_recv_layout(
                recv_counts, src_token_idx, recv_topk_idx, self.rank_idx, num_local_experts, req.expert_alignment
            )
            state = ReferenceState(send=send, recv=recv, num_masked_lanes=num_masked_lanes)
        recv = state.recv
        if req.cumulative_local_expert_recv_stats is not None:
            stats = req.cumulative_local_expert_recv_stats
            stats.add_(recv.counts.to(stats.dtype))
        req.wait_before_epilogue()  # the outputs are written from here on
        return self._make_result(req, state, recv_x_bytes, recv_scales, recv_weights)

    def _make_result(
        self,
        req: DispatchRequest,
        state: ReferenceState,
        recv_x_bytes: torch.Tensor,
        recv_scales: torch.Tensor | None,
        recv_weights: torch.Tensor | None,
    ) -> DispatchResult:
        """Lay the received rows out as the contract says (plain or expanded, exact or worst case)."""
        recv, handle = state.recv, req.cached_handle
        num_recv, num_topk, num_local_experts = recv.num_recv_tokens, req.num_topk, req.num_experts // self.num_ranks
        device = self.device

        # Output row counts: exact, worst case, or those of the cached handle
        if handle is not None:
            num_recv_alloc, num_expanded_alloc = handle.num_recv_tokens, handle.num_expanded_tokens
        elif req.do_cpu_sync:
            num_recv_alloc, num_expanded_alloc = num_recv, int(recv.aligned_counts.sum())
        else:
            num_recv_alloc = worst_case_num_recv_tokens(self.num_ranks, req.num_max_tokens_per_rank)
            num_expanded_alloc = worst_case_num_expanded_tokens(
                self.num_ranks, req.num_max_tokens_per_rank, num_topk, num_local_experts, req.expert_alignment
            )

        # Destination rows: the received order, or the expanded (row, lane) pairs
        if req.do_expand:
            num_rows = num_expanded_alloc
            src_rows, src_lanes = (recv.local_expert_idx >= 0).nonzero(as_tuple=True)
            dst_rows = recv.expanded_row[src_rows, src_lanes]
        else:
            num_rows = num_recv_alloc
            src_rows = dst_rows = torch.arange(num_recv, device=device)
        zero = req.do_expand and req.do_zero_padding
        factory = torch.zeros if zero else torch.empty

        recv_x = factory((num_rows, recv_x_bytes.shape[1]), dtype=torch.uint8, device=device)
        recv_x[dst_rows] = recv_x_bytes[src_rows]
        recv_x = recv_x.view(req.x.dtype)
        out_scales = None
        if recv_scales is not None:
            out_scales = _empty_scales(
                num_rows, recv_scales.shape[1], recv_scales, req.use_tma_aligned_col_major_sf, zero
            )
            out_scales[dst_rows] = recv_scales[src_rows]
        out_weights = None
        if recv_weights is not None:
            if req.do_expand:
                out_weights = factory((num_rows,), dtype=torch.float32, device=device)
                out_weights[dst_rows] = recv_weights[src_rows, src_lanes]
            else:
                out_weights = torch.empty((num_rows, num_topk), dtype=torch.float32, device=device)
                out_weights[:num_recv] = recv_weights
        out_topk_idx = None
        if not req.do_expand:
            out_topk_idx = torch.empty((num_rows, num_topk), dtype=torch.int64, device=device)
            out_topk_idx[:num_recv] = recv.local_expert_idx

        if handle is not None:
            return DispatchResult(
                recv_x=recv_x,
                recv_scales=out_scales,
                recv_topk_idx=out_topk_idx,
                recv_topk_weights=out_weights,
                num_recv_tokens=handle.num_recv_tokens,
                num_expanded_tokens=handle.num_expanded_tokens,
                num_recv_tokens_per_expert_list=handle.num_recv_tokens_per_expert_list,
                psum_num_recv_tokens_per_scaleup_rank=handle.psum_num_recv_tokens_per_scaleup_rank,
                psum_num_recv_tokens_per_expert=handle.psum_num_recv_tokens_per_expert,
                num_unaligned_recv_tokens_per_expert=handle.num_unaligned_recv_tokens_per_expert,
                recv_src_metadata=handle.recv_src_metadata,
                dst_buffer_slot_idx=handle.dst_buffer_slot_idx,
                backend_state=state,
                num_masked_lanes=state.num_masked_lanes,
            )

        # Handle fields
        metadata = torch.full((num_recv_alloc, 2 + num_topk), -1, dtype=torch.int32, device=device)
        metadata[:num_recv, 0] = (recv.src_rank * req.num_max_tokens_per_rank + recv.src_token_idx).to(torch.int32)
        # V2's column 1: the source rank times K plus the token's highest lane to this rank (master lane)
        lanes = torch.arange(num_topk, device=device).expand(num_recv, num_topk)
        master_lane = torch.where(recv.local_expert_idx >= 0, lanes, -1).max(dim=1).values
        metadata[:num_recv, 1] = (recv.src_rank * num_topk + master_lane).to(torch.int32)
        if req.do_expand:
            metadata[:num_recv, 2:] = recv.expanded_row.to(torch.int32)
        psum_ranks = torch.tensor(recv.recv_counts, dtype=torch.int64, device=device).cumsum(dim=0)
        if req.do_expand:
            psum_experts = recv.aligned_counts.cumsum(dim=0) - recv.aligned_counts + recv.counts
        else:
            psum_experts = recv.aligned_counts.cumsum(dim=0)
        return DispatchResult(
            recv_x=recv_x,
            recv_scales=out_scales,
            recv_topk_idx=out_topk_idx,
            recv_topk_weights=out_weights,
            num_recv_tokens=num_recv_alloc,
            num_expanded_tokens=num_expanded_alloc,
            num_recv_tokens_per_expert_list=host_list(recv.aligned_counts) if req.do_cpu_sync else None,
            psum_num_recv_tokens_per_scaleup_rank=psum_ranks.to(torch.int32),
            psum_num_recv_tokens_per_expert=psum_experts.to(torch.int32),
            num_unaligned_recv_tokens_per_expert=recv.counts.to(torch.int32),
            recv_src_metadata=metadata,
            dst_buffer_slot_idx=state.send.dst_buffer_slot_idx,
            backend_state=state,
            num_masked_lanes=state.num_masked_lanes,
        )

    def combine(self, request: CombineRequest) -> CombineResult:
        """See `EPBackend.combine`: FP32 sums in the contract's order, one rounding to BF16."""
        req, handle = request, request.handle
        if self.device.type == "cuda":
            wait_for_stream()  # torch's own host syncs below (nonzero) must find nothing queued
        state: ReferenceState = handle.backend_state
        send, recv = state.send, state.recv
        num_recv, num_topk, num_tokens = recv.num_recv_tokens, handle.num_topk, handle.num_tokens
        hidden = req.x.shape[1]
        device = self.device
        per_lane = handle.do_expand and not req.allow_multiple_reduction
        local = recv.local_expert_idx >= 0

        # What travels back: one row per (token, holder rank), or one per (token, local lane)
        weights = None
        if not handle.do_expand:
            rows = req.x[:num_recv]
            if req.topk_weights is not None:
                weights = req.topk_weights[:num_recv]
            send_counts, recv_counts = recv.recv_counts, send.send_counts
        elif req.allow_multiple_reduction:
            # Sum this rank's lanes of each token in FP32, lanes ascending, and round once to BF16
            acc = torch.zeros((num_recv, hidden), dtype=torch.float32, device=device)
            for lane in range(num_topk):
                lane_rows = local[:, lane].nonzero()[:, 0]
                expanded = recv.expanded_row[lane_rows, lane]
                acc[lane_rows] = acc[lane_rows] + req.x[expanded].float()
            rows = acc.to(torch.bfloat16)
            if req.topk_weights is not None:
                weights = torch.zeros((num_recv, num_topk), dtype=torch.float32, device=device)
                weights[local] = req.topk_weights[recv.expanded_row[local]]
            send_counts, recv_counts = recv.recv_counts, send.send_counts
        else:
            pair_rows, pair_lanes = local.nonzero(as_tuple=True)
            expanded = recv.expanded_row[pair_rows, pair_lanes]
            rows = req.x[expanded]
            if req.topk_weights is not None:
                weights = req.topk_weights[expanded].unsqueeze(1)
            pairs_per_row = local.sum(dim=1)
            send_counts = torch.zeros(self.num_ranks, dtype=torch.int64, device=device)
            send_counts = host_list(send_counts.index_add_(0, recv.src_rank, pairs_per_row))
            dst = send.dst_rank
            recv_counts = [
                int(v)
                for v in host_list((dst.unsqueeze(2) == torch.arange(self.num_ranks, device=device)).sum(dim=(0, 1)))
            ]
        parts = [_to_bytes(rows)]
        if weights is not None:
            parts.append(_to_bytes(weights))
        records = self._all_to_all(torch.cat(parts, dim=1), send_counts, recv_counts, "the combine data exchange")
        request.wait_before_epilogue()  # the reduction into the outputs starts here
        unpacker = _Unpacker(records)
        back_rows = _from_bytes(unpacker.take(2 * hidden), torch.bfloat16, (hidden,))
        back_weights = None
        if weights is not None:
            back_weights = _from_bytes(unpacker.take(4 * weights.shape[1]), torch.float32, (weights.shape[1],))

        # Where each holder's row of each token landed: per (token, holder rank), or per (token, lane)
        combined_weights = None
        if weights is not None:
            combined_weights = torch.zeros((num_tokens, num_topk), dtype=torch.float32, device=device)
        row_at = torch.full((num_tokens, num_topk if per_lane else self.num_ranks), -1, dtype=torch.int64,
                            device=device)  # fmt: skip
        offset = 0
        for rank in range(self.num_ranks):
            count = recv_counts[rank]
            block = slice(offset, offset + count)
            if per_lane:
                tokens, lanes = (send.dst_rank == rank).nonzero(as_tuple=True)
                row_at[tokens, lanes] = torch.arange(offset, offset + count, device=device)
                if back_weights is not None:
                    combined_weights[tokens, lanes] = back_weights[block, 0]
            else:
                tokens = send.send_token_idx[send_offset(send.send_counts, rank) :][:count]
                row_at[tokens, rank] = torch.arange(offset, offset + count, device=device)
                if back_weights is not None:
                    mine = send.dst_rank[tokens] == rank
                    combined_weights[tokens] = torch.where(mine, back_weights[block], combined_weights[tokens])
            offset += count

        # Reduce at home in DeepEP V2's order: from +0.0, bias 0, bias 1, then one partial per holder
        # rank, holders by ascending last lane (per lane: every lane's row, lanes ascending); FP32.
        # Hybrid mode adds a stage: each scale-up domain's holder partials, in the same order, from
        # +0.0 in FP32 and rounded to BF16, then the domain partials by ascending last lane
        acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
        for bias in (req.bias_0, req.bias_1):
            if bias is not None:
                acc = acc + bias.float()
        token_idx = torch.arange(num_tokens, device=device)
        num_scaleup = self.config.num_scaleup_ranks or self.num_ranks
        domain_of = torch.where(send.dst_rank >= 0, send.dst_rank // num_scaleup, -1)
        domain_acc = None
        if not per_lane and num_scaleup < self.num_ranks:
            # One FP32 accumulator per domain a token reaches (at most min(domains, K)), numbered in
            # the order of each domain's first lane
            same = domain_of.unsqueeze(2) == domain_of.unsqueeze(1)  # [T, K, K]
            first_lane = same.int().argmax(dim=2)  # the first lane of each lane's domain
            is_first = (first_lane == torch.arange(num_topk, device=device)) & (domain_of >= 0)
            ordinal = torch.cumsum(is_first.int(), dim=1) - 1
            domain_slot = ordinal.gather(1, first_lane)
            num_slots = min(self.num_ranks // num_scaleup, num_topk)
            domain_acc = torch.zeros((num_tokens, num_slots, hidden), dtype=torch.float32, device=device)
        for lane in range(num_topk):
            dst = send.dst_rank[:, lane]
            if per_lane:
                rows = row_at[:, lane]
            else:
                # A holder's partial is added at its last lane: no later lane goes to the same rank
                later = send.dst_rank[:, lane + 1 :] == dst.unsqueeze(1)
                last = (dst >= 0) & ~later.any(dim=1)
                rows = torch.where(last, row_at[token_idx, dst.clamp(min=0)], -1)
            tokens = (rows >= 0).nonzero()[:, 0]
            if domain_acc is None:
                acc[tokens] = acc[tokens] + back_rows[rows[tokens]].float()
                continue
            slot = domain_slot[tokens, lane]
            domain_acc[tokens, slot] = domain_acc[tokens, slot] + back_rows[rows[tokens]].float()
            # A domain's partial is added at its last lane
            domain_done = (dst >= 0) & ~(domain_of[:, lane + 1 :] == domain_of[:, lane].unsqueeze(1)).any(dim=1)
            done = domain_done.nonzero()[:, 0]
            partial = domain_acc[done, domain_slot[done, lane]].to(torch.bfloat16)
            acc[done] = acc[done] + partial.float()
        return CombineResult(combined_x=acc.to(torch.bfloat16), combined_topk_weights=combined_weights)

    def announce(self, op: str, error: BaseException | None) -> None:
        """Every rank says whether it goes ahead with `op`, in one all-gather before any data moves
        (a message slot per rank): a rejection makes every peer raise `EPPeerError` at once instead
        of waiting in the exchange for this rank, and the buffer stays usable (nothing moved)."""
        if self.num_ranks == 1 or (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
            return  # under capture every call of this backend is refused (it waits on the host)
        message = b"" if error is None else f"{type(error).__name__}: {error}".encode()[: _STATUS_BYTES - 1]
        status = torch.zeros(1 + _STATUS_BYTES // 8, dtype=torch.int64)
        status[0] = int(error is not None)
        if message:
            status[1:].view(torch.uint8)[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
        table = self._all_gather(status.to(self.device), f"the status exchange of {op}")
        rejected = [r for r in range(self.num_ranks) if int(table[r, 0]) and r != self.rank_idx]
        if error is not None or not rejected:
            return  # the rejecting rank raises its own error
        texts = []
        for rank in rejected:
            text = bytes(table[rank, 1:].contiguous().view(torch.uint8).tolist()).split(b"\0", 1)[0]
            texts.append(f"rank {rank} rejected its input ({text.decode(errors='replace')})")
        raise EPPeerError(f"{op}: {'; '.join(texts)}; nothing was exchanged and the buffer stays usable")

    def barrier(self) -> None:
        """All ranks meet (a one-element all-reduce with the CPU deadline)."""
        token = torch.ones(1, dtype=torch.int32, device=self.device)
        work = dist.all_reduce(token, group=self.group, async_op=True)
        self._wait(work, "the barrier", blocking=True)

    def destroy(self) -> None:
        """Nothing to release: the reference backend holds no memory of its own."""
