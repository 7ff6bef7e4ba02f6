"""The scale-out region of a window (include/deep_ep/common/scaleout.cuh), for buffers with peers
outside the scale-up domain: where it goes, how large it is, and what of its staging a kernel gets.

Remote peers are reached through the transport only (NCCL GIN, or the emulated NIC of virtual
nodes): their 64-bit signal words, the per-expert counts staged for them and the records and rows
staged for them live in a region after the data region. Its offset is the same on every rank, so
the offsets a rank puts to are its own. A dispatch stages each token's record at its own place (no
flush in its loop); a combine its rows in a ring of entries per warp, flushed before one is reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from deep_ep.records import (
    BUFFER_ALIGNMENT_BYTES,
    WORKSPACE_BYTES,
    CombineSlotLayout,
    DispatchRecordLayout,
    buffer_record_bytes,
    forward_header_bytes,
    v2_hybrid_hint_bytes,
)
from deep_ep.utils.math import align

from . import specs
from .layout import STAGING_RING_OFFSET

# Warps per CTA of the communication kernels
WARPS_PER_CTA = specs.NUM_THREADS // 32
# An entry's bytes when the buffer was not sized for a hidden size: a BF16 record of hidden 7168
DEFAULT_ENTRY_BYTES = 16 << 10
# Hybrid mode's combine ring serves at least this many SMs, even where DeepEP V2's hint is smaller
MIN_RING_SMS = 32


@dataclass(frozen=True)
class ScaleoutRegion:
    """Where a window's scale-out region is and what its staging holds.

    Attributes:
        offset: the region's offset in the window (after the data region; the same on every rank).
        ring_bytes: the staging's bytes (a dispatch's records, in hybrid mode then their headers, or
            a combine's ring).
        num_bytes: the region's bytes (2 MiB aligned).
    """

    offset: int
    ring_bytes: int
    num_bytes: int


def ring_entry_bytes(hidden: int, num_topk: int) -> int:
    """The largest item a warp stages for a buffer sized for `hidden` and `num_topk` (0: not given):
    a BF16 dispatch record or a combine slot."""
    if hidden <= 0:
        return DEFAULT_ENTRY_BYTES
    topk = num_topk if num_topk > 0 else 32
    return max(DispatchRecordLayout(2 * hidden, 0, topk).num_bytes, CombineSlotLayout(hidden, topk).num_bytes)


def dispatch_staging_bytes(num_max_tokens: int, record_bytes: int, num_hybrid_nodes: int = 0,
                           num_ranks_per_node: int = 0) -> int:  # fmt: skip
    """What a dispatch stages: each token's record at its own place, then in hybrid mode (forward.cuh)
    a header per (node, token)."""
    headers = num_hybrid_nodes * num_max_tokens * forward_header_bytes(num_ranks_per_node) if num_hybrid_nodes else 0
    return num_max_tokens * record_bytes + headers


def scaleout_region(data_bytes: int, staging_bytes: int, ring_bytes: int) -> ScaleoutRegion:
    """The region after a data region of `data_bytes` whose staging holds a dispatch's `staging_bytes`
    and a combine's ring of `ring_bytes` (they never run at once, so they share the memory)."""
    staging = align(max(staging_bytes, ring_bytes), 16)
    return ScaleoutRegion(align(data_bytes, BUFFER_ALIGNMENT_BYTES), staging,
                          align(STAGING_RING_OFFSET + staging, BUFFER_ALIGNMENT_BYTES))  # fmt: skip


