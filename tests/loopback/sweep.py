"""The random configurations of the virtual-rank kernel sweep, and one rank's run of them.

Every rank draws the same case list from the seed (options, shapes, sizes); the data and the token
count of each rank are its own. Each case runs dispatch (fresh, then optionally cached) and combine
on a kernels buffer and on a reference buffer of the same group, and compares every output as raw
bytes. `kernel_specs(num_ranks)` lists the kernels a world size can use, so the CPU tests compile
exactly those.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from kernel_checks import RAW_KINDS, check_dispatch, equal, make_inputs, row_bytes

# Per world size: (hidden, top-k, dispatch dtypes). Between them every top-k in {1, 6, 8, 9}, every
# hidden in {2560, 4096, 7168} and hidden sizes of an odd number of 16-byte vectors (2056 BF16,
# 2064 FP8) run, with every dtype where it is valid; the raw kinds (any dtype as bytes, 1x32 scale
# packs, column-major scales) at 3 and 4 ranks.
ALL = ("bf16", "fp32", "ue8m0")
SHAPES = {
    2: ((7168, 8, ALL), (2056, 1, ("bf16",)), (2064, 9, ("fp32", "ue8m0"))),
    3: ((4096, 6, ALL + RAW_KINDS), (2560, 9, ALL)),
    4: ((7168, 8, ALL), (2064, 6, (*ALL, "e5m2"))),
    8: ((4096, 9, ALL), (2560, 8, ALL)),
    16: ((2560, 8, ALL), (7168, 6, ALL), (4096, 1, ("bf16",))),
}
LOCAL_EXPERTS = (1, 2, 3, 8, 16, 64)
MAX_HIDDEN, MAX_TOPK = 7168, 9
# Virtual nodes (the kernels across nodes, through the emulated NIC): one shape per world size, so that
# CI builds every kernel of both NIC modes in its time; between them every dtype, top-k 8 and 9, and
# both combine layouts with and without multiple reduction (the graph, stall and mistake tests of
# virtual nodes use the 8-rank shape)
NODE_SHAPES = {8: ((2560, 8, ALL),), 16: ((4096, 9, ALL),)}
NODE_LOCAL_EXPERTS = (1, 2, 8, 64)


def num_max_tokens(num_ranks: int) -> int:
    return 256 if num_ranks >= 8 else 512


def kernel_specs(num_ranks: int, transport: str = "lsa", shapes: dict = SHAPES,
                 local_experts: tuple[int, ...] = LOCAL_EXPERTS, hybrid: bool = False) -> list:  # fmt: skip
    """Every kernel specialisation the sweep of `num_ranks` ranks over `transport` can launch (its
    `shapes` and `local_experts`: `NODE_SHAPES` and `NODE_LOCAL_EXPERTS` across virtual nodes), with
    `hybrid` also hybrid mode's dispatches."""
    from deep_ep.backends.kernels import specs as kernels

    specs = [kernels.barrier_spec(num_ranks, transport), kernels.post_fault_spec(transport)]
    for hidden, num_topk, dtypes in shapes[num_ranks]:
        for dtype in dtypes:
            args = (num_ranks, *row_bytes(dtype, hidden), num_topk)
            specs += [kernels.dispatch_spec(*args, cached, False, transport) for cached in (False, True)]
            if hybrid:
                specs += [
                    kernels.dispatch_spec(*args, cached, False, f"hybrid-{transport}") for cached in (False, True)
                ]
            specs.append(kernels.dispatch_expand_rank_spec(*args, False, transport))
            specs += [kernels.dispatch_epilogue_spec(*args, expand, False, transport) for expand in (False, True)]
        rows = {(1, False), (1, True)} | {(min(num_topk, local), True) for local in local_experts}
        for num_rows, expand in sorted(rows):
            specs.append(kernels.combine_spec(num_ranks, hidden, num_topk, num_rows, expand, False, transport))
            specs.append(kernels.combine_epilogue_spec(num_ranks, hidden, num_topk, num_rows, False, transport))
        if hybrid:  # one row per holder: the forwarders' partials and the node stage
            specs += [kernels.combine_spec(num_ranks, hidden, num_topk, 1, expand, False, f"hybrid-{transport}")
                      for expand in (False, True)]  # fmt: skip
            specs.append(kernels.combine_epilogue_spec(num_ranks, hidden, num_topk, 1, False, f"hybrid-{transport}"))
    return list(dict.fromkeys(specs))


