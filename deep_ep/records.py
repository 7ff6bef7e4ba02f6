"""The byte format of what travels between ranks, and the window it travels through.

A window is a workspace, then the dispatch records (one block of `num_max_tokens_per_rank` per source
rank; in hybrid mode followed by the forward records of the other nodes) or the combine slots (per
holder rank and token, or per token and top-k lane): never both at once, so they share the memory.
Mirrors `DispatchRecord`, `CombineSlot` and `kWorkspaceBytes` of `include/deep_ep/common/layout.cuh`
(checked by `tests/test_layout.py`). The planner sizes buffers with it (`deep_ep.planner`) and the
kernels place records with it (`deep_ep.backends.kernels`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deep_ep.utils.math import align

# The window's workspace (`deep_ep.backends.kernels.layout` places what it holds), before the slots
WORKSPACE_BYTES = 512 * 1024
# The buffer size granularity (the symmetric memory window is mapped in 2 MiB pages)
BUFFER_ALIGNMENT_BYTES = 2 << 20
# A token's hidden row moves in 16-byte vectors: FP8 hidden a multiple of 16, BF16 a multiple of 8
ROW_ALIGNMENT_BYTES = 16


def hidden_row_error(hidden: int, element_size: int) -> str | None:
    """Why a hidden size cannot be dispatched with elements of `element_size` bytes, or `None` when it can
    (the rule of `deep_ep.validation.check_hidden`, shared by `deep-ep plan`)."""
    if hidden >= 1 and (hidden * element_size) % ROW_ALIGNMENT_BYTES == 0:
        return None
    multiple = ROW_ALIGNMENT_BYTES // math.gcd(ROW_ALIGNMENT_BYTES, element_size)
    return (
        f"rows must be a positive multiple of {ROW_ALIGNMENT_BYTES} bytes (for {element_size}-byte elements: hidden "
        f"a multiple of {multiple}), got hidden {hidden} ({hidden * element_size} bytes)"
    )


def v2_record_bytes(hidden_bytes: int, scale_bytes: int, num_topk: int) -> int:
    """DeepEP V2's dispatch record for the same token (its buffer hint's `tok_d`): data, scales and
    `K * 8 + (1 + K) * 4` bytes of metadata, each 16-byte aligned."""
    return align(hidden_bytes, 16) + align(scale_bytes, 16) + align(num_topk * 8 + (1 + num_topk) * 4, 16)


def v2_hybrid_hint_bytes(num_scaleup_ranks: int, num_scaleout_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                         num_topk: int, use_fp8_dispatch: bool, allow_multiple_reduction: bool) -> int:  # fmt: skip
    """DeepEP V2's buffer size hint in hybrid mode (v2-parity.md item 16): its receive, send and forward
    buffers of both phases, 2 MiB aligned. A hybrid window of ours is sized to stay within it."""
    k = num_topk if num_topk > 0 else 32
    su, so, t, amr = num_scaleup_ranks, num_scaleout_ranks, num_max_tokens_per_rank, allow_multiple_reduction
    scale_bytes = 4 * -(-hidden // 32) if use_fp8_dispatch else 0
    dispatch_token = v2_record_bytes(hidden * (1 if use_fp8_dispatch else 2), scale_bytes, k)
    combine_token = align(hidden * 2, 16) + align(k * 8, 16)
    dispatch = (su * so * t + t + so * (t + 1280)) * dispatch_token
    combine = ((min(su, k) if amr else k) * so * t + (min(so, k) if amr else k) * t
               + (1 if amr else k) * so * (t + 1280)) * combine_token  # fmt: skip
    return align(max(dispatch, combine), BUFFER_ALIGNMENT_BYTES)


@dataclass(frozen=True)
class DispatchRecordLayout:
    """One dispatched token in the window: hidden bytes, scales, top-k ids/weights, source index;
    128-byte aligned (stores that straddle lines cost NVLink bandwidth) where that stays within
    DeepEP V2's record size (`v2_record_bytes`), else 16-byte aligned: a buffer is never larger
    than V2's for the same shape."""

    hidden_bytes: int
    scale_bytes: int
    num_topk: int

    @property
    def scale_offset(self) -> int:
        return self.hidden_bytes

    @property
    def meta_offset(self) -> int:
        return self.scale_offset + align(self.scale_bytes, 16)

    @property
    def num_bytes(self) -> int:
        packed = self.meta_offset + align(self.num_topk * 8 + 4, 16)
        lined = align(packed, 128)
        return lined if lined <= v2_record_bytes(self.hidden_bytes, self.scale_bytes, self.num_topk) else packed


@dataclass(frozen=True)
class CombineSlotLayout:
    """One combine slot: a BF16 row, then the token's top-k weights (as the holder rank saw them)."""

    hidden: int
    num_topk: int

    @property
    def weight_offset(self) -> int:
        return self.hidden * 2

    @property
    def num_bytes(self) -> int:
        return self.weight_offset + align(self.num_topk * 4, 16)