def buffer_scaleout_region(data_bytes: int, num_ranks: int, max_sms: int, hidden: int, num_topk: int,
                           num_max_tokens_per_rank: int, use_fp8_dispatch: bool, allow_multiple_reduction: bool,
                           num_hybrid_nodes: int = 0, ring_entries_per_warp: int | None = None) -> ScaleoutRegion:  # fmt: skip
    """The scale-out region of a buffer sized for this shape (`hidden`, `num_topk`,
    `num_max_tokens_per_rank`: 0 when not given) whose data region ends at `data_bytes`, for kernels
    of up to `max_sms` CTAs.

    The staging holds a dispatch of the buffer's shape (without one, a block of records as large as
    one rank's share of the data region, and in hybrid mode headers for as many FP8 records). The
    combine ring gives each warp of `max_sms` CTAs `ring_entries_per_warp` entries, by default what
    one of its tasks needs: one with multiple reduction (a holder sends one row per token and
    destination), else the top-k (a row per lane). A grid of fewer CTAs gets more entries per warp
    (`entries_per_warp`)."""
    num_ranks_per_node = num_ranks // num_hybrid_nodes if num_hybrid_nodes else 0
    if hidden > 0 and num_max_tokens_per_rank > 0:
        record = buffer_record_bytes(hidden, num_topk if num_topk > 0 else 32, use_fp8_dispatch)
        staging = dispatch_staging_bytes(num_max_tokens_per_rank, record, num_hybrid_nodes, num_ranks_per_node)
    else:
        block = (data_bytes - WORKSPACE_BYTES) // num_ranks
        min_record = DispatchRecordLayout(hidden, 0, 1).num_bytes if hidden > 0 else 1024
        headers = dispatch_staging_bytes(block // min_record, 0, num_hybrid_nodes, num_ranks_per_node)
        staging = block + headers
    if ring_entries_per_warp is None:
        ring_entries_per_warp = 1 if allow_multiple_reduction else num_topk or 8
    per_sm = WARPS_PER_CTA * ring_entries_per_warp * align(ring_entry_bytes(hidden, num_topk), 16)
    num_ring_sms = max_sms
    if num_hybrid_nodes and hidden > 0 and num_max_tokens_per_rank > 0:
        # Within DeepEP V2's hint where it leaves room for a ring of `MIN_RING_SMS`
        target = v2_hybrid_hint_bytes(num_ranks_per_node, num_hybrid_nodes, num_max_tokens_per_rank, hidden,
                                      num_topk, use_fp8_dispatch, allow_multiple_reduction)  # fmt: skip
        room = target - align(data_bytes, BUFFER_ALIGNMENT_BYTES) - STAGING_RING_OFFSET
        num_ring_sms = min(max_sms, max(MIN_RING_SMS, room // per_sm))
    return scaleout_region(data_bytes, staging, num_ring_sms * per_sm)


def check_staging(ring_bytes: int, num_bytes: int, what: str) -> None:
    """Raise `ValueError` unless the staging holds `num_bytes` (a dispatch's records, one per token)."""
    if num_bytes > ring_bytes:
        raise ValueError(
            f"{what}: the staging for remote peers holds {ring_bytes} bytes and this call's records need {num_bytes}; "
            "create the buffer with the `hidden` and `num_max_tokens_per_rank` of this call"
        )


def entries_per_warp(ring_bytes: int, num_ctas: int, entry_bytes: int) -> int:
    """What each warp of a kernel of `num_ctas` issuing CTAs gets of the ring, in entries of
    `entry_bytes` (`StagingRing` in scaleout.cuh divides the same way)."""
    return ring_bytes // (num_ctas * WARPS_PER_CTA * entry_bytes)


def check_ring(ring_bytes: int, num_ctas: int, entry_bytes: int, needed: int, what: str) -> None:
    """Raise `ValueError` unless each warp of `what`'s kernel on `num_ctas` CTAs gets `needed` entries."""
    got = entries_per_warp(ring_bytes, num_ctas, entry_bytes)
    if got < needed:
        raise ValueError(
            f"{what}: the staging ring for remote peers holds {ring_bytes} bytes, {got} entries of {entry_bytes} "
            f"bytes per warp on {num_ctas} SMs, and each warp needs {needed}; use fewer SMs (`num_sms`) or create "
            "the buffer with the `hidden` and `num_topk` of this call"
        )
