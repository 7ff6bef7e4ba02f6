"""Byte layout of the symmetric window, the token records and the error block.

Mirrors `include/deep_ep/common/layout.cuh` and `fault.cuh`; `tests/test_layout.py` compiles the
headers with these values in `static_assert`s, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_RANKS = 64
MAX_CHANNELS = 256
MAX_LOCAL_EXPERTS = 1024
SEMAPHORE_OFFSET = 0
RECV_COUNT_OFFSET = SEMAPHORE_OFFSET + MAX_CHANNELS * MAX_RANKS * 4  # 64-bit count flags per source
STATUS_OFFSET = RECV_COUNT_OFFSET + MAX_RANKS * 8
EPILOGUE_DONE_OFFSET = STATUS_OFFSET + 8
EPOCH_OFFSET = EPILOGUE_DONE_OFFSET + 4
DISPATCH_TASK_QUEUE_OFFSET = EPOCH_OFFSET + 4
COMBINE_TASK_QUEUE_OFFSET = DISPATCH_TASK_QUEUE_OFFSET + 8
EPILOGUE_TASK_QUEUE_OFFSET = COMBINE_TASK_QUEUE_OFFSET + 8
FAULT_REPORTED_OFFSET = EPILOGUE_TASK_QUEUE_OFFSET + 8
RANK_OFFSET = FAULT_REPORTED_OFFSET + 4
NUM_RANKS_OFFSET = RANK_OFFSET + 4
CREDIT_OFFSET = STATUS_OFFSET + 64
PEER_WINDOWS_OFFSET = CREDIT_OFFSET + MAX_RANKS * 4
OP_SIGNATURE_OFFSET = PEER_WINDOWS_OFFSET + MAX_RANKS * 8
RECV_EXPERT_COUNT_OFFSET = 128 * 1024
ARRIVAL_OFFSET = 384 * 1024
MAX_ARRIVAL_BLOCKS = 512  # arrival counters per source rank
WORKSPACE_BYTES = 512 * 1024
BUFFER_ALIGNMENT = 2 * 1024 * 1024
# int32 words of a fresh dispatch's device scratch (grid barrier, per-CTA flags, per-(group, rank)
# counts, per-expert counts); the groups' first slots live in each CTA's shared memory
MAX_GROUP_INTS = 4096
MAX_GROUPS_PER_RANK = 256  # a warp scans one destination's groups with 8 per lane
DISPATCH_SCRATCH_INTS = 32 + MAX_CHANNELS + MAX_GROUP_INTS + MAX_RANKS * MAX_LOCAL_EXPERTS

# Error block words (int64) and the phases a device wait can fail in (fault.cuh). `rank` is the rank
# whose wait expired, `reporter` the rank that owns the block; the `input_*` words name the first
# invalid `topk_idx` value a dispatch found on the device.
ERROR_WORDS = ("status", "phase", "rank", "peer", "channel", "observed", "expected", "reporter",
               "input_status", "input_row", "input_lane", "input_value", "input_reason")  # fmt: skip
ERROR_TIMED_OUT_HERE, ERROR_REPORTED_BY_PEER = 1, 2
INPUT_OUT_OF_RANGE, INPUT_REPEATED = 1, 2
PHASES = {
    1: "barrier",
    2: "dispatch entry (peer window credit)",
    3: "dispatch arrivals",
    4: "combine entry (peer window credit)",
    5: "combine arrivals",
    6: "dispatch grid barrier",
    7: "dispatch counts",
    8: "operation mismatch (the ranks ran different sequences of operations)",
    9: "epilogue entry (peer's operation signature)",
}


def align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def arrival_block(num_max_tokens_per_rank: int) -> int:
    """Slots per arrival counter: small blocks let the epilogue start early, and every source's
    `num_max_tokens_per_rank` slots must fit `MAX_ARRIVAL_BLOCKS` counters."""
    return max(32, -(-num_max_tokens_per_rank // MAX_ARRIVAL_BLOCKS))


def tokens_per_group(num_tokens: int, num_ranks: int) -> int:
    """Tokens per layout group of a fresh dispatch: the smallest multiple of 32 (one warp ballot)
    for which there are at most `MAX_GROUPS_PER_RANK` groups, and groups x ranks fit the
    `MAX_GROUP_INTS` first slots that every dispatch CTA keeps in shared memory. Small groups are
    cheap: a sending warp scans its group up to its own tokens."""
    num_pieces = -(-max(num_tokens, 1) // 32)
    max_groups = min(MAX_GROUPS_PER_RANK, MAX_GROUP_INTS // num_ranks)
    return 32 * -(-num_pieces // max_groups)


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
    return align(WORKSPACE_BYTES + num_ranks * num_max_tokens_per_rank * slot_bytes, BUFFER_ALIGNMENT)


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
