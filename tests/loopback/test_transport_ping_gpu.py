"""The transport self-test (transport_ping.cuh) on virtual ranks of one GPU, over LSA and through the
emulated NIC of virtual nodes (transport/emulated.cuh): every rank's block reaches every peer bit for
bit, its signal after it, within the deadline; the buffer works afterwards (the ping runs between
operations). Each protocol mistake (no flush before the source is reused, the signal before its put,
the put and its signal on different contexts) must give wrong bytes through the strict NIC. The GIN
instantiation only compiles here (tests/test_nccl_matrix.py): no machine here has an RDMA NIC."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _ping_rank(rank: int, group: dist.ProcessGroup) -> tuple[list[list[int]], tuple]:
    from kernel_checks import make_inputs

    import deep_ep
    from deep_ep.backends.kernels.ping import transport_ping

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=2048, num_topk=8, backend="kernels",
                                   explicitly_destroy=True)  # fmt: skip
    runtime = buffer.backend.runtime
    rounds = [transport_ping(runtime, num_bytes) for num_bytes in (16, 4096, 1 << 16)]
    x, topk_idx, weights, _ = make_inputs(rank, group.size(), 32, 2048, "bf16", 8 * group.size(), 8, "uniform",
                                          0.0, 0, 5, "cuda")  # fmt: skip
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size())
    shapes = (tuple(recv_x.shape), handle.num_recv_tokens)
    buffer.destroy()
    return rounds, shapes


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_every_block_reaches_every_peer(num_ranks: int) -> None:
    for rounds, (recv_shape, num_recv) in LoopbackWorld(num_ranks).run(_ping_rank):
        assert rounds == [[1] * num_ranks] * 3, rounds
        assert recv_shape[0] == num_recv  # the buffer still dispatches after the pings


def _emulated_rank(rank: int, group: dist.ProcessGroup, seed: int) -> dict:
    import deep_ep
    from deep_ep.backends.kernels.ping import transport_ping

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=2048, num_topk=8, backend="kernels",
                                   explicitly_destroy=True)  # fmt: skip
    runtime = buffer.backend.runtime
    outcome = {}
    for transport in ("emulated-eager", "emulated-strict"):
        outcome[transport] = [transport_ping(runtime, num_bytes, transport=transport, seed=seed + num_bytes)
                              for num_bytes in (16, 4096, 1 << 16)]  # fmt: skip
    # A put waits 20 ms in the strict NIC: longer than the ranks' launches after the barrier can spread
    for mistake in ("no_flush", "signal_first", "split_contexts"):
        for transport in ("emulated-eager", "emulated-strict"):
            outcome[f"{transport} {mistake}"] = transport_ping(runtime, 4096, transport=transport, mistake=mistake,
                                                               delay_us=20000.0, seed=seed)  # fmt: skip
    buffer.destroy()
    return outcome


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_the_emulated_nic_delivers_and_the_strict_one_catches_each_protocol_mistake(num_ranks: int) -> None:
    import time

    seed = time.time_ns() % 1_000_000
    outcomes = LoopbackWorld(num_ranks).run(_emulated_rank, seed)
    for rank, outcome in enumerate(outcomes):
        for transport in ("emulated-eager", "emulated-strict"):
            assert outcome[transport] == [[1] * num_ranks] * 3, (rank, transport, seed, outcome[transport])
        # Eager puts copy at once: the mistakes that only a late put exposes pass there
        assert outcome["emulated-eager no_flush"] == [1] * num_ranks, (rank, seed, outcome)
        for mistake in ("no_flush", "signal_first", "split_contexts"):
            seen = outcome[f"emulated-strict {mistake}"]
            assert all(r in (0, 1) for r in seen), (rank, mistake, seed, seen)  # every signal came
            assert seen.count(0) == num_ranks - 1, (rank, mistake, seed, seen)  # every peer's bytes were wrong
