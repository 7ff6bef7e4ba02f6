"""deep_ep.loopback on CPU threads: the collectives of `LoopbackGroup`, `LoopbackWorld.run`, the
reference backend on virtual ranks against the brute-force oracle, and the world's checks."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from oracle import Case, Routing, assert_bitwise, check_dispatch, expected_combine, gather_to_all

import deep_ep
from deep_ep.loopback import LoopbackGroup, LoopbackRankError, LoopbackWorld, loopback_world
from deep_ep.utils.routing import uniform_routing


def _collectives_rank(rank: int, group: LoopbackGroup) -> dict:
    n = group.size()
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([rank, 10 * rank]), group=group)
    total, low, high = (torch.tensor([rank + 1.0]) for _ in range(3))
    dist.all_reduce(total, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    root = torch.tensor([rank * 7])
    dist.broadcast(root, group=group, group_src=n - 1)
    # Uneven splits: rank r sends r + d + 1 rows to rank d
    sends = [rank + d + 1 for d in range(n)]
    recvs = [s + rank + 1 for s in range(n)]
    rows = torch.cat([torch.full((sends[d], 3), 100 * rank + d) for d in range(n)])
    out = torch.empty((sum(recvs), 3), dtype=rows.dtype)
    dist.all_to_all_single(out, rows, recvs, sends, group=group)
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank}, group=group)
    work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
    dist.barrier(group=group)
    return dict(gathered=[g.tolist() for g in gathered], total=total.item(), low=low.item(),
                high=high.item(), root=root.item(), out=out[:, 0].tolist(), objects=objects,
                completed=work.is_completed(), world_size=dist.get_world_size(group))  # fmt: skip


def test_collectives_match_their_definitions():
    n = 3
    results = LoopbackWorld(n, device="cpu", timeout_s=30).run(_collectives_rank)
    for rank, result in enumerate(results):
        assert result["gathered"] == [[r, 10 * r] for r in range(n)]
        assert (result["total"], result["low"], result["high"]) == (6.0, 1.0, 3.0)
        assert result["root"] == 7 * (n - 1)
        assert result["out"] == [100 * s + rank for s in range(n) for _ in range(s + rank + 1)]
        assert result["objects"] == [{"rank": r} for r in range(n)]
        assert result["completed"] and result["world_size"] == n


def _reference_rank(rank: int, group: LoopbackGroup, seed: int) -> int:
    """The reference backend on virtual ranks, against the brute-force oracle."""
    n = group.size()
    rng = random.Random(seed)
    buffers = {amr: deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=48, hidden=256, num_topk=4,
                                          allow_multiple_reduction=amr, explicitly_destroy=True)
               for amr in (True, False)}  # fmt: skip
    assert all(b.backend.name == "reference" for b in buffers.values())
    num_cases = 8
    for i in range(num_cases):
        num_experts, num_topk = 4 * n, rng.randint(1, 4)
        expand, alignment, amr = rng.random() < 0.5, rng.choice((1, 8)), rng.random() < 0.5
        gen = torch.Generator().manual_seed(seed * 100 + i * 10 + rank)
        num_tokens = torch.randint(0, 48, (1,), generator=gen).item()
        topk_idx, weights = uniform_routing(num_tokens, num_experts, num_topk, masked_ratio=0.2, generator=gen)
        x = torch.randn((num_tokens, 256), generator=gen).to(torch.bfloat16)
        buffer = buffers[amr]
        recv_x, recv_topk, recv_w, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights,
                                                               num_experts=num_experts, expert_alignment=alignment,
                                                               do_expand=expand)  # fmt: skip
        inputs = gather_to_all({"x": x, "scales": None, "topk_idx": topk_idx, "topk_weights": weights}, group)
        routing = Routing([t["topk_idx"].tolist() for t in inputs], num_experts, n, alignment)
        case = Case(rank=rank, num_ranks=n, num_experts=num_experts, num_topk=num_topk, hidden=256,
                    num_max_tokens_per_rank=48, expert_alignment=alignment, do_expand=expand, do_cpu_sync=True,
                    do_zero_padding=False, col_major=False)  # fmt: skip
        check_dispatch(case, routing, inputs, recv_x, recv_topk, recv_w, handle)
        rows = torch.randn((handle.num_combine_rows, 256), generator=gen).to(torch.bfloat16)
        combined = buffer.combine(rows, handle)[0]
        everyone = gather_to_all({"x": rows, "topk_weights": None}, group)
        expected = expected_combine(rank, routing, everyone, expand, amr, [], 256, num_topk)[0]
        assert_bitwise(combined, expected, f"case {i}: combine")
    for buffer in buffers.values():
        buffer.destroy()
    return num_cases


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_reference_backend_on_virtual_ranks_matches_the_oracle(num_ranks):
    seed = time.time_ns() % 100_000
    assert LoopbackWorld(num_ranks, device="cpu").run(_reference_rank, seed) == [8] * num_ranks


def _fail_on_rank_one(rank: int, group: LoopbackGroup) -> int:
    if rank == 1:
        raise KeyError("rank one's mistake")
    dist.barrier(group=group)  # rank 1 never comes: the world stops the others' wait
    return rank


def test_a_failing_rank_stops_the_others_and_is_reported():
    world = LoopbackWorld(3, device="cpu", timeout_s=60)
    started = time.monotonic()
    with pytest.raises(LoopbackRankError, match="rank one's mistake") as caught:
        world.run(_fail_on_rank_one)
    assert time.monotonic() - started < 10
    assert isinstance(caught.value.errors[1], KeyError)
    assert all(
        isinstance(e, RuntimeError) and "rank 1 raised" in str(e)
        for e in (caught.value.errors[0], caught.value.errors[2])
    )
    results = world.run(_fail_on_rank_one, return_exceptions=True)
    assert isinstance(results[1], KeyError)
    # A world runs again after a failure
    assert world.run(lambda rank, group: group.rank()) == [0, 1, 2]


def test_world_arguments_are_checked():
    with pytest.raises(ValueError, match="num_ranks"):
        LoopbackWorld(0, device="cpu")
    with pytest.raises(ValueError, match="num_ranks"):
        LoopbackWorld(65, device="cpu")
    with pytest.raises(ValueError, match="guard_bytes"):
        LoopbackWorld(2, device="cpu", guard_bytes=-1)
    with pytest.raises(ValueError, match="device"):
        LoopbackWorld(2, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            LoopbackWorld(2, device=0)


def _kernels_on_cpu(rank: int, group: LoopbackGroup) -> str:
    assert loopback_world(group) is group.loopback_world
    with pytest.raises(ValueError, match="does not support this group"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, backend="kernels")
    return "ok"


def test_a_cpu_world_refuses_the_kernels_backend():
    assert LoopbackWorld(2, device="cpu").run(_kernels_on_cpu) == ["ok", "ok"]
    assert loopback_world(dist.group.WORLD) is None


def _two_threads_rank(rank: int, group: LoopbackGroup, peer_may_go: threading.Event) -> str:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=128, num_topk=2, explicitly_destroy=True)
    topk_idx, _ = uniform_routing(8, 4, 2, generator=torch.Generator().manual_seed(rank))
    x = torch.randn((8, 128)).to(torch.bfloat16)
    x_before = x.clone()
    message = "none"
    if rank == 0:
        first = threading.Thread(target=buffer.dispatch, args=(x,), kwargs=dict(topk_idx=topk_idx, num_experts=4),
                                 name="first-caller")  # fmt: skip
        first.start()  # waits inside the dispatch for rank 1, which holds back until told
        deadline = time.monotonic() + 10
        while not buffer._in_use.locked() and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            buffer.dispatch(x, topk_idx=topk_idx, num_experts=4)
        except RuntimeError as error:
            message = str(error)
        peer_may_go.set()
        first.join(timeout=30)
    else:
        peer_may_go.wait(timeout=30)
        buffer.dispatch(x, topk_idx=topk_idx, num_experts=4)
    handle = buffer.dispatch(x, topk_idx=topk_idx, num_experts=4)[3]  # still usable, one thread at a time
    buffer.combine(torch.randn((handle.num_combine_rows, 128)).to(torch.bfloat16), handle)
    assert torch.equal(x, x_before)
    buffer.destroy()
    return message


def test_a_buffer_called_from_a_second_thread_while_busy_raises_and_stays_usable():
    peer_may_go = threading.Event()
    messages = LoopbackWorld(2, device="cpu", timeout_s=60).run(_two_threads_rank, peer_may_go)
    assert "while thread 'first-caller' is inside a call of the same buffer" in messages[0], messages
    assert "one thread at a time" in messages[0] and messages[1] == "none"
