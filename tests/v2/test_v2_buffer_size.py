"""Buffer sizes no larger than DeepEP V2's (v2-parity.md item 16): `get_buffer_size_hint`, and the
buffer a constructor without `num_bytes` allocates, against V2's own formula (restated here from its
`get_buffer_size_hint`) plus our fixed workspace, for direct mode with and without multiple
reduction, BF16 and FP8, EP2 to EP64; `use_fp8_dispatch` changes the size."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

import deep_ep
from deep_ep import planner
from deep_ep.backends.kernels.layout import MAX_RANKS as MAX_KERNEL_RANKS
from deep_ep.backends.kernels.scaleout import buffer_scaleout_region, entries_per_warp
from deep_ep.records import BUFFER_ALIGNMENT_BYTES, WORKSPACE_BYTES, CombineSlotLayout, v2_hybrid_hint_bytes

H200_SMS = 132


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def v2_hint(num_ranks: int, num_tokens: int, hidden: int, num_topk: int, fp8: bool, multiple_reduction: bool) -> int:
    """DeepEP V2's hint for direct mode with every rank on NVLink: its token records, every field
    16-byte aligned (K = 0 counts as 32 lanes, FP8 as one 4-byte scale per 32 elements)."""
    num_topk = num_topk or 32
    scale_bytes = 4 * -(-hidden // 32) if fp8 else 0
    dispatch_token = _align(hidden * (1 if fp8 else 2), 16) + _align(scale_bytes, 16)
    dispatch_token += _align(num_topk * 8 + (1 + num_topk) * 4, 16)
    combine_token = _align(hidden * 2, 16) + _align(num_topk * 8, 16)
    dispatch = num_ranks * num_tokens * dispatch_token
    combine = (min(num_ranks, num_topk) if multiple_reduction else num_topk) * num_tokens * combine_token
    return _align(max(dispatch, combine), BUFFER_ALIGNMENT_BYTES)


def v2_hybrid_hint(num_scaleup: int, num_scaleout: int, num_tokens: int, hidden: int, num_topk: int, fp8: bool,
                   multiple_reduction: bool) -> int:  # fmt: skip
    """DeepEP V2's hint in hybrid mode (`num_scaleup` ranks per node, `num_scaleout` nodes): the
    receive, send and forward buffers of both phases (v2-parity.md item 16)."""
    num_topk = num_topk or 32
    scale_bytes = 4 * -(-hidden // 32) if fp8 else 0
    dispatch_token = _align(hidden * (1 if fp8 else 2), 16) + _align(scale_bytes, 16)
    dispatch_token += _align(num_topk * 8 + (1 + num_topk) * 4, 16)
    combine_token = _align(hidden * 2, 16) + _align(num_topk * 8, 16)
    t, su, so, k, amr = num_tokens, num_scaleup, num_scaleout, num_topk, multiple_reduction
    dispatch = (su * so * t + t + so * (t + 1280)) * dispatch_token
    combine = ((min(su, k) if amr else k) * so * t + (min(so, k) if amr else k) * t
               + (1 if amr else k) * so * (t + 1280)) * combine_token  # fmt: skip
    return _align(max(dispatch, combine), BUFFER_ALIGNMENT_BYTES)


SHAPES = list(
    itertools.product(
        (2, 3, 4, 8, 16, 32, 64),  # ranks
        (1, 128, 4096),  # tokens per rank
        (2048, 4096, 7168),  # hidden
        (0, 1, 6, 8, 9, 32),  # top-k
        (False, True),  # FP8
        (False, True),  # multiple reduction
    )
)


def test_every_hint_is_at_most_v2s_plus_our_workspace() -> None:
    worst = 0.0
    for num_ranks, num_tokens, hidden, num_topk, fp8, multiple in SHAPES:
        ours = planner.buffer_size_hint(num_ranks, num_tokens, hidden, num_topk, fp8, False, multiple)
        theirs = v2_hint(num_ranks, num_tokens, hidden, num_topk, fp8, multiple)
        shape = (num_ranks, num_tokens, hidden, num_topk, fp8, multiple)
        assert ours <= _align(theirs + WORKSPACE_BYTES, BUFFER_ALIGNMENT_BYTES), (shape, ours, theirs)
        worst = max(worst, ours / _align(theirs + WORKSPACE_BYTES, BUFFER_ALIGNMENT_BYTES))
    print(f"\n{len(SHAPES)} shapes: our hint is at most {worst:.3f}x V2's plus the workspace")


@pytest.mark.parametrize("num_ranks", [2, 8, 64])
def test_fp8_dispatch_makes_the_buffer_smaller_where_the_records_dominate(num_ranks: int) -> None:
    bf16 = planner.buffer_size_hint(num_ranks, 4096, 7168, 8, False, False, True)
    fp8 = planner.buffer_size_hint(num_ranks, 4096, 7168, 8, True, False, True)
    # Up to K ranks the combine's BF16 rows (one per holder) need as much as BF16 records
    assert fp8 < bf16 if num_ranks > 8 else fp8 <= bf16


def test_the_buffer_allocates_the_hint(group: dist.ProcessGroup) -> None:
    for fp8, multiple in itertools.product((False, True), repeat=2):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=512, hidden=7168, num_topk=8,
                                       use_fp8_dispatch=fp8, allow_multiple_reduction=multiple,
                                       allow_hybrid_mode=False, explicitly_destroy=True)  # fmt: skip
        hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 512, 7168, 8, fp8, False, multiple)
        assert buffer.num_bytes == hint <= v2_hint(group.size(), 512, 7168, 8, fp8, multiple) + WORKSPACE_BYTES
        buffer.destroy()


def test_the_hybrid_bound_is_at_most_v2s_hybrid_hint_up_to_ep2048() -> None:
    # The hint reserves hybrid mode's forward records (one block per other node) after the records, and its
    # combine's `min(S, K)` slots per node and token as V2 keeps, and a node partial (`hybrid_combine_region_bytes`)
    worst = 0.0
    for num_scaleup, num_scaleout, num_tokens, num_topk, fp8, multiple in itertools.product(
        (2, 4, 8, 64), (2, 4, 8, 32), (128, 4096), (0, 1, 8, 9, 32), (False, True), (False, True)
    ):
        ours = planner.buffer_size_hint(num_scaleup * num_scaleout, num_tokens, 7168, num_topk, fp8, True, multiple,
                                        num_ranks_per_domain=num_scaleup)  # fmt: skip
        theirs = v2_hybrid_hint(num_scaleup, num_scaleout, num_tokens, 7168, num_topk, fp8, multiple)
        limit = _align(theirs + WORKSPACE_BYTES, BUFFER_ALIGNMENT_BYTES)
        assert ours <= limit, (num_scaleup, num_scaleout, num_tokens, num_topk, fp8, multiple, ours, theirs)
        worst = max(worst, ours / limit)
    print(f"\nhybrid, EP4 to EP2048: our hint is at most {worst:.3f}x V2's hybrid hint plus the workspace")


HYBRID_SHAPES = [
    shape
    for shape in itertools.product(
        (2, 4, 8, 16, 32),  # ranks per node
        (2, 4, 8, 16, 32),  # nodes
        (1, 128, 512, 1024, 4096, 8192),  # tokens per rank
        (0, 1, 2, 6, 8, 9),  # top-k
        (False, True),  # FP8
        (False, True),  # multiple reduction
        (2048, 4096, 7168),  # hidden
    )
    if shape[0] * shape[1] <= MAX_KERNEL_RANKS
]


def test_a_hybrid_window_with_its_scaleout_region_is_within_v2s_hybrid_hint() -> None:
    # What the kernels allocate per rank in hybrid mode: the hint, then the scale-out region (remote words,
    # the staging of a dispatch's records and headers, the combine ring of at least MIN_RING_SMS SMs)
    worst, num_full_rings = 0.0, 0
    for per_node, num_nodes, num_tokens, num_topk, fp8, multiple, hidden in HYBRID_SHAPES:
        num_ranks = per_node * num_nodes
        data = planner.buffer_size_hint(num_ranks, num_tokens, hidden, num_topk, fp8, True, multiple, per_node)
        region = buffer_scaleout_region(data, num_ranks, H200_SMS, hidden, num_topk, num_tokens, fp8, multiple,
                                        num_nodes)  # fmt: skip
        theirs = v2_hybrid_hint(per_node, num_nodes, num_tokens, hidden, num_topk, fp8, multiple)
        assert theirs == v2_hybrid_hint_bytes(per_node, num_nodes, num_tokens, hidden, num_topk, fp8, multiple)
        shape = (per_node, num_nodes, num_tokens, num_topk, fp8, multiple, hidden)
        assert region.offset + region.num_bytes <= theirs, (shape, data, region, theirs)
        worst = max(worst, (region.offset + region.num_bytes) / theirs)
        slot = CombineSlotLayout(hidden, num_topk or 32).num_bytes
        num_full_rings += entries_per_warp(region.ring_bytes, H200_SMS, slot) >= (1 if multiple else num_topk or 8)
    print(f"\n{len(HYBRID_SHAPES)} hybrid shapes, EP4 to EP64: the whole window is at most {worst:.3f}x V2's hint; "
          f"{num_full_rings} give every SM's warps their ring entries")  # fmt: skip
