"""The kernels across virtual nodes on one GPU (`deep_ep.loopback`, `num_ranks_per_node`): ranks of other
nodes reached only through the emulated NIC (docs/transport.md), in both its modes.

Direct mode on 2 x 4, 4 x 2, 4 x 4 and 8 x 2 nodes x ranks: a random sweep of every dispatch and
combine option, bitwise against `deep_ep.reference`; CUDA-graph replay; a stalled node makes every
rank raise `EPTimeoutError` naming the node and rank; and each protocol mistake the strict NIC makes
on request (a signal before its puts, or on another context; a staging entry reused without a flush)
breaks the results, where the same run without it is bitwise right. Run on the GPU machine:
`python -m pytest -m gpu tests/loopback/test_virtual_nodes_gpu.py`.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

from deep_ep.backends.kernels.links import NicOptions
from deep_ep.loopback import LoopbackRankError, LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# (nodes, ranks per node)
TOPOLOGIES = ((2, 4), (4, 2), (4, 4), (8, 2))
# Hybrid mode's (issue 17)
HYBRID_TOPOLOGIES = ((2, 4), (2, 8), (4, 4))
# Cases per topology and NIC mode (EP_LOOPBACK_CASES scales them)
NUM_CASES = max(4, round(14 * float(os.environ.get("EP_LOOPBACK_CASES", "1"))))
FAULT_TIMEOUT_S = float(os.environ.get("EP_FAULT_TIMEOUT_S", "2"))


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))


def _world(num_nodes: int, num_ranks_per_node: int, nic: NicOptions, **kwargs) -> LoopbackWorld:
    return LoopbackWorld(num_nodes * num_ranks_per_node, num_ranks_per_node=num_ranks_per_node, nic=nic, **kwargs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["direct", "hybrid"])
@pytest.mark.parametrize("mode", ["eager", "strict"])
def test_the_sweep_across_virtual_nodes_is_bitwise_equal_to_the_reference(mode: str, layout: str) -> None:
    """Direct mode on `TOPOLOGIES`; hybrid mode (issue 17) on `HYBRID_TOPOLOGIES`, against the
    reference's hybrid model (its combine's node stage)."""
    from deep_ep.jit import compile_many
    from sweep import NODE_LOCAL_EXPERTS, NODE_SHAPES, kernel_specs, make_cases, sweep_rank

    seed = _seed()
    hybrid = layout == "hybrid"
    started = time.monotonic()
    compile_many([spec for n in NODE_SHAPES for spec in kernel_specs(n, f"emulated-{mode}", NODE_SHAPES,
                                                                          NODE_LOCAL_EXPERTS, hybrid)])  # fmt: skip
    compiled = time.monotonic()
    lines = []
    topologies = HYBRID_TOPOLOGIES if hybrid else TOPOLOGIES
    for num_nodes, per_node in topologies:
        num_ranks = num_nodes * per_node
        cases = make_cases(num_ranks, NUM_CASES, seed, NODE_SHAPES, NODE_LOCAL_EXPERTS)
        world = _world(num_nodes, per_node, NicOptions(strict=mode == "strict", seed=seed))
        begin = time.monotonic()
        counts = world.run(sweep_rank, cases, seed, hybrid)
        world.close()
        assert counts == [NUM_CASES] * num_ranks
        lines.append(f"{num_nodes}x{per_node}: {NUM_CASES} cases in {time.monotonic() - begin:.1f} s")
    print(f"\nvirtual nodes, {layout} mode, {mode} NIC, seed {seed}: {len(topologies) * NUM_CASES} configurations "
          f"bitwise equal to deep_ep.reference in {time.monotonic() - compiled:.1f} s (+{compiled - started:.1f} s "
          f"compiling): {'; '.join(lines)}")  # fmt: skip


@pytest.mark.parametrize("layout", ["direct", "hybrid"])
@pytest.mark.parametrize("mode", ["eager", "strict"])
def test_cuda_graph_replays_across_virtual_nodes(mode: str, layout: str) -> None:
    from graphs import graph_rank

    seed = _seed()
    world = _world(2, 4, NicOptions(strict=mode == "strict", seed=seed))
    checked = world.run(functools.partial(graph_rank, allow_hybrid_mode=layout == "hybrid"), seed, 3)
    world.close()
    assert checked == [12] * 8
    print(f"\ngraphs, 2x4 virtual nodes, {layout} mode, {mode} NIC: {checked[0]} replays checked per rank, seed {seed}")


def test_a_stalled_node_makes_every_rank_raise_naming_the_node_and_rank() -> None:
    from nodes import stalled_node_rank

    num_nodes, per_node, stalled = 2, 4, 1
    world = _world(num_nodes, per_node, NicOptions(strict=True, seed=_seed()), guard_bytes=64 << 10)
    outcomes = world.run(stalled_node_rank, stalled, per_node, FAULT_TIMEOUT_S)
    damaged = world.check_guards()
    world.close()
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} did not raise: {outcome}"
        assert f"(node {stalled}, local rank" in outcome["error"], (rank, outcome)
        if rank // per_node != stalled:
            assert outcome["raised_s"] < 3 * FAULT_TIMEOUT_S, (rank, outcome)
    assert damaged == [], damaged
    slowest = max(o["raised_s"] for r, o in enumerate(outcomes) if r // per_node != stalled)
    print(f"\nstalled node {stalled} of {num_nodes}x{per_node}: every rank raised, the live ones within {slowest:.2f} s "
          f"(deadline {FAULT_TIMEOUT_S:g} s); guards intact; rank 0: {outcomes[0]['error'][:200]}; rank "
          f"{per_node}: {outcomes[per_node]['error'][:200]}")  # fmt: skip


def test_a_stalled_forwarder_makes_every_rank_raise_naming_it() -> None:
    """Hybrid mode: one rank sits out a dispatch. Its node's ranks wait for what the other nodes'
    sources send through it, its rail peers for its counts, every rank for its records: each raises
    `EPTimeoutError` naming it (as the source, or as the forwarder the source's records come through)."""
    from nodes import stalled_forwarder_rank

    num_nodes, per_node, stalled = 2, 4, 5
    world = _world(num_nodes, per_node, NicOptions(strict=True, seed=_seed()), guard_bytes=64 << 10)
    outcomes = world.run(stalled_forwarder_rank, stalled, FAULT_TIMEOUT_S)
    damaged = world.check_guards()
    world.close()
    name = f"rank {stalled} (node {stalled // per_node}, local rank {stalled % per_node})"
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} did not raise: {outcome}"
        assert name in outcome["error"], (rank, outcome)
        if rank != stalled:
            assert outcome["raised_s"] < 3 * FAULT_TIMEOUT_S, (rank, outcome)
    assert damaged == [], damaged
    slowest = max(o["raised_s"] for r, o in enumerate(outcomes) if r != stalled)
    print(f"\nstalled forwarder {name} of {num_nodes}x{per_node}, hybrid mode: every rank raised naming it, the live "
          f"ones within {slowest:.2f} s (deadline {FAULT_TIMEOUT_S:g} s); guards intact; rank 0: "
          f"{outcomes[0]['error'][:220]}; rank 1: {outcomes[1]['error'][:220]}")  # fmt: skip


