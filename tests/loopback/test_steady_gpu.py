"""The steady path (`deep_ep.backends.kernels.steady`) on virtual ranks of one GPU: calls of a shape
seen before are replayed by the C++ program, with new data and new handles each time, and every
output is bitwise what `deep_ep.reference` gives (`sweep.run_case`). Also: an input whose layout
differs from the recording takes the Python path, and the steady path steps aside where it must
(column-major scales with CPU sync, `previous_event_before_epilogue`, guard bytes). Run on the GPU machine: `python -m pytest
-m gpu tests/loopback/test_steady_gpu.py`; the sweep (`test_loopback_gpu.py`) replays half its cases.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

NUM_ITERS = 5
# The iteration whose replays launch kernel by kernel (the others: one graph per program)
GRAPHLESS_ITER = 2


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))


# The sweep's shapes of one rank (its own are for 2 and more): those of the one-rank cases below
ONE_RANK_SHAPES = ((7168, 8, ("bf16", "fp32")),)

# One shape per case, every option the steady path takes: plain and FP8 data (row- and column-major
# scales), expanded layouts with alignment and padding, weights, biases, statistics, cached
# dispatches, and each stream mode it replays
BASE = dict(
    index=0, routing="uniform", masked=0.0, zero_all=False, zero_rank=False, full_rank=False, weights=True,
    stats=False, alignment=1, expand=False, zero_padding=False, cpu_sync=False, cached=True, handle_copy=True,
    call_max_tokens=False, num_bias=0, multiple_reduction=True, num_sms=0, combine_num_sms=0, stream="plain",
    col_major=False, cached_weights=True, replay=False,
)  # fmt: skip
CASES = {
    "ep2-bf16-bias2": (2, dict(hidden=7168, num_topk=8, dtype="bf16", num_local_experts=8, num_tokens=200,
                               num_bias=2, max_tokens=512)),
    "ep4-fp8-expand-async": (4, dict(hidden=7168, num_topk=8, dtype="fp32", num_local_experts=3, num_tokens=77,
                                     expand=True, zero_padding=True, alignment=128, col_major=True, stream="async",
                                     multiple_reduction=False, max_tokens=512)),
    "ep4-ue8m0-previous-stats": (4, dict(hidden=2064, num_topk=6, dtype="ue8m0", num_local_experts=16,
                                         num_tokens=300, stats=True, stream="previous", handle_copy=False,
                                         num_sms=8, combine_num_sms=6, max_tokens=512)),
    "ep8-bf16-on-comm-expand": (8, dict(hidden=4096, num_topk=9, dtype="bf16", num_local_experts=2,
                                        num_tokens=64, expand=True, stream="on_comm", num_bias=1, max_tokens=256)),
    # One rank, whose GPU is its own: its replays launch each program as one CUDA graph
    "ep1-bf16-bias1-graphs": (1, dict(hidden=7168, num_topk=8, dtype="bf16", num_local_experts=32, num_tokens=256,
                                      num_bias=1, max_tokens=512)),
    "ep1-fp8-cpu-sync-graphs": (1, dict(hidden=7168, num_topk=8, dtype="fp32", num_local_experts=64,
                                        num_tokens=128, cpu_sync=True, expand=True, alignment=128, max_tokens=512)),
    # CPU sync: the host reads the counts between the two parts of the replay
    "ep4-fp8-cpu-sync-expand": (4, dict(hidden=7168, num_topk=8, dtype="fp32", num_local_experts=8,
                                        num_tokens=150, cpu_sync=True, expand=True, alignment=128,
                                        zero_padding=True, max_tokens=512)),
    "ep2-bf16-cpu-sync-async": (2, dict(hidden=2056, num_topk=1, dtype="bf16", num_local_experts=16,
                                        num_tokens=333, cpu_sync=True, stream="async", max_tokens=512)),
}  # fmt: skip


def _steady_rank(rank: int, group: dist.ProcessGroup, case: dict, seed: int) -> dict:
    from sweep import make_buffers, run_case

    buffers = make_buffers(group, group.size())
    kernels = buffers[case["multiple_reduction"]][0]
    steady = kernels._steady
    try:
        for i in range(NUM_ITERS):  # the same shapes, new data and routing each time
            if steady is not None:  # each program's kernels as one graph, but in one iteration
                steady.set_graphs(i != GRAPHLESS_ITER)
            run_case(buffers, rank, group.size(), case, seed + 101 * i)
        if steady is None:
            return {"steady": False, "calls": 0}
        return {"steady": True, "calls": steady.num_calls, "refused": steady.num_refused,
                "declined": sorted({f"{key[0]}: {reason}" for key, reason in steady.declined.items()}),
                "graphs": steady.graph_stats(), "graphs_refused": steady.graphs_refused}  # fmt: skip
    finally:
        for pair in buffers.values():
            for buffer in pair:
                buffer.destroy()


@pytest.mark.parametrize("name", list(CASES))
def test_replayed_calls_are_bitwise_equal_to_the_reference(name):
    from deep_ep.jit import compile_many
    from sweep import SHAPES, kernel_specs

    num_ranks, options = CASES[name]
    case = {**BASE, **options}
    compile_many(kernel_specs(num_ranks, shapes={**SHAPES, 1: ONE_RANK_SHAPES}))
    seed = _seed()
    world = LoopbackWorld(num_ranks)
    try:
        outcomes = world.run(_steady_rank, case, seed)
    finally:
        world.close()
    # Every call after the first of its shape: the fresh dispatch, the cached one and the combine
    expected = (NUM_ITERS - 1) * 3
    assert all(o["steady"] for o in outcomes), outcomes
    assert [o["calls"] for o in outcomes] == [expected] * num_ranks, (outcomes, seed)
    # One rank: every replay's program is one graph launch (a CPU-sync dispatch: its first program; the
    # second starts with a PDL epilogue), but in the graphless iteration. Ranks that share the GPU
    # launch kernel by kernel (building a graph may wait for a peer's kernel)
    pdl_first = "its first kernel overlaps the stream's earlier work (PDL)"
    expected_problems = {pdl_first: 1} if case["cpu_sync"] and num_ranks == 1 else {}
    for o in outcomes:
        assert (o["graphs_refused"] is None) == (num_ranks == 1), (o, seed)
        assert o["graphs"]["launches"] == ((NUM_ITERS - 2) * 3 if num_ranks == 1 else 0), (o, seed)
        assert o["graphs"]["problems"] == expected_problems, (o, seed)
    print(f"\nsteady {name}: seed {seed}, {expected} replayed calls per rank, bitwise equal")


def _fallback_rank(rank: int, group: dist.ProcessGroup, seed: int) -> dict:
    from kernel_checks import make_inputs

    import deep_ep

    num_experts = 8 * group.size()
    sizes = dict(num_max_tokens_per_rank=128, hidden=2048, num_topk=8, use_fp8_dispatch=True, explicitly_destroy=True)
    buf = deep_ep.ElasticBuffer(group, **sizes)
    ref = deep_ep.ElasticBuffer(group, backend="reference", **sizes)
    outcome: dict = {}
    try:
        (data, scales), topk_idx, _, _ = make_inputs(rank, group.size(), 96, 2048, "fp32", num_experts, 8, "uniform",
                                                     0.0, 0, seed, "cuda")  # fmt: skip
        routed = dict(topk_idx=topk_idx, num_experts=num_experts, do_cpu_sync=False)
        buf.dispatch((data, scales), **routed)  # recorded
        # The same key with column-major scales (any strides are valid): the program refuses them, the
        # Python path copies them, and a recording of that call is not made (the copy is the call's own)
        col_major = scales.t().contiguous().t()
        calls = buf._steady.num_calls
        out = buf.dispatch((data, col_major), **routed)
        expected = ref.dispatch((data, scales), **routed)
        torch.cuda.current_stream().synchronize()
        rows = int(expected[3].psum_num_recv_tokens_per_scaleup_rank[-1])
        outcome["equal"] = all(torch.equal(a[:rows], b[:rows]) for a, b in zip(out[0], expected[0], strict=True))
        outcome["steady_after_col_major"] = buf._steady.num_calls - calls
        # Column-major scales with CPU sync and an event before the epilogue stay on the Python path
        calls = buf._steady.num_calls
        for _ in range(2):
            buf.dispatch((data, scales), topk_idx=topk_idx, num_experts=num_experts, use_tma_aligned_col_major_sf=True)
            buf.dispatch((data, scales), previous_event_before_epilogue=deep_ep.ElasticBuffer.capture(), **routed)
        outcome["steady_after_python_only"] = buf._steady.num_calls - calls
        # And the recorded shape still replays
        calls = buf._steady.num_calls
        again = buf.dispatch((data, scales), **routed)
        outcome["steady_again"] = buf._steady.num_calls - calls
        torch.cuda.current_stream().synchronize()
        outcome["equal_again"] = all(
            torch.equal(a[:rows], b[:rows]) for a, b in zip(again[0], expected[0], strict=True)
        )
    finally:
        buf.destroy()
        ref.destroy()
    return outcome


def test_an_input_unlike_the_recording_and_the_python_only_calls_take_the_python_path():
    world = LoopbackWorld(2)
    try:
        outcomes = world.run(_fallback_rank, _seed())
    finally:
        world.close()
    for outcome in outcomes:
        assert outcome == dict(equal=True, steady_after_col_major=0, steady_after_python_only=0, steady_again=1,
                               equal_again=True), outcomes  # fmt: skip


def _guarded_rank(rank: int, group: dist.ProcessGroup) -> bool:
    import deep_ep

    buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=2048, num_topk=8, explicitly_destroy=True)
    try:
        return buf._steady is None
    finally:
        buf.destroy()


def test_a_world_with_guard_bytes_has_no_steady_path():
    world = LoopbackWorld(2, guard_bytes=4096)
    try:
        assert world.run(_guarded_rank) == [True, True]
    finally:
        world.close()


def test_a_rank_whose_replayed_routing_is_rejected_stops_every_rank_at_once():
    """The fail-fast case of `test_fail_fast_gpu.py` where the steady path serves the calls: the bad
    CPU-sync dispatch replays a recorded shape, the device rejects its routing, and the replay raises
    the routing's error on its rank and the peer's on the others (the front's wait for the counts
    hands a fault to `NvlinkRuntime.wait_counts`)."""
    from fail_fast import bad_input_rank, check_outcomes

    num_ranks, bad_rank = 4, random.randrange(4)
    world = LoopbackWorld(num_ranks)  # no guard bytes: the buffers have a steady path
    try:
        outcomes = world.run(bad_input_rank, bad_rank, "topk_idx", 2048, "kernels")
    finally:
        world.close()
    check_outcomes(outcomes, bad_rank, "topk_idx")
    # The second warm-up round trip was a replay (dispatch and combine): so is the bad call, of its shape
    assert all(outcome["steady_calls"] >= 2 for outcome in outcomes), outcomes