def make_cases(num_ranks: int, num_cases: int, seed: int, shapes: dict = SHAPES,
               local_experts: tuple[int, ...] = LOCAL_EXPERTS) -> list[dict[str, Any]]:  # fmt: skip
    """`num_cases` configurations for `num_ranks` ranks (of `shapes`, with `local_experts` experts per
    rank); the first few pin the corners (zero tokens everywhere, every lane -1, all to one rank, the
    largest local expert count)."""
    rng = random.Random(seed * 1009 + num_ranks)
    cases = []
    for i in range(num_cases):
        hidden, num_topk, dtypes = rng.choice(shapes[num_ranks])
        local = rng.choice([e for e in local_experts if e * num_ranks >= num_topk])
        expand = rng.random() < 0.5
        case = dict(
            index=i, hidden=hidden, num_topk=num_topk, dtype=rng.choice(dtypes), num_local_experts=local,
            routing=rng.choices(("uniform", "hot", "one", "none"), (70, 18, 6, 6))[0],
            masked=rng.choice((0.0, 0.0, 0.25)), max_tokens=rng.choice((num_max_tokens(num_ranks), 96, 300)),
            zero_rank=rng.random() < 0.15, full_rank=rng.random() < 0.1, weights=rng.random() < 0.8,
            stats=rng.random() < 0.3, alignment=rng.choice((1, 128)), expand=expand,
            zero_padding=expand and rng.random() < 0.5, cpu_sync=rng.random() < 0.6, cached=rng.random() < 0.4,
            handle_copy=rng.random() < 0.8, call_max_tokens=rng.random() < 0.3, num_bias=rng.choice((0, 1, 2)),
            multiple_reduction=rng.random() < 0.5, num_sms=rng.choice((0, 2, 4, 8, 24)),
            combine_num_sms=rng.choice((0, 3, 6, 16)), stream=rng.choice(("plain", "plain", "async", "previous",
                                                                         "on_comm", "before_epilogue")),
            col_major=rng.random() < 0.5, cached_weights=rng.random() < 0.7,
        )  # fmt: skip
        cases.append(case)
    # Corners first: no tokens anywhere; every lane -1; every token to one rank; the most experts per
    # rank; a row per lane with the fewest experts per rank (one row per holder comes back, yet hybrid
    # mode has no node stage there: its epilogue must not be picked)
    fewest = min(e for e in local_experts if e * num_ranks >= max(shape[1] for shape in shapes[num_ranks]))
    corners = [
        dict(zero_all=True),
        dict(routing="none"),
        dict(routing="one"),
        dict(num_local_experts=max(local_experts)),
        dict(num_local_experts=fewest, expand=True, zero_padding=False, multiple_reduction=False),
    ]
    for case, corner in zip(cases, corners, strict=False):
        case.update(corner)
    # Half the cases run twice with the same inputs: the second call of a shape takes the steady path
    # (deep_ep.backends.kernels.steady) where it can. Its own generator leaves the draws above as they were
    replays = random.Random(seed * 2003 + num_ranks)
    for case in cases:
        case["max_tokens"] = min(case["max_tokens"], num_max_tokens(num_ranks))
        case.setdefault("zero_all", False)
        case["replay"] = replays.random() < 0.5
    return cases


def _stream_kwargs(buffer: Any, stream: str) -> dict[str, Any]:
    import deep_ep

    if stream == "async":
        return dict(async_with_compute_stream=True)
    if stream == "previous":
        return dict(previous_event=deep_ep.ElasticBuffer.capture(), allocate_on_comm_stream=True)
    if stream == "on_comm":
        return dict(allocate_on_comm_stream=True)
    if stream == "before_epilogue":
        return dict(previous_event_before_epilogue=deep_ep.ElasticBuffer.capture())
    return {}


def _call(buffer: Any, method: str, stream: str, *args: Any, **kwargs: Any) -> Any:
    values = getattr(buffer, method)(*args, **kwargs, **_stream_kwargs(buffer, stream))
    if stream == "async":
        values[-1].current_stream_wait()
    return values


