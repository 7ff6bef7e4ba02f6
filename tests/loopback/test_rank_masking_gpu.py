"""Rank masking on the kernels (issue 20 #2), on 8 virtual ranks of one GPU: rank 5 stops in the
middle of a run, the other 7 mask it and go on, bitwise equal to `deep_ep.reference` given the
routing with rank 5's lanes removed (`docs/semantics.md`, "Rank masking"), in eager calls and in
replays of a CUDA graph captured before rank 5 stopped (the mask lives on the device: no re-capture).
Manually (the survivors call `mask_ranks([5])`) and automatically (`mask_ranks_on_timeout`: their
first wait on rank 5 expires and masks it; in that first operation only what they receive is checked,
since their own tokens for rank 5 had left before it was masked).

Rank 5 never touches its kernels buffer again once it stops; it still makes the reference buffer's
calls (with every lane of its own `-1`, what masking means for it), because the reference's torch
collectives need every rank and are the oracle here. Run on the GPU machine:
`python -m pytest -m gpu tests/loopback/test_rank_masking_gpu.py`.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

NUM_RANKS, STOPPED = 8, 5
HIDDEN, NUM_TOPK, TMAX, NUM_TOKENS = 2048, 8, 128, 96
NUM_EXPERTS = 8 * NUM_RANKS
NUM_LOCAL = NUM_EXPERTS // NUM_RANKS


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))


def _buffers(group: dist.ProcessGroup, automatic: bool) -> tuple:
    import deep_ep

    # Automatic mode: the deadline is what the survivors' first operation without rank 5 waits
    common = dict(num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK, explicitly_destroy=True,
                  num_gpu_timeout_secs=1 if automatic else 10, num_cpu_timeout_secs=60)  # fmt: skip
    kbuf = deep_ep.ElasticBuffer(group, backend="kernels", enable_rank_masking=True, mask_ranks_on_timeout=automatic,
                                 **common)  # fmt: skip
    rbuf = deep_ep.ElasticBuffer(group, backend="reference", **common)
    return kbuf, rbuf


def _inputs(rank: int, dtype: str, seed: int) -> tuple:
    from kernel_checks import make_inputs

    return make_inputs(rank, NUM_RANKS, NUM_TOKENS, HIDDEN, dtype, NUM_EXPERTS, NUM_TOPK, "uniform", 0.1, 1, seed,
                       "cuda")  # fmt: skip


def _masked_routing(rank: int, topk_idx: torch.Tensor, masked: bool) -> torch.Tensor:
    """What the kernels must send under the mask: rank 5's experts' lanes -1, and all of rank 5's own."""
    if not masked:
        return topk_idx
    routing = topk_idx.masked_fill((topk_idx >= 0) & (topk_idx // NUM_LOCAL == STOPPED), -1)
    return torch.full_like(topk_idx, -1) if rank == STOPPED else routing


def _num_dropped(topk_idx: torch.Tensor, routing: torch.Tensor) -> int:
    return int(((topk_idx >= 0) & (routing < 0)).sum())


def _combine_rows(handle, do_expand: bool, seed: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    num_rows = handle.num_expanded_tokens if do_expand else handle.num_recv_tokens
    return (torch.randn((num_rows, HIDDEN), generator=gen) * 4).to(torch.bfloat16).cuda()


def _eager_step(rank: int, kbuf, rbuf, dtype: str, do_expand: bool, masked: bool, seed: int,
                transition: bool = False) -> int:  # fmt: skip
    """One dispatch and combine on both buffers (the kernels only where this rank runs), checked; in
    the `transition` (the operation whose waits mask rank 5) only what this rank received."""
    from kernel_checks import check_dispatch, equal

    x, topk_idx, weights, bias = _inputs(rank, dtype, seed)
    routing = _masked_routing(rank, topk_idx, masked)
    args = dict(topk_weights=weights, num_experts=NUM_EXPERTS, do_expand=do_expand)
    runs_kernels = not (masked and rank == STOPPED)
    if runs_kernels:
        given = topk_idx.clone()
        out_k = kbuf.dispatch(x, topk_idx=topk_idx, **args)
    out_r = rbuf.dispatch(x, topk_idx=routing, **args)
    rows = _combine_rows(out_r[3], do_expand, seed, rank)
    comb_r = rbuf.combine(rows, out_r[3], bias=bias)
    if not runs_kernels:
        return 0
    what = f"EP{NUM_RANKS} {dtype} expand={do_expand} masked={masked} rank {rank}"
    check_dispatch(out_k, out_r, do_expand, False, what, send_side=not transition)
    expected_dropped = 0 if transition else _num_dropped(topk_idx, routing)
    assert int(out_k[3].num_masked_lanes[0]) == expected_dropped, what
    comb_k = kbuf.combine(rows, out_k[3], bias=bias)
    equal(comb_k[0], comb_r[0], f"{what}: combined_x")
    equal(comb_k[1], comb_r[1], f"{what}: combined_topk_weights")
    equal(topk_idx, given, f"{what}: the caller's topk_idx")
    return 1


def _eager_rank(rank: int, group: dist.ProcessGroup, seed: int, automatic: bool) -> dict:
    kbuf, rbuf = _buffers(group, automatic)
    outcome = {"before": 0, "after": 0}
    step = 0
    for dtype in ("bf16", "fp32"):
        for do_expand in (False, True):
            outcome["before"] += _eager_step(rank, kbuf, rbuf, dtype, do_expand, False, seed + step)
            step += 1
    # Rank 5 stops here: every kernel it queued has run, and it never calls its kernels buffer again
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=group)
    if rank != STOPPED and not automatic:
        kbuf.mask_ranks([STOPPED])
    if automatic:
        started = time.monotonic()
        outcome["after"] += _eager_step(rank, kbuf, rbuf, "bf16", False, True, seed + step, transition=True)
        outcome["transition_s"] = time.monotonic() - started
        step += 1
    if rank != STOPPED:
        outcome["masked"] = kbuf.get_masked_ranks()
    for dtype in ("bf16", "fp32"):
        for do_expand in (False, True):
            for _ in range(2):
                outcome["after"] += _eager_step(rank, kbuf, rbuf, dtype, do_expand, True, seed + step)
                step += 1
    if rank != STOPPED:
        kbuf.barrier()  # the survivors' barrier leaves rank 5 out
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=group)
    kbuf.destroy()
    rbuf.destroy()
    return outcome


@pytest.mark.parametrize("mode", ["manual", "automatic"])
def test_eager_calls_go_on_without_a_stopped_rank_bitwise_equal_to_the_reference(mode: str):
    seed, automatic = _seed(), mode == "automatic"
    world = LoopbackWorld(NUM_RANKS)
    outcomes = world.run(_eager_rank, seed, automatic)
    world.close()
    num_after = 8 + automatic
    for rank, outcome in enumerate(outcomes):
        assert outcome["before"] == 4, (rank, seed, outcome)
        assert outcome["after"] == (0 if rank == STOPPED else num_after), (rank, seed, outcome)
        if rank != STOPPED:
            assert outcome["masked"] == [STOPPED], (rank, outcome)
    transition = ""
    if automatic:
        times = [o["transition_s"] for r, o in enumerate(outcomes) if r != STOPPED]
        transition = f"; the first call without it took {min(times):.2f}-{max(times):.2f} s (deadline 1 s)"
    print(f"\nrank masking ({mode}), eager, EP{NUM_RANKS}, seed {seed}: 4 calls on 8 ranks, then rank {STOPPED} "
          f"stopped and {num_after} calls on each of the 7 others, all bitwise equal to the reference{transition}")  # fmt: skip


def _graph_rank(rank: int, group: dist.ProcessGroup, seed: int, num_replays: int, automatic: bool) -> dict:
    from graphs import capture_collective
    from kernel_checks import check_dispatch, equal

    kbuf, rbuf = _buffers(group, automatic)
    dtype, do_expand = "bf16", True
    x, topk_idx, weights, bias = _inputs(rank, dtype, seed)
    static = {"x": x.clone(), "x2": x.clone(), "topk_idx": topk_idx.clone(), "weights": weights.clone(),
              "bias": bias.clone()}  # fmt: skip
    args = dict(num_experts=NUM_EXPERTS, do_expand=do_expand)
    fresh_args = dict(topk_weights=static["weights"], do_cpu_sync=False, **args)
    handle = kbuf.dispatch(static["x"], topk_idx=static["topk_idx"], **fresh_args)[3]
    static["y"] = torch.zeros((handle.num_expanded_tokens, HIDDEN), dtype=torch.bfloat16, device="cuda")

    def ops() -> tuple:
        fresh = kbuf.dispatch(static["x"], topk_idx=static["topk_idx"], **fresh_args)
        cached = kbuf.dispatch(static["x2"], handle=fresh[3], do_expand=do_expand)
        combined = kbuf.combine(static["y"], fresh[3], bias=static["bias"])
        return fresh, cached, combined

    graph, (fresh, cached, combined) = capture_collective(ops, group)

    outcome = {"before": 0, "after": 0}
    for replay in range(2 * num_replays):
        masked = replay >= num_replays
        if replay == num_replays:
            # Rank 5 stops replaying; the others mask it and replay the same graph
            torch.cuda.current_stream().synchronize()
            dist.barrier(group=group)
            if rank != STOPPED and not automatic:
                kbuf.mask_ranks([STOPPED])
        new_x, new_topk, new_w, new_bias = _inputs(rank, dtype, seed + 10 + replay)
        new_x2 = _inputs(rank, dtype, seed + 50 + replay)[0]
        routing = _masked_routing(rank, new_topk, masked)
        runs_kernels = not (masked and rank == STOPPED)
        if runs_kernels:
            for name, value in (("x", new_x), ("x2", new_x2), ("topk_idx", new_topk), ("weights", new_w),
                                ("bias", new_bias)):  # fmt: skip
                static[name].copy_(value)
        ref = rbuf.dispatch(new_x, topk_idx=routing, topk_weights=new_w, do_cpu_sync=False, **args)
        rows = _combine_rows(ref[3], do_expand, seed + replay, rank)
        ref_cached = rbuf.dispatch(new_x2, handle=ref[3], do_expand=do_expand)
        ref_combined = rbuf.combine(rows, ref[3], bias=new_bias)
        if not runs_kernels:
            continue
        static["y"].zero_()
        static["y"][: rows.shape[0]].copy_(rows)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        what = f"graph replay {replay} (masked={masked}) rank {rank}"
        # Automatic mode: the first replay without rank 5 is the one whose waits mask it
        transition = automatic and replay == num_replays
        check_dispatch(fresh, ref, do_expand, False, f"{what}, fresh dispatch", send_side=not transition)
        check_dispatch(cached, ref_cached, do_expand, False, f"{what}, cached dispatch", send_side=not transition)
        expected_dropped = 0 if transition else _num_dropped(new_topk, routing)
        assert int(fresh[3].num_masked_lanes[0]) == expected_dropped, what
        equal(combined[0], ref_combined[0], f"{what}, combined_x")
        outcome["after" if masked else "before"] += 1
    del graph
    torch.cuda.current_stream().synchronize()
    if rank != STOPPED:
        outcome["masked"] = kbuf.get_masked_ranks()
    dist.barrier(group=group)
    kbuf.destroy()
    rbuf.destroy()
    return outcome


@pytest.mark.parametrize("mode", ["manual", "automatic"])
def test_graph_replays_captured_before_a_rank_stopped_go_on_under_the_mask(mode: str):
    seed, num_replays = _seed(), 3
    world = LoopbackWorld(NUM_RANKS)
    outcomes = world.run(_graph_rank, seed, num_replays, mode == "automatic")
    world.close()
    for rank, outcome in enumerate(outcomes):
        assert outcome["before"] == num_replays, (rank, seed, outcome)
        assert outcome["after"] == (0 if rank == STOPPED else num_replays), (rank, seed, outcome)
        if rank != STOPPED:
            assert outcome["masked"] == [STOPPED], (rank, outcome)
    print(f"\nrank masking ({mode}), graphs, EP{NUM_RANKS}, seed {seed}: {num_replays} replays on 8 ranks, then rank {STOPPED} "
          f"stopped and {num_replays} replays of the same graph on the 7 others, bitwise equal to the reference")  # fmt: skip
