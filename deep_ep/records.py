"""The byte format of what travels between ranks, and the window it travels through.

A window is a workspace, then one block of `num_max_tokens_per_rank` slots per source rank; a slot
holds a dispatched token's record or a combine slot (never both at once, so they share the memory).
Mirrors `DispatchRecord`, `CombineSlot` and `kWorkspaceBytes` of `include/deep_ep/common/layout.cuh`
(checked by `tests/test_layout.py`). The planner sizes buffers with it (`deep_ep.planner`) and the
kernels place records with it (`deep_ep.backends.kernels`).
"""

from __future__ import annotations

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
    multiple = ROW_ALIGNMENT_BYTES // element_size
    dtype = {1: "FP8", 2: "BF16", 4: "FP32"}.get(element_size, f"{element_size}-byte")
    return (
        f"rows must be a positive multiple of {ROW_ALIGNMENT_BYTES} bytes (for {dtype}: hidden a multiple of "
        f"{multiple}), got hidden {hidden} ({hidden * element_size} bytes)"
    )


@dataclass(frozen=True)
class DispatchRecordLayout:
    """One dispatched token in the window: hidden bytes, scales, top-k ids/weights, source index;
    128-byte aligned."""

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
        return align(self.meta_offset + align(self.num_topk * 8 + 4, 16), 128)


@dataclass(frozen=True)
class CombineSlotLayout:
    """One combine slot: `num_rows` BF16 rows, then the token's top-k weights."""

    hidden: int
    num_rows: int
    num_topk: int

    @property
    def weight_offset(self) -> int:
        return self.num_rows * self.hidden * 2

    @property
    def num_bytes(self) -> int:
        return self.weight_offset + align(self.num_topk * 4, 16)


def window_bytes(num_ranks: int, num_max_tokens_per_rank: int, slot_bytes: int) -> int:
    """Window size: the workspace plus one slot block per source rank, 2 MiB aligned."""
    return align(WORKSPACE_BYTES + num_ranks * num_max_tokens_per_rank * slot_bytes, BUFFER_ALIGNMENT_BYTES)


def max_slot_bytes(hidden: int, num_topk: int, use_fp8_dispatch: bool, allow_multiple_reduction: bool) -> int:
    """The larger of a dispatch record and a combine slot for this MoE shape (they share memory).

    A BF16 record is always accounted for, so a buffer sized for FP8 also takes BF16 dispatches.
    Without multiple reduction an expanded combine sends one row per local top-k lane.
    """
    num_scale_bytes = (hidden + 127) // 128 * 4 if use_fp8_dispatch else 0
    record = max(
        DispatchRecordLayout(hidden * 2, 0, num_topk).num_bytes,
        DispatchRecordLayout(hidden, num_scale_bytes, num_topk).num_bytes,
    )
    rows = 1 if allow_multiple_reduction else max(1, num_topk)
    return max(record, CombineSlotLayout(hidden, rows, num_topk).num_bytes)
