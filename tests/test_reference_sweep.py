"""Reference backend: dispatch, cached dispatch and combine against the brute-force oracle, over every option.

2 ranks run the full product of the main axes; 4 and 8 ranks run a seeded subset that covers every
value of every axis. Secondary options (hidden, experts, top-k, token counts, a rank with zero
tokens, column-major scales, multiple reduction, handle copy, stream paths) are drawn per case from
the shared seed. Each world size is spawned once; the cases loop inside the ranks. Hybrid mode runs
the subset on virtual nodes of CPU threads (2 x 4, 2 x 8, 4 x 4), against the oracle's node stage.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.fp8 import per_token_cast_to_fp8
from deep_ep.utils.routing import imbalanced_routing, uniform_routing
from deep_ep.utils.spawn import spawn_ranks

try:
    from oracle import Case, Routing, assert_bitwise, check_dispatch, expected_combine, gather_to_all
except ImportError:  # tests/ collected as a package
    from tests.oracle import Case, Routing, assert_bitwise, check_dispatch, expected_combine, gather_to_all

AXES: dict[str, tuple[Any, ...]] = {
    "expand": (False, True),
    "alignment": (1, 128),
    "fp8": ("none", "fp32", "ue8m0"),
    "bias": (0, 1, 2),
    "cpu_sync": (True, False),
    "cached": (False, True),
    "masked": (0.0, 0.2),
    "routing": ("uniform", "imbalanced"),
}
NUM_MAX_TOKENS = 64
MAX_HIDDEN = 320


def full_sweep() -> list[dict[str, Any]]:
    names = list(AXES)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*AXES.values())]


def covering_subset(seed: int, num_cases: int) -> list[dict[str, Any]]:
    """`num_cases` cases; axis values cycle from random offsets, so each value appears at least once."""
    rng = random.Random(seed)
    offsets = {name: rng.randrange(len(values)) for name, values in AXES.items()}
    cases = [
        {name: values[(i + offsets[name]) % len(values)] for name, values in AXES.items()} for i in range(num_cases)
    ]
    for case in cases[max(values_count for values_count in map(len, AXES.values())) :]:
        for name, values in AXES.items():
            case[name] = rng.choice(values)
    return cases


def make_x(kind: str, num_tokens: int, hidden: int, gen: torch.Generator, device: torch.device) -> Any:
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    if kind == "none":
        return x.to(device)
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=kind == "ue8m0")
    return data.to(device), scales.to(device)


def wide_bf16(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random BF16 values over a wide exponent range, so that FP32 sums are inexact and order-sensitive."""
    scale = torch.exp2(torch.randint(-20, 21, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)


def oracle_view(x: Any, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None) -> dict[str, Any]:
    data, scales = x if isinstance(x, tuple) else (x, None)
    return {"x": data, "scales": scales, "topk_idx": topk_idx, "topk_weights": topk_weights}


def call(buffer: deep_ep.ElasticBuffer, method: str, stream_path: str, **kwargs: Any) -> Any:
    """Call `method` through one of the stream paths (no-ops on CPU, real on GPUs)."""
    if stream_path == "previous_event":
        kwargs.update(previous_event=buffer.capture(), allocate_on_comm_stream=True)
    elif stream_path == "alloc_on_comm":
        kwargs.update(allocate_on_comm_stream=True)
    elif stream_path == "async":
        kwargs.update(async_with_compute_stream=True)
    values = getattr(buffer, method)(**kwargs)
    if stream_path == "async":
        values[-1].current_stream_wait()
    return values


def clone_inputs(*values: Any) -> list[Any]:
    out = []
    for v in values:
        if isinstance(v, tuple):
            out.append(tuple(t.clone() for t in v))
        else:
            out.append(v.clone() if isinstance(v, torch.Tensor) else v)
    return out


def assert_unchanged(before: list[Any], after: list[Any]) -> None:
    for b, a in zip(before, after, strict=True):
        for bt, at in zip(b if isinstance(b, tuple) else (b,), a if isinstance(a, tuple) else (a,), strict=True):
            if isinstance(bt, torch.Tensor):
                assert_bitwise(at, bt, "an input tensor was modified")


def run_case(buffers: dict[bool, deep_ep.ElasticBuffer], axes: dict[str, Any], seed: int, case_idx: int,
             group: dist.ProcessGroup, rank: int, num_ranks_per_node: int | None = None) -> None:  # fmt: skip
    """One case on `rank` of `group`, against the brute-force oracle; `num_ranks_per_node`: the
    buffers run hybrid mode across nodes of that many ranks (the combine's node stage)."""
    num_ranks = group.size()
    rng = random.Random(seed * 7919 + case_idx)  # the same on every rank
    gen = torch.Generator().manual_seed((seed * 1_000_003 + case_idx * 101 + rank) % (1 << 62))
    allow_multiple_reduction = rng.random() < 0.5
    buffer = buffers[allow_multiple_reduction]
    device = buffer.device
    num_experts = rng.choice([e for e in (8, 16, 32) if e % num_ranks == 0])
    num_topk = rng.randint(1, 4)
    hidden = rng.choice((128, 256, 320))
    call_max_tokens = rng.choice((None, 40))
    max_tokens = call_max_tokens or NUM_MAX_TOKENS
    num_tokens_all = [rng.randint(1, max_tokens) for _ in range(num_ranks)]
    if rng.random() < 0.15:
        num_tokens_all[rng.randrange(num_ranks)] = 0
    if rng.random() < 0.1:
        num_tokens_all[rng.randrange(num_ranks)] = max_tokens
    num_tokens = num_tokens_all[rank]
    col_major = rng.random() < 0.4
    do_handle_copy = rng.random() < 0.7
    with_weights = rng.random() < 0.85
    with_stats = rng.random() < 0.5
    zero_padding = axes["expand"] and rng.random() < 0.5
    stream_paths = ("plain", "async", "previous_event", "alloc_on_comm")
    dispatch_path, cached_path, combine_path = (rng.choice(stream_paths) for _ in range(3))
    cached_kind = axes["fp8"] if rng.random() < 0.7 else rng.choice(AXES["fp8"])
    cached_weights = rng.random() < 0.7
    hot_rank = rng.randrange(num_ranks)
    num_local = num_experts // num_ranks

    if axes["routing"] == "uniform":
        topk_idx, topk_weights = uniform_routing(num_tokens, num_experts, num_topk, axes["masked"], gen)
    else:
        topk_idx, topk_weights = imbalanced_routing(
            num_tokens, num_experts, num_topk, num_ranks, hot_rank, 0.7, axes["masked"], gen
        )
    topk_idx, topk_weights = topk_idx.to(device), topk_weights.to(device) if with_weights else None
    x = make_x(axes["fp8"], num_tokens, hidden, gen, device)
    stats = torch.randint(1, 100, (num_local,), dtype=torch.int32, generator=gen).to(device) if with_stats else None
    stats_before = stats.clone() if with_stats else None
    before = clone_inputs(x, topk_idx, topk_weights)
    case = Case(
        rank=rank, num_ranks=num_ranks, num_experts=num_experts, num_topk=num_topk, hidden=hidden,
        num_max_tokens_per_rank=max_tokens, expert_alignment=axes["alignment"], do_expand=axes["expand"],
        do_cpu_sync=axes["cpu_sync"], do_zero_padding=zero_padding, col_major=col_major,
    )  # fmt: skip

    # Dispatch
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = call(
        buffer, "dispatch", dispatch_path, x=x, topk_idx=topk_idx, topk_weights=topk_weights,
        cumulative_local_expert_recv_stats=stats, num_experts=num_experts,
        num_max_tokens_per_rank=call_max_tokens, expert_alignment=axes["alignment"],
        do_handle_copy=do_handle_copy, do_cpu_sync=axes["cpu_sync"], do_expand=axes["expand"],
        do_zero_padding=zero_padding, use_tma_aligned_col_major_sf=col_major,
    )  # fmt: skip
    inputs = gather_to_all(oracle_view(x, topk_idx, topk_weights), group)
    routing = Routing([inp["topk_idx"].tolist() for inp in inputs], num_experts, num_ranks, axes["alignment"])
    check_dispatch(case, routing, inputs, recv_x, recv_topk_idx, recv_topk_weights, handle)
    assert_unchanged(before, [x, topk_idx, topk_weights])
    if do_handle_copy:
        assert handle.topk_idx is not topk_idx
        assert num_tokens == 0 or handle.topk_idx.data_ptr() != topk_idx.data_ptr()
        assert torch.equal(handle.topk_idx, topk_idx)
    else:
        assert handle.topk_idx is topk_idx

    # Cached dispatch: new data, same routing, same shapes
    num_dispatches = 1
    if axes["cached"]:
        x2 = make_x(cached_kind, num_tokens, hidden, gen, device)
        weights2 = torch.rand((num_tokens, num_topk), generator=gen).to(device) if cached_weights else None
        shapes = (handle.num_recv_tokens, handle.num_expanded_tokens)
        recv_x2, recv_topk_idx2, recv_topk_weights2, handle2, _ = call(
            buffer, "dispatch", cached_path, x=x2, topk_weights=weights2, handle=handle,
            cumulative_local_expert_recv_stats=stats, do_expand=axes["expand"],
            do_zero_padding=zero_padding, use_tma_aligned_col_major_sf=col_major,
        )  # fmt: skip
        assert handle2 is handle
        num_dispatches += 1
        inputs2 = gather_to_all(oracle_view(x2, None, weights2), group)
        check_dispatch(case, routing, inputs2, recv_x2, recv_topk_idx2, recv_topk_weights2, handle2, shapes_of=shapes)
    if with_stats:
        counts = torch.tensor(routing.counts[rank], dtype=torch.int32)
        assert_bitwise(stats, (stats_before.cpu() + num_dispatches * counts).to(device), "cumulative stats")

    # Combine
    num_rows = handle.num_expanded_tokens if axes["expand"] else handle.num_recv_tokens
    comb_x = wide_bf16((num_rows, hidden), gen, device)
    comb_weights = None
    if rng.random() < 0.8:
        shape = (num_rows,) if axes["expand"] else (num_rows, num_topk)
        comb_weights = torch.randn(shape, generator=gen).to(device)
    biases = [wide_bf16((num_tokens, hidden), gen, device) for _ in range(axes["bias"])]
    bias = None if not biases else biases[0] if len(biases) == 1 else tuple(biases)
    comb_before = clone_inputs(comb_x, comb_weights, *biases)
    combined_x, combined_weights, _ = call(
        buffer, "combine", combine_path, x=comb_x, handle=handle, topk_weights=comb_weights, bias=bias
    )
    assert_unchanged(comb_before, [comb_x, comb_weights, *biases])
    comb_inputs = gather_to_all({"x": comb_x, "topk_weights": comb_weights}, group)
    expected_x, expected_weights = expected_combine(
        rank,
        routing,
        comb_inputs,
        axes["expand"],
        allow_multiple_reduction,
        [b.cpu() for b in biases],
        hidden,
        num_topk,
        num_ranks_per_node,
    )
    assert_bitwise(combined_x, expected_x, "combined_x")
    if comb_weights is None:
        assert combined_weights is None
    else:
        assert_bitwise(combined_weights, expected_weights, "combined_topk_weights")


def make_buffers(group: dist.ProcessGroup) -> dict[bool, deep_ep.ElasticBuffer]:
    common = dict(num_max_tokens_per_rank=NUM_MAX_TOKENS, hidden=MAX_HIDDEN, num_topk=4, backend="reference")
    return {
        True: deep_ep.ElasticBuffer(group, allow_multiple_reduction=True, deterministic=True, **common),
        False: deep_ep.ElasticBuffer(group, allow_multiple_reduction=False, use_fp8_dispatch=True, **common),
    }


def sweep_worker(rank: int, num_ranks: int, seed: int, num_cases: int | None) -> int:
    """Run the sweep on one rank (`num_cases=None`: the full product)."""
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank)
    buffers = make_buffers(dist.group.WORLD)
    cases = full_sweep() if num_cases is None else covering_subset(seed, num_cases)
    for case_idx, axes in enumerate(cases):
        try:
            run_case(buffers, axes, seed, case_idx, dist.group.WORLD, rank)
        except Exception as error:
            raise AssertionError(f"seed={seed} case {case_idx} {axes}: {error}") from error
    for buffer in buffers.values():
        buffer.barrier()
    return len(cases)


