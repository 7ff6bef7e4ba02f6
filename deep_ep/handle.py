"""`EPHandle`: what one dispatch leaves behind for its combine and for cached dispatches."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from deep_ep.backends.base import ScaleKind


class BufferLifetime:
    """Whether an `ElasticBuffer` still lives, shared with its handles: a handle that outlived its
    buffer can then say why it no longer works anywhere.

    Attributes:
        ended: `None` while the buffer lives, else how it ended (`'destroyed'`, `'garbage collected'`).
    """

    def __init__(self) -> None:
        self.ended: str | None = None

    def end(self, how: str) -> None:
        """Record the end of the buffer; the first end wins (a destroyed buffer is collected later)."""
        if self.ended is None:
            self.ended = how


@dataclass(frozen=True)
class BufferOrigin:
    """Which buffer made a handle, told apart from the buffer it is passed to: another buffer of the
    same group, another process group, another `LoopbackWorld` or another virtual rank of one.

    The group and the world are weak references: a handle must not keep a finished group (or world)
    alive, and one that is gone is another group all the same.

    Attributes:
        buffer_id: the `ElasticBuffer.buffer_id` of the buffer.
        rank_idx: its rank in its group.
        num_ranks: the size of its group.
        group: a weak reference to its `torch.distributed.ProcessGroup`.
        world: a weak reference to the `deep_ep.loopback.LoopbackWorld` of its virtual ranks, else `None`.
        lifetime: whether the buffer still lives.
    """

    buffer_id: int
    rank_idx: int
    num_ranks: int
    group: weakref.ref
    world: weakref.ref | None
    lifetime: BufferLifetime


class EPHandle:
    """Communication handle returned by `ElasticBuffer.dispatch`.

    Pass it to `ElasticBuffer.combine` to send the rows back, or to `ElasticBuffer.dispatch` (with
    `topk_idx=None`) to dispatch new data with the same routing without recomputing the layout.
    A handle is the record of its dispatch: leave its fields as they are (the steady path keeps what
    it read of them the first time).
    Notation as in `deep_ep.backends.base`: `N` ranks, `L` local experts, `T` tokens of the dispatching
    rank, `K` lanes, `Tmax` max tokens per rank, `a` the expert alignment.

    Attributes (DeepEP V2):
        do_expand: whether the expanded layout (one row per (token, local expert)) was used.
        num_experts: the number of experts `E`.
        expert_alignment: `a`, every local expert's row count is aligned up to it.
        num_max_tokens_per_rank: `Tmax`.
        num_sms: the SM count of the dispatch (reused by combine when it passes `num_sms=0`).
        topk_idx: `[T, K]` with `torch.int64`, the routing (a clone of the user's with `do_handle_copy`).
        num_recv_tokens: rows of the non-expanded outputs and of `recv_src_metadata`; without CPU sync
            this is the worst case `N * Tmax` (it may not be exact without CPU sync).
        num_expanded_tokens: rows of the expanded outputs; with CPU sync `sum_e align(count_e, a)`,
            without it the worst case `align(N * Tmax * min(K, L) + L * (a - 1), a)`.
        num_recv_tokens_per_expert_list: Python list of the aligned per-expert counts (`[]` without CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: `[N]` `torch.int32`, inclusive prefix sum of the tokens
            received from each rank; the last element is the real number of received tokens.
        psum_num_recv_tokens_per_expert: `[L]` `torch.int32`; non-expand: inclusive prefix sum of the
            aligned counts; expand: `sum_{j<e} align(count_j, a) + count_e`.
        num_unaligned_recv_tokens_per_expert: `[L]` `torch.int32`, the real per-expert counts.
        recv_src_metadata: `[num_recv_tokens, 2 + K]` `torch.int32`: `src_rank * Tmax + src_token_idx`,
            `src_rank * K + master lane` (the token's highest lane to this rank), then per lane the
            expanded row (expand mode, local lanes) or `-1`.
        dst_buffer_slot_idx: `[T, K]` `torch.int32`, on the token's highest lane to each destination
            rank `rank * Tmax + slot` at that destination; `-1` on its other lanes there and on `-1` lanes.
        token_metadata_at_forward: `None` (hybrid mode only, not used).
        channel_linked_list: `None` (hybrid mode only, not used).
        cached_recv_src_metadata_before_sort: `None`: our receive order needs no sort (`deterministic_sort`).

    Attributes (ours):
        num_tokens: `T`, the tokens this rank dispatched (and gets back from combine).
        num_topk: `K`.
        hidden: `H` of the dispatch.
        buffer_id: identifies the `ElasticBuffer` that made the handle (handles do not move between buffers).
        do_cpu_sync: whether the dispatch had exact (CPU-synced) shapes.
        scale_kind: the scale format of the dispatch that made the handle.
        backend_state: the backend's private state for combine and cached dispatch.
        buffer_origin: the `BufferOrigin` of the buffer that made the handle (`None` for a handle made
            by hand), for the error that names it when the handle reaches another buffer.
        masked_ranks: the ranks masked when the dispatch ran (`ElasticBuffer.mask_ranks`).
        num_masked_lanes: `[1]` `torch.int32`, the lanes of this rank's tokens that rank masking
            dropped (their expert's rank, or this rank, was masked); `None` without rank masking.
    """

    # What the steady path's keys take of a handle, kept once read (`Front.handle_summary`)
    _steady_shape: tuple | None = None

    def __init__(
        self,
        *,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens: int,
        num_expanded_tokens: int,
        num_recv_tokens_per_expert_list: list[int] | None,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        num_unaligned_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor,
        dst_buffer_slot_idx: torch.Tensor,
        num_tokens: int,
        num_topk: int,
        hidden: int,
        buffer_id: int,
        do_cpu_sync: bool,
        scale_kind: ScaleKind,
        backend_state: Any,
        token_metadata_at_forward: torch.Tensor | None = None,
        channel_linked_list: torch.Tensor | None = None,
        buffer_origin: BufferOrigin | None = None,
        masked_ranks: frozenset[int] = frozenset(),
        num_masked_lanes: torch.Tensor | None = None,
    ) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.cached_recv_src_metadata_before_sort: torch.Tensor | None = None
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.hidden = hidden
        self.buffer_id = buffer_id
        self.do_cpu_sync = do_cpu_sync
        self.scale_kind = scale_kind
        self.backend_state = backend_state
        self.buffer_origin = buffer_origin
        self.masked_ranks = masked_ranks
        self.num_masked_lanes = num_masked_lanes

    def deterministic_sort(self, *args: Any, **kwargs: Any) -> None:
        """DeepEP V2 sorts the received rows here into a run-independent order, because its slots go to
        whichever token claims them first. Ours are a prefix scan, the same on every run and every
        backend, so the rows are in that order already and this sorts nothing (it takes V2's arguments)."""

    @property
    def num_combine_rows(self) -> int:
        """The row count `combine` expects for `x`: `num_expanded_tokens` in expand mode, else `num_recv_tokens`."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens

    def __repr__(self) -> str:
        return (
            f"EPHandle(do_expand={self.do_expand}, num_tokens={self.num_tokens}, num_topk={self.num_topk}, "
            f"num_experts={self.num_experts}, expert_alignment={self.expert_alignment}, "
            f"num_max_tokens_per_rank={self.num_max_tokens_per_rank}, num_recv_tokens={self.num_recv_tokens}, "
            f"num_expanded_tokens={self.num_expanded_tokens}, do_cpu_sync={self.do_cpu_sync}, "
            f"buffer_id={self.buffer_id})"
        )