def wide_bf16(shape: tuple[int, ...], gen: torch.Generator, device: Any) -> torch.Tensor:
    """Random BF16 values over a wide exponent range (FP32 sums inexact, so order-sensitive)."""
    scale = torch.exp2(torch.randint(-12, 13, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)


def _snapshot(*values: Any) -> list[torch.Tensor]:
    flat = []
    for value in values:
        for t in value if isinstance(value, tuple) else (value,):
            if isinstance(t, torch.Tensor):
                flat.append((t, t.clone()))
    return flat


def _raise_device_failure(kernels_buf: Any) -> None:
    """Raise the kernels buffer's device failure, if any, before its outputs are compared: an epilogue
    that stopped at a fault (its own or a peer's) leaves its outputs unwritten, and the failure
    explains that difference best."""
    torch.cuda.current_stream().synchronize()
    kernels_buf.backend.runtime.check_error()


def run_case(buffers: dict, rank: int, num_ranks: int, case: dict[str, Any], seed: int) -> None:
    """One case on one rank: kernels and reference, compared bitwise (raises `AssertionError`); twice
    with `case["replay"]`."""
    for _ in range(2 if case.get("replay") else 1):
        _run_case_once(buffers, rank, num_ranks, case, seed)


def _run_case_once(buffers: dict, rank: int, num_ranks: int, case: dict[str, Any], seed: int) -> None:
    rng = random.Random(seed * 7919 + case["index"] * 31 + rank)
    num_tokens = 0 if case["zero_all"] else rng.randint(1, case["max_tokens"])
    if case.get("num_tokens") is not None:  # a fixed shape, for calls that must repeat it
        num_tokens = case["num_tokens"]
    if case["zero_rank"] and rank == case["index"] % num_ranks:
        num_tokens = 0
    if case["full_rank"] and rank == (case["index"] + 1) % num_ranks:
        num_tokens = case["max_tokens"]
    num_experts = case["num_local_experts"] * num_ranks
    kernels_buf, reference_buf = buffers[case["multiple_reduction"]]
    device = kernels_buf.device
    x, topk_idx, weights, bias = make_inputs(rank, num_ranks, num_tokens, case["hidden"], case["dtype"], num_experts,
                                             case["num_topk"], case["routing"], case["masked"], case["num_bias"],
                                             seed + case["index"], device)  # fmt: skip
    weights = weights if case["weights"] else None
    before = _snapshot(x, topk_idx, weights, bias)
    stats = None
    if case["stats"]:
        first = torch.randint(0, 50, (case["num_local_experts"],), dtype=torch.int32, device=device)
        stats = {"kernels": first, "reference": first.clone()}
    start = {b: s.clone() for b, s in stats.items()} if stats else None
    kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts,
                  expert_alignment=case["alignment"], do_cpu_sync=case["cpu_sync"], do_expand=case["expand"],
                  do_zero_padding=case["zero_padding"], use_tma_aligned_col_major_sf=case["col_major"] and row_bytes(case["dtype"], 1)[1] > 0,
                  do_handle_copy=case["handle_copy"])  # fmt: skip
    if case["call_max_tokens"]:
        kwargs["num_max_tokens_per_rank"] = case["max_tokens"]
    out_k = _call(kernels_buf, "dispatch", case["stream"], x, num_sms=case["num_sms"], cumulative_local_expert_recv_stats=None if stats is None else stats["kernels"], **kwargs)  # fmt: skip
    out_r = _call(reference_buf, "dispatch", case["stream"], x, cumulative_local_expert_recv_stats=None if stats is None else stats["reference"], **kwargs)  # fmt: skip
    _raise_device_failure(kernels_buf)
    handle = check_dispatch(out_k, out_r, case["expand"], case["zero_padding"], "fresh dispatch")
    # The handle's own copy of the routing (the dispatch kernel's), or the caller's tensor itself
    equal(handle.topk_idx, topk_idx, "handle.topk_idx")
    assert (handle.topk_idx.data_ptr() != topk_idx.data_ptr()) == (case["handle_copy"] and num_tokens > 0), case
    if stats:
        equal(stats["kernels"] - start["kernels"], handle.num_unaligned_recv_tokens_per_expert, "stats increment")
        equal(stats["kernels"], stats["reference"], "stats")

    gen = torch.Generator().manual_seed(seed * 13 + case["index"] * 7 + rank)
    if case["cached"]:
        x2 = make_inputs(rank, num_ranks, num_tokens, case["hidden"], case["dtype"], num_experts, case["num_topk"],
                         case["routing"], case["masked"], 0, seed + 1000 + case["index"], device)[0]  # fmt: skip
        cached_kwargs = dict(do_expand=case["expand"], do_zero_padding=case["zero_padding"],
                             use_tma_aligned_col_major_sf=kwargs["use_tma_aligned_col_major_sf"],
                             topk_weights=weights if case["cached_weights"] else None)  # fmt: skip
        cached_k = _call(kernels_buf, "dispatch", case["stream"], x2, handle=out_k[3], num_sms=case["combine_num_sms"], **cached_kwargs)  # fmt: skip
        cached_r = _call(reference_buf, "dispatch", case["stream"], x2, handle=out_r[3], **cached_kwargs)
        _raise_device_failure(kernels_buf)
        check_dispatch(cached_k, cached_r, case["expand"], case["zero_padding"], "cached dispatch")

    num_rows = handle.num_expanded_tokens if case["expand"] else handle.num_recv_tokens
    y = wide_bf16((num_rows, case["hidden"]), gen, device)
    y_weights = torch.rand((num_rows,) if case["expand"] else (num_rows, case["num_topk"]), generator=gen).to(device)
    y_weights = y_weights if case["weights"] else None
    comb_k = _call(kernels_buf, "combine", case["stream"], y, out_k[3], topk_weights=y_weights, bias=bias,
                   num_sms=case["combine_num_sms"])  # fmt: skip
    comb_r = _call(reference_buf, "combine", case["stream"], y, out_r[3], topk_weights=y_weights, bias=bias)
    _raise_device_failure(kernels_buf)
    equal(comb_k[0], comb_r[0], "combined_x")
    equal(comb_k[1], comb_r[1], "combined_topk_weights")
    for tensor, copy in before:
        equal(tensor, copy, "an input tensor (it was modified)")