def hybrid_worker(rank: int, group: dist.ProcessGroup, seed: int, num_cases: int, num_ranks_per_node: int) -> int:
    """The subset on one virtual rank of a world of virtual nodes, the buffers in hybrid mode."""
    buffers = make_buffers(group)
    num_nodes = group.size() // num_ranks_per_node
    for buffer in buffers.values():
        assert buffer.get_logical_domain_size() == (num_nodes, num_ranks_per_node), buffer.get_logical_domain_size()
    for case_idx, axes in enumerate(covering_subset(seed, num_cases)):
        try:
            run_case(buffers, axes, seed, case_idx, group, rank, num_ranks_per_node)
        except Exception as error:
            raise AssertionError(
                f"seed={seed} {num_nodes}x{num_ranks_per_node} case {case_idx} {axes}: {error}"
            ) from error
    return num_cases


def fresh_seed() -> int:
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"seed={seed}")
    return seed


def test_sweep_2_ranks() -> None:
    num_cases = len(full_sweep())
    assert spawn_ranks(sweep_worker, 2, args=(fresh_seed(), None), timeout_s=600) == [num_cases] * 2


@pytest.mark.parametrize("num_ranks,num_cases", [(4, 16), (8, 8)])
def test_sweep_subset(num_ranks: int, num_cases: int) -> None:
    seed = fresh_seed()
    cases = covering_subset(seed, num_cases)
    for name, values in AXES.items():
        assert {c[name] for c in cases} == set(values), f"subset misses a value of {name}"
    assert spawn_ranks(sweep_worker, num_ranks, args=(seed, num_cases), timeout_s=600) == [num_cases] * num_ranks


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_sweep_2_gpus_nccl() -> None:
    num_cases = len(full_sweep())
    assert spawn_ranks(sweep_worker, 2, backend="nccl", args=(fresh_seed(), None), timeout_s=600) == [num_cases] * 2


@pytest.mark.parametrize("num_nodes,num_ranks_per_node,num_cases", [(2, 4, 8), (2, 8, 4), (4, 4, 4)])
def test_hybrid_sweep_on_virtual_nodes(num_nodes: int, num_ranks_per_node: int, num_cases: int) -> None:
    """Hybrid mode (the combine reduces each node's rows first) on the node shapes the kernels' hybrid
    sweep will use (issue 17), CPU threads as virtual nodes: the oracle those kernels are checked
    against, checked itself over the sweep's options."""
    seed = fresh_seed()
    world = LoopbackWorld(num_nodes * num_ranks_per_node, device="cpu", num_ranks_per_node=num_ranks_per_node)
    try:
        assert world.run(hybrid_worker, seed, num_cases, num_ranks_per_node) == [num_cases] * world.num_ranks
    finally:
        world.close()
