"""`deep_ep.bench` on a GPU: what the benchmark's own machinery must not do to a long run."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_released_graphs_give_their_memory_pools_back():
    """Every captured graph has a memory pool of its own; releasing the graphs must return it, or a
    bench of many cases reserves each case's pools anew until a capture runs out of memory."""
    from deep_ep.bench.timing import capture, release_captured

    num_bytes = 256 << 20

    def call(r: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(r + 1)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    num_rounds, num_graphs, num_calls = 8, 2, 2
    for _ in range(num_rounds):
        op = capture(call, num_graphs, num_calls)
        assert int(op.replay_first()[0]) == 1
        release_captured([op], lambda: None)
    grown = torch.cuda.memory_reserved() - before
    # One round's graphs hold num_graphs * num_calls * num_bytes (1 GiB); the warm-up call's block
    # may stay cached outside any pool
    assert grown <= num_bytes, f"{grown / 2**30:.2f} GiB still reserved after {num_rounds} rounds of released graphs"


def test_host_bench_on_virtual_ranks_times_the_kernels_and_their_graphs():
    """`deep-ep bench --host` on one GPU: every operation of the kernels has host, eager and (where a
    graph can hold it) GPU times, and the kernels' targets are reported."""
    from deep_ep.jit import compile_many

    from deep_ep.bench import cases, host

    # One rank: its GPU is its own, so its replays launch as CUDA graphs (ranks sharing it do not)
    config = cases.BenchConfig(cases.make_cases([128], None, ["fp8"], ["uniform"], 7168, 8, 256), 1, "cuda",
                               virtual_ranks=True, num_warmups=2, num_iters=5, num_graph_samples=2, seed=7,
                               host_graph_ab_rounds=2)  # fmt: skip
    compile_many(cases.kernel_specs(config))
    rows = host.run_host(config, command="pytest")
    assert [r["op"] for r in rows] == list(host.HOST_OPS)
    for row in rows:
        assert row["backend"] == "NvlinkBackend" and 0 < row["host_wall_us"] <= row["eager_wall_us"], row
        assert (row["gpu_us"] is None) == (row["op"] == "dispatch_cpu_sync"), row
        # A CPU-sync dispatch's target is its wait for the counts + 30 us; only it waits
        assert (row["count_wait_us"] is not None) == (row["op"] == "dispatch_cpu_sync"), row
        assert row["host_target_us"] is not None, row
        # The floor of the run: every call launches at least one kernel and takes at least one allocation
        assert 0 < row["launch_floor_us"] <= row["host_wall_us"] and 0 < row["alloc_floor_us"] < row["host_wall_us"]
        assert 0 < row["timer_floor_us"] < row["host_wall_us"], row
        # Every replay is one graph launch (a CPU-sync dispatch's first program; its second starts with a
        # PDL epilogue), and with new addresses every call the graph's nodes are set again
        graphs, num_calls = row["graphs"], config.num_warmups + config.num_iters
        assert 0 < graphs["launches"] == row["steady_calls"] and graphs["moved_launches"] == num_calls, row
        assert graphs["moved_updates"] >= num_calls, row
        # The A/B: both modes timed, in the same and in moved calls
        ab = row["graph_ab"]
        assert ab["graphs_us"] > 0 and ab["kernels_us"] > 0 and ab["ratio_moved"] > 0, row
        assert 0 < row["host_wall_moved_us"], row


def test_nodes_bench_counts_every_byte_each_mode_puts_across_virtual_nodes():
    """`deep-ep bench --nodes 2` on 4 virtual ranks of one GPU: each rank's NIC counters around a
    dispatch and a combine, in direct and in hybrid mode, equal the bytes that mode puts for its
    routing (checked on every rank inside the run, bitwise results first), and hybrid mode sends
    fewer records over the NIC (each token at most once per remote node)."""
    from deep_ep.jit import compile_many

    from deep_ep.bench import cases, nodes

    config = cases.BenchConfig(cases.make_cases([128, 96], None, ["fp8", "bf16"], ["uniform", "imbalanced"], 7168, 8,
                                                256), 4, "cuda", virtual_ranks=True, seed=11)  # fmt: skip
    compile_many(nodes.kernel_specs(config))
    rows = nodes.run_nodes(config, 2, command="pytest")
    assert len(rows) == 8
    for row in rows:
        assert row["dispatch_bytes"] == row["direct_dispatch_bytes"] > 0, row
        assert row["combine_bytes"] == row["direct_combine_bytes"] > 0, row
        assert row["dispatch_puts"] > 0 and row["dispatch_signals"] > 0 and row["combine_signals"] > 0, row
        assert row["remote_node_hits"] < row["remote_rank_hits"], row
        assert row["hybrid_dispatch_measured"] == row["hybrid_dispatch_bytes"] < row["dispatch_bytes"], row
        assert row["hybrid_combine_measured"] == row["combine_bytes"], row
