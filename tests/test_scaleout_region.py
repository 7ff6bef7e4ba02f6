"""The scale-out region of a window (deep_ep.backends.kernels.scaleout, include/deep_ep/common/scaleout.cuh and
forward.cuh): where it goes, what its staging holds, hybrid mode's headers and forward region, and the checks a
dispatch makes before its kernel runs. CPU only: these are the host's formulas the kernels' offsets rely on."""

from __future__ import annotations

import random

import pytest

from deep_ep import planner
from deep_ep.backends.kernels.layout import STAGING_RING_OFFSET
from deep_ep.backends.kernels.scaleout import (
    MIN_RING_SMS,
    WARPS_PER_CTA,
    buffer_scaleout_region,
    check_ring,
    check_staging,
    dispatch_staging_bytes,
    entries_per_warp,
    ring_entry_bytes,
)
from deep_ep.records import (
    BUFFER_ALIGNMENT_BYTES,
    WORKSPACE_BYTES,
    CombineSlotLayout,
    DispatchRecordLayout,
    dispatch_region_bytes,
    forward_header_bytes,
    forward_region_bytes,
)


@pytest.mark.parametrize("num_nodes, per_node", [(2, 4), (4, 4), (2, 8), (8, 2)])
def test_a_call_of_the_buffer_s_shape_fits_and_nothing_overlaps(num_nodes: int, per_node: int) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num_ranks, hidden, num_topk = num_nodes * per_node, rng.choice([2048, 4096, 7168]), rng.choice([1, 6, 8, 9])
    num_tokens, fp8, multiple = rng.choice([1, 128, 4096]), rng.random() < 0.5, rng.random() < 0.5
    data = planner.buffer_size_hint(num_ranks, num_tokens, hidden, num_topk, fp8, True, multiple, per_node)
    direct = buffer_scaleout_region(data, num_ranks, 132, hidden, num_topk, num_tokens, fp8, multiple)
    hybrid = buffer_scaleout_region(data, num_ranks, 132, hidden, num_topk, num_tokens, fp8, multiple, num_nodes)
    shape = (seed, num_ranks, hidden, num_topk, num_tokens, fp8, multiple)
    for region in (direct, hybrid):
        # After the data region, 2 MiB aligned, and large enough for the staging
        assert region.offset == data and region.offset % BUFFER_ALIGNMENT_BYTES == 0, shape
        assert region.num_bytes % BUFFER_ALIGNMENT_BYTES == 0 and region.ring_bytes % 16 == 0, shape
        assert STAGING_RING_OFFSET + region.ring_bytes <= region.num_bytes, shape
    # The records the buffer was sized for (FP8 with 1x128 scales are smaller than the sizing's 1x32),
    # then in hybrid mode the other nodes' forward records, fit the data region; the staging holds
    # them with their headers
    records = [DispatchRecordLayout(hidden, 4 * -(-hidden // 128), num_topk).num_bytes]
    if not fp8:
        records.append(DispatchRecordLayout(2 * hidden, 0, num_topk).num_bytes)
    for record in records:
        forwarded = forward_region_bytes(num_nodes, per_node, num_tokens, record)
        assert WORKSPACE_BYTES + dispatch_region_bytes(num_ranks, num_tokens, record) + forwarded <= data, shape
        check_staging(direct.ring_bytes, dispatch_staging_bytes(num_tokens, record), "dispatch")
        check_staging(hybrid.ring_bytes, dispatch_staging_bytes(num_tokens, record, num_nodes, per_node), "dispatch")
    # A combine on the SMs the ring serves gets the entries one task takes
    needed = 1 if multiple else num_topk
    for region in (direct, hybrid):
        check_ring(region.ring_bytes, MIN_RING_SMS, CombineSlotLayout(hidden, num_topk).num_bytes, needed, "combine")


def test_the_forward_region_skips_the_forwarder_s_node() -> None:
    # One block of records and headers per other node: a node's own sources store into their destinations
    record = DispatchRecordLayout(7168, 224, 8).num_bytes
    assert forward_region_bytes(1, 8, 4096, record) == 0
    assert forward_region_bytes(4, 8, 4096, record) == 3 * 4096 * (record + forward_header_bytes(8))
    assert dispatch_staging_bytes(4096, record, 4, 8) == 4096 * record + 4 * 4096 * forward_header_bytes(8)


def test_a_call_larger_than_the_buffer_is_refused_before_its_kernel() -> None:
    hidden, num_topk, num_tokens = 4096, 8, 256
    record = DispatchRecordLayout(2 * hidden, 0, num_topk).num_bytes
    data = planner.buffer_size_hint(8, num_tokens, hidden, num_topk, False, True, True, 4)
    region = buffer_scaleout_region(data, 8, 24, hidden, num_topk, num_tokens, False, True, 2)
    check_staging(region.ring_bytes, dispatch_staging_bytes(num_tokens, record, 2, 4), "dispatch (hybrid mode)")
    with pytest.raises(ValueError, match="create the buffer with the `hidden` and `num_max_tokens_per_rank`"):
        check_staging(region.ring_bytes, dispatch_staging_bytes(4 * num_tokens, record, 2, 4), "dispatch (hybrid mode)")
    # With multiple reduction, one entry per warp on the buffer's 24 SMs: not the top-k's a row per lane needs
    slot = CombineSlotLayout(hidden, num_topk).num_bytes
    assert entries_per_warp(region.ring_bytes, 24, slot) == region.ring_bytes // (24 * WARPS_PER_CTA * slot) >= 1
    with pytest.raises(ValueError, match="use fewer SMs"):
        check_ring(region.ring_bytes, 24, slot, num_topk, "combine")


def test_without_the_buffer_s_shape_the_staging_holds_a_rank_s_share_of_the_data_region() -> None:
    data = 64 << 20
    region = buffer_scaleout_region(data, 8, 132, 0, 0, 0, False, True, 2)
    assert region.ring_bytes >= (data - WORKSPACE_BYTES) // 8
    # Headers for as many of the smallest records as that share holds
    assert region.ring_bytes >= dispatch_staging_bytes((data - WORKSPACE_BYTES) // 8 // 1024, 1024, 2, 4)


def test_a_header_is_one_int32_slot_per_rank_of_the_node_16_byte_aligned() -> None:
    assert [forward_header_bytes(n) for n in (1, 2, 4, 5, 8, 16, 32)] == [16, 16, 16, 32, 32, 64, 128]
    assert ring_entry_bytes(0, 0) == 16 << 10
