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

from deep_ep.records import BUFFER_ALIGNMENT_BYTES, WORKSPACE_BYTES, CombineSlotLayout, DispatchRecordLayout
from deep_ep.utils.math import align

from . import specs
from .layout import STAGING_RING_OFFSET

# Warps per CTA of the communication kernels
WARPS_PER_CTA = specs.NUM_THREADS // 32
# An entry's bytes when the buffer was not sized for a hidden size: a BF16 record of hidden 7168
DEFAULT_ENTRY_BYTES = 16 << 10


@dataclass(frozen=True)
class ScaleoutRegion:
    """Where a window's scale-out region is and what its staging holds.

    Attributes:
        offset: the region's offset in the window (after the data region; the same on every rank).
        ring_bytes: the staging's bytes (a dispatch's records, in hybrid mode then their headers, or
            a combine's ring).
        num_bytes: the region's bytes (2 MiB aligned).
        forward_bytes: hybrid mode's forward region, after the staging (0 in direct mode).
    """

    offset: int
    ring_bytes: int
    num_bytes: int
    forward_bytes: int = 0


def ring_entry_bytes(hidden: int, num_topk: int) -> int:
    """The largest item a warp stages for a buffer sized for `hidden` and `num_topk` (0: not given):
    a BF16 dispatch record or a combine slot."""
    if hidden <= 0:
        return DEFAULT_ENTRY_BYTES
    topk = num_topk if num_topk > 0 else 32
    return max(DispatchRecordLayout(2 * hidden, 0, topk).num_bytes, CombineSlotLayout(hidden, topk).num_bytes)


def header_bytes(num_ranks_per_node: int) -> int:
    """A forward record's header (forward.cuh): one int32 slot per rank of the node, 16-byte aligned."""
    return align(4 * num_ranks_per_node, 16)


def scaleout_region(data_bytes: int, num_ranks: int, max_sms: int, entries_per_warp: int, entry_bytes: int,
                    num_hybrid_nodes: int = 0, min_record_bytes: int = 0) -> ScaleoutRegion:  # fmt: skip
    """The region of a window whose data region ends at `data_bytes` (the workspace, then one block
    of records per rank), for combines of up to `max_sms` CTAs whose warps each keep
    `entries_per_warp` entries of `entry_bytes`; a dispatch's records fit one rank's block.
    In hybrid mode (`num_hybrid_nodes` > 0) the staging also holds a header per (node, token) and a
    forward region follows it: one rank's block of records per node, with their headers, for records
    of at least `min_record_bytes` (so at most one rank's block / `min_record_bytes` tokens)."""
    dispatch_bytes = (data_bytes - WORKSPACE_BYTES) // num_ranks
    headers = 0
    if num_hybrid_nodes:
        max_tokens = dispatch_bytes // max(min_record_bytes, 16)
        headers = num_hybrid_nodes * max_tokens * header_bytes(num_ranks // num_hybrid_nodes)
    ring_bytes = max(dispatch_bytes + headers, max_sms * WARPS_PER_CTA * entries_per_warp * align(entry_bytes, 16))
    ring_bytes = align(ring_bytes, 16)
    forward_bytes = num_hybrid_nodes * dispatch_bytes + headers
    return ScaleoutRegion(align(data_bytes, BUFFER_ALIGNMENT_BYTES), ring_bytes,
                          align(STAGING_RING_OFFSET + ring_bytes + forward_bytes, BUFFER_ALIGNMENT_BYTES),
                          forward_bytes)  # fmt: skip


def check_forwarding(region: ScaleoutRegion, num_nodes: int, num_ranks_per_node: int, num_max_tokens: int,
                     record_bytes: int) -> None:  # fmt: skip
    """Raise `ValueError` unless hybrid mode's headers fit the staging after a dispatch's records, and
    its forward records (one block of `num_max_tokens` per node) the forward region."""
    headers = num_nodes * num_max_tokens * header_bytes(num_ranks_per_node)
    check_staging(region.ring_bytes, num_max_tokens * record_bytes + headers, "dispatch (hybrid mode)")
    needed = num_nodes * num_max_tokens * record_bytes + headers
    if needed > region.forward_bytes:
        raise ValueError(
            f"dispatch (hybrid mode): the forward region holds {region.forward_bytes} bytes and this call's forward "
            f"records need {needed}; create the buffer with the `hidden` and `num_max_tokens_per_rank` of this call"
        )


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
