"""Byte layout of the window's workspace, the dispatch scratch and the error block, and the launch
sizes built on them.

Mirrors `include/deep_ep/common/layout.cuh` and `fault.cuh` (the token records, the combine slots
and the window size are `deep_ep.records`); `tests/test_layout.py` compiles the headers with these
values in `static_assert`s, so the two cannot drift apart.
"""

from __future__ import annotations

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
MASKED_RANKS_OFFSET = STATUS_OFFSET + 56  # uint64, bit r: rank r is masked (ElasticBuffer.mask_ranks)
CREDIT_OFFSET = STATUS_OFFSET + 64
PEER_WINDOWS_OFFSET = CREDIT_OFFSET + MAX_RANKS * 4
OP_SIGNATURE_OFFSET = PEER_WINDOWS_OFFSET + MAX_RANKS * 8
PEER_MESSAGE_OFFSET = -(-(OP_SIGNATURE_OFFSET + MAX_RANKS * 4) // 16) * 16  # per source rank, its error's text
PEER_MESSAGE_BYTES = 256
# Rank masking's automatic mode: int32 flag (an expired wait masks its peer), then the uint64 of peers so masked
MASK_ON_TIMEOUT_OFFSET = PEER_MESSAGE_OFFSET + MAX_RANKS * PEER_MESSAGE_BYTES
TIMED_OUT_RANKS_OFFSET = MASK_ON_TIMEOUT_OFFSET + 8
# Peers outside the scale-up domain (scaleout.cuh): the scale-out region's offset and its staging
# ring's bytes (int64 each, 0 without one), ranks per scale-up domain (int32), fault forwarded (int32),
# the cap on a combine ring's entries per warp
SCALEOUT_REGION_OFFSET = TIMED_OUT_RANKS_OFFSET + 8
SCALEOUT_RING_BYTES_OFFSET = SCALEOUT_REGION_OFFSET + 8
NUM_SCALEUP_RANKS_OFFSET = SCALEOUT_RING_BYTES_OFFSET + 8
FAULT_FORWARDED_OFFSET = NUM_SCALEUP_RANKS_OFFSET + 4
STAGING_ENTRIES_CAP_OFFSET = FAULT_FORWARDED_OFFSET + 4  # int32: a combine ring's entries per warp at most (0: all)
# AGRS sessions (agrs.cuh): per source rank, the number of its last call whose data it copied to us (int32)
AGRS_FLAG_OFFSET = -(-(STAGING_ENTRIES_CAP_OFFSET + 4) // 16) * 16
RECV_EXPERT_COUNT_OFFSET = 128 * 1024
ARRIVAL_OFFSET = 384 * 1024
MAX_ARRIVAL_BLOCKS = 512  # arrival counters per source rank
# int32 words of a fresh dispatch's device scratch (grid barrier, per-CTA flags, per-(group, rank)
# counts, per-expert counts); the groups' first slots live in each CTA's shared memory
MAX_GROUP_INTS = 4096
MAX_GROUPS_PER_RANK = 256  # a warp scans one destination's groups with 8 per lane
DISPATCH_SCRATCH_INTS = 32 + MAX_CHANNELS + MAX_GROUP_INTS + MAX_RANKS * MAX_LOCAL_EXPERTS

# The scale-out region (scaleout.cuh), offsets inside it: the remote peers' 64-bit words (credits,
# op signatures, faults, barriers, then per (source, block) arrival counters), the per-expert counts
# staged for remote destinations, then the staging ring
REMOTE_CREDIT_OFFSET = 0
REMOTE_SIGNATURE_OFFSET = MAX_RANKS * 8
REMOTE_FAULT_OFFSET = 2 * MAX_RANKS * 8
REMOTE_BARRIER_OFFSET = 3 * MAX_RANKS * 8
BARRIER_PASSED_OFFSET = 4 * MAX_RANKS * 8
REMOTE_ARRIVAL_OFFSET = 4096
COUNT_STAGING_OFFSET = REMOTE_ARRIVAL_OFFSET + MAX_RANKS * MAX_ARRIVAL_BLOCKS * 8
# Hybrid mode's forwarding words (forward.cuh): per (source node, local rank) a count flag and the
# per-expert counts, per source node a flag of its forward records and its arrival counters
FORWARD_EXPERT_COUNT_OFFSET = COUNT_STAGING_OFFSET + MAX_RANKS * MAX_LOCAL_EXPERTS * 4
FORWARD_COUNT_FLAG_OFFSET = FORWARD_EXPERT_COUNT_OFFSET + MAX_RANKS * MAX_LOCAL_EXPERTS * 4
FORWARD_RECORD_FLAG_OFFSET = FORWARD_COUNT_FLAG_OFFSET + MAX_RANKS * 8
FORWARD_ARRIVAL_OFFSET = FORWARD_RECORD_FLAG_OFFSET + MAX_RANKS * 8
STAGING_RING_OFFSET = -(-(FORWARD_ARRIVAL_OFFSET + MAX_RANKS * MAX_ARRIVAL_BLOCKS * 8) // (64 << 10)) * (64 << 10)

# Error block words (int64) and the phases a device wait can fail in (fault.cuh). `rank` is the rank
# whose wait expired, `reporter` the rank that owns the block; the `input_*` words name the first
# invalid `topk_idx` value a dispatch found on the device.
ERROR_WORDS = ("status", "phase", "rank", "peer", "channel", "observed", "expected", "reporter",
               "input_status", "input_row", "input_lane", "input_value", "input_reason")  # fmt: skip
ERROR_TIMED_OUT_HERE, ERROR_REPORTED_BY_PEER = 1, 2
INPUT_OUT_OF_RANGE, INPUT_REPEATED, INPUT_PP_SIZE = 1, 2, 3
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
    10: "host error (a rank raised inside an operation or rejected its input)",
    11: "transport deadline (the emulated NIC or a flush of the puts passed it)",
    12: "forwarder's counts (hybrid mode: a source's counts for our node)",
    13: "forwarder's arrivals (hybrid mode: a source's records for our node)",
    14: "AGRS arrivals (a peer's all-gather or reduce-scatter data)",
    15: "PP credit (the receiver to free a slot of the pair's ring)",
    16: "PP arrival (the sender's next message)",
}
HOST_ERROR_PHASE = 10


def arrival_block(num_max_tokens_per_rank: int) -> int:
    """Slots per arrival counter: small blocks let the epilogue start early, and every source's
    `num_max_tokens_per_rank` slots must fit `MAX_ARRIVAL_BLOCKS` counters."""
    return max(32, -(-num_max_tokens_per_rank // MAX_ARRIVAL_BLOCKS))


def tokens_per_group(num_tokens: int, num_columns: int) -> int:
    """Tokens per layout group of a fresh dispatch: the smallest multiple of 32 (one warp ballot)
    for which there are at most `MAX_GROUPS_PER_RANK` groups, and groups x columns (the ranks, and in
    hybrid mode the nodes) fit the `MAX_GROUP_INTS` first slots that every dispatch CTA keeps in
    shared memory. Small groups are cheap: a sending warp scans its group up to its own tokens."""
    num_pieces = -(-max(num_tokens, 1) // 32)
    max_groups = min(MAX_GROUPS_PER_RANK, MAX_GROUP_INTS // num_columns)
    return 32 * -(-num_pieces // max_groups)
