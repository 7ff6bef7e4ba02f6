"""The scale-out region of a window (deep_ep.backends.kernels.scaleout, include/deep_ep/common/scaleout.cuh and
forward.cuh): where it goes, what its staging holds, hybrid mode's headers and forward region, and the checks a
dispatch makes before its kernel runs. CPU only: these are the host's formulas the kernels' offsets rely on."""

from __future__ import annotations

import random

import pytest

from deep_ep.backends.kernels.layout import STAGING_RING_OFFSET
from deep_ep.backends.kernels.scaleout import (
    check_forwarding,
    check_staging,
    header_bytes,
    ring_entry_bytes,
    scaleout_region,
)
from deep_ep.records import BUFFER_ALIGNMENT_BYTES, WORKSPACE_BYTES, DispatchRecordLayout


def _data_bytes(num_ranks: int, num_tokens: int, record_bytes: int) -> int:
    """A window's data region for `num_tokens` records of `record_bytes` per rank, as the buffer rounds it."""
    needed = WORKSPACE_BYTES + num_ranks * num_tokens * record_bytes
    return -(-needed // BUFFER_ALIGNMENT_BYTES) * BUFFER_ALIGNMENT_BYTES


@pytest.mark.parametrize("num_nodes, per_node", [(2, 4), (4, 4), (2, 8), (8, 2)])
def test_hybrid_regions_hold_a_call_of_the_buffer_s_shape_and_nothing_overlaps(num_nodes: int, per_node: int) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num_ranks, hidden, num_topk = num_nodes * per_node, rng.choice([2048, 4096, 7168]), rng.choice([1, 6, 8, 9])
    num_tokens = rng.choice([1, 128, 4096])
    bf16 = DispatchRecordLayout(2 * hidden, 0, num_topk).num_bytes
    fp8 = DispatchRecordLayout(hidden, 4 * -(-hidden // 128), num_topk).num_bytes
    data = _data_bytes(num_ranks, num_tokens, bf16)
    direct = scaleout_region(data, num_ranks, 132, 8, ring_entry_bytes(hidden, num_topk))
    hybrid = scaleout_region(data, num_ranks, 132, 8, ring_entry_bytes(hidden, num_topk), num_nodes,
                             DispatchRecordLayout(hidden, 0, 1).num_bytes)  # fmt: skip
    assert direct.forward_bytes == 0 and hybrid.offset == direct.offset == data, seed
    for region in (direct, hybrid):
        # After the data region, 2 MiB aligned, and large enough for the staging and the forward region
        # (forward.cuh puts the forward region right after the staging)
        assert region.offset % BUFFER_ALIGNMENT_BYTES == 0 and region.num_bytes % BUFFER_ALIGNMENT_BYTES == 0, seed
        assert region.ring_bytes % 16 == 0, seed
        assert STAGING_RING_OFFSET + region.ring_bytes + region.forward_bytes <= region.num_bytes, seed
    # A call of the buffer's shape fits, in BF16 and FP8: records then headers in the staging, and a block of
    # forward records per node
    for record in (bf16, fp8):
        check_staging(direct.ring_bytes, num_tokens * record, "dispatch")
        check_forwarding(hybrid, num_nodes, per_node, num_tokens, record)
    assert hybrid.ring_bytes >= num_tokens * bf16 + num_nodes * num_tokens * header_bytes(per_node), seed


def test_a_call_larger_than_the_buffer_is_refused_before_its_kernel() -> None:
    num_nodes, per_node, hidden, num_topk, num_tokens = 2, 4, 4096, 8, 256
    record = DispatchRecordLayout(2 * hidden, 0, num_topk).num_bytes
    region = scaleout_region(_data_bytes(8, num_tokens, record), 8, 24, 2, ring_entry_bytes(hidden, num_topk), num_nodes,
                             DispatchRecordLayout(hidden, 0, 1).num_bytes)  # fmt: skip
    check_forwarding(region, num_nodes, per_node, num_tokens, record)
    # Twice the tokens of a BF16 record: neither the staging nor the forward region holds them
    with pytest.raises(ValueError, match=r"dispatch \(hybrid mode\): the (staging for remote peers|forward region) "):
        check_forwarding(region, num_nodes, per_node, 4 * num_tokens, record)
    with pytest.raises(ValueError, match="create the buffer with the `hidden` and `num_max_tokens_per_rank`"):
        check_staging(region.ring_bytes, 2 * region.ring_bytes, "dispatch")


def test_a_header_is_one_int32_slot_per_rank_of_the_node_16_byte_aligned() -> None:
    assert [header_bytes(n) for n in (1, 2, 4, 5, 8, 16, 32)] == [16, 16, 16, 32, 32, 64, 128]