def make_buffers(group: Any, num_ranks: int, timeout_s: int = 30, backends: tuple[str, str] = ("kernels", "reference"),
                 max_tokens: int | None = None, hybrid: bool = False) -> dict:  # fmt: skip
    """Per `allow_multiple_reduction`: a buffer of `group` for each of `backends` (the one under test,
    then the one it is compared with; on CPU virtual ranks both can only be the reference), sized for
    `max_tokens` per rank (default `num_max_tokens(num_ranks)`), in hybrid mode across the nodes of a
    virtual-node world with `hybrid`, else in direct mode."""
    import deep_ep

    max_tokens = max_tokens or num_max_tokens(num_ranks)
    buffers = {}
    for multiple_reduction in (True, False):
        pair = tuple(
            deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max_tokens, hidden=MAX_HIDDEN,
                                  num_topk=MAX_TOPK, use_fp8_dispatch=False, allow_multiple_reduction=multiple_reduction,
                                  allow_hybrid_mode=hybrid, backend=backend, explicitly_destroy=True,
                                  num_gpu_timeout_secs=timeout_s)
            for backend in backends
        )  # fmt: skip
        assert tuple(b.backend.name for b in pair) == tuple(backends), (pair, backends)
        buffers[multiple_reduction] = pair
    return buffers


def sweep_rank(rank: int, group: Any, cases: list[dict[str, Any]], seed: int, hybrid: bool = False) -> int:
    """Every case on one rank (the same list on every rank), in hybrid mode with `hybrid`; returns the
    number of cases."""
    buffers = make_buffers(group, group.size(), hybrid=hybrid)
    try:
        for case in cases:
            try:
                run_case(buffers, rank, group.size(), case, seed)
            except Exception as error:
                raise AssertionError(f"{group.size()} ranks, rank {rank}, seed {seed}, case {case}: {error}") from error
    finally:
        for pair in buffers.values():
            for buffer in pair:
                buffer.destroy()
    return len(cases)