@pytest.mark.parametrize("mistake", ["signal_first", "split_contexts", "no_flush"])
def test_the_strict_nic_catches_each_protocol_mistake(mistake: str) -> None:
    from nodes import mistake_rank

    seed = _seed()
    # A long delay: a put waits in the NIC far longer than its receiver takes to read; one staging
    # entry per warp, so that every second row of a warp reuses it
    nic = dict(strict=True, delay_us=200.0, seed=seed, ring_entries_per_warp=1)
    control = _world(2, 2, NicOptions(**nic))
    assert control.run(mistake_rank, seed, 3) == [3] * 4
    control.close()
    broken = _world(2, 2, NicOptions(**nic, mistake=mistake))
    outcomes = broken.run(mistake_rank, seed, 3, return_exceptions=True)
    broken.close()
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    assert failures, f"{mistake}: every rank's results were right ({outcomes})"
    assert not any(isinstance(o, LoopbackRankError) for o in failures)
    print(f"\nstrict NIC, {mistake}: {len(failures)} of 4 ranks wrong or failed (seed {seed}); the same run without "
          f"the mistake bitwise right; first: {type(failures[0]).__name__}: {str(failures[0])[:160]}")  # fmt: skip


@pytest.mark.parametrize("num_nodes, per_node, mode, num_topk", [(2, 4, "strict", None), (2, 4, "eager", None),
                                                               (4, 2, "strict", None), (4, 4, "strict", None),
                                                               (2, 8, "strict", 4), (2, 4, "eager", 3)])  # fmt: skip
def test_hybrid_dispatch_sends_each_token_once_per_node(num_nodes: int, per_node: int, mode: str,
                                                         num_topk: int | None) -> None:  # fmt: skip
    """Hybrid mode (issue 17, docs/hybrid.md): a fresh dispatch sends each token across the NIC once per
    remote node, to its forwarder there, which passes it on by stores; outputs bitwise equal to the
    reference, the NIC's bytes and puts exactly hybrid mode's, then a cached dispatch and a combine;
    with `num_topk` below the ranks per node, the combine's lane slots."""
    from nodes import hybrid_rank

    seed = _seed()
    world = _world(num_nodes, per_node, NicOptions(strict=mode == "strict", seed=seed))
    checked = world.run(hybrid_rank, per_node, seed, num_topk)
    world.close()
    assert checked == [6] * (num_nodes * per_node)
    print(
        f"\nhybrid mode, {num_nodes}x{per_node} virtual nodes, {mode} NIC, top-{num_topk or 'shape'}, seed {seed}: "
        f"{checked[0]} rounds per rank "
        "(fresh, cached, combine) bitwise equal to the reference, each token across the NIC once per remote node"
    )