def combine_uses_lane_slots(num_ranks: int, num_topk: int, num_rows: int) -> bool:
    """Whether combine rows land per (token, top-k lane) rather than per (holder rank, dispatch
    slot): without multiple reduction (`num_rows > 1` rows per holder), or with more ranks than
    lanes; the smaller layout, as `kCombineLaneSlots` in layout.cuh."""
    return num_rows > 1 or num_ranks > num_topk


def combine_region_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                         num_rows: int) -> int:  # fmt: skip
    """Bytes of the combine slots in a window: `Tmax * K` lane slots or `N * Tmax` holder slots."""
    lane_slots = combine_uses_lane_slots(num_ranks, num_topk, num_rows)
    num_slots = num_max_tokens_per_rank * (num_topk if lane_slots else num_ranks)
    return num_slots * CombineSlotLayout(hidden, num_topk).num_bytes


def hybrid_combine_uses_lane_slots(num_ranks: int, num_nodes: int, num_topk: int) -> bool:
    """Whether hybrid mode's combine slots are per (node, token, top-k lane) rather than per (holder
    rank, slot): with fewer lanes than ranks per node, the smaller layout."""
    return num_topk < num_ranks // num_nodes


def hybrid_combine_region_bytes(num_ranks: int, num_nodes: int, num_max_tokens_per_rank: int, hidden: int,
                                num_topk: int) -> int:  # fmt: skip
    """Bytes of hybrid mode's combine slots (one row per holder, include/deep_ep/common/combine_forward.cuh):
    `N * Tmax` holder slots (our node's holders, and the rows we forward under remote holders'
    indices), or with fewer lanes than ranks per node `num_nodes * Tmax * K` lane slots, then
    `num_nodes * Tmax` slots of the partials the other nodes' forwarders send us."""
    per_node = min(num_ranks // num_nodes, num_topk)
    return (per_node + 1) * num_nodes * num_max_tokens_per_rank * CombineSlotLayout(hidden, num_topk).num_bytes


def forward_header_bytes(num_ranks_per_node: int) -> int:
    """A forward record's header (forward.cuh): one int32 slot per rank of the node, 16-byte aligned."""
    return align(4 * num_ranks_per_node, 16)


def forward_region_bytes(num_nodes: int, num_ranks_per_node: int, num_max_tokens_per_rank: int,
                         record_bytes: int) -> int:  # fmt: skip
    """Bytes of hybrid mode's forward region (forward.cuh), after a dispatch's records in the data region:
    a block of `Tmax` forward records (record and header) per *other* node's sources with our local
    index; our own node's sources store their records into their destinations directly."""
    per_record = record_bytes + forward_header_bytes(num_ranks_per_node)
    return (num_nodes - 1) * num_max_tokens_per_rank * per_record


def buffer_record_bytes(hidden: int, num_topk: int, use_fp8_dispatch: bool) -> int:
    """The dispatch record a buffer is sized for: BF16, or with `use_fp8_dispatch` FP8 with one 4-byte
    scale per 32 elements (the most DeepEP V2 sizes for; `buffer_region_bytes`)."""
    data_bytes, scale_bytes = (hidden, 4 * -(-hidden // 32)) if use_fp8_dispatch else (2 * hidden, 0)
    return DispatchRecordLayout(data_bytes, scale_bytes, num_topk).num_bytes


def window_bytes(num_region_bytes: int) -> int:
    """Window size: the workspace plus the larger of the dispatch records and the combine slots (they
    share the memory), 2 MiB aligned."""
    return align(WORKSPACE_BYTES + num_region_bytes, BUFFER_ALIGNMENT_BYTES)


def dispatch_region_bytes(num_ranks: int, num_max_tokens_per_rank: int, record_bytes: int) -> int:
    """Bytes of the dispatch records in a window: one block of `Tmax` records per source rank."""
    return num_ranks * num_max_tokens_per_rank * record_bytes


def buffer_region_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                        use_fp8_dispatch: bool, allow_multiple_reduction: bool) -> int:  # fmt: skip
    """What a buffer for this MoE shape needs besides the workspace, as DeepEP V2 sizes it.

    Dispatch: BF16 records, or with `use_fp8_dispatch` FP8 records with one 4-byte scale per 32
    elements (the most V2 sizes for: MXFP8, and so also 1x128 FP32 and packed UE8M0 scales); a BF16
    dispatch then needs a buffer sized for it. Combine: one row per holder rank and token with
    multiple reduction, one per top-k lane without (expanded rows of a token's local lanes then
    travel one by one).
    """
    record = buffer_record_bytes(hidden, num_topk, use_fp8_dispatch)
    num_rows = 1 if allow_multiple_reduction else max(2, num_topk)
    return max(
        dispatch_region_bytes(num_ranks, num_max_tokens_per_rank, record),
        combine_region_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk, 1),
        combine_region_bytes(num_ranks, num_max_tokens_per_rank, hidden, num_topk, num_rows),
    )
