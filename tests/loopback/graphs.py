"""CUDA-graph capture and replay of a fresh dispatch without CPU sync, a cached dispatch and a combine,
every replay checked against `deep_ep.reference` (the rank functions of the virtual-rank and
virtual-node GPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def capture_collective(ops: Callable[[], Any], group: dist.ProcessGroup) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`ops()` captured in a CUDA graph on every rank of `group` (collective): the graph and what the
    captured call returned. A warm-up call outside capture loads every kernel first."""
    ops()
    # Every rank has enqueued all it will before capture begins, which synchronizes the device
    dist.barrier(group=group)
    torch.cuda.current_stream().synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
        outputs = ops()
    # Capturing allocates the graph's memory (a cudaMalloc can wait for the device): no replay may run
    # (and wait for a peer) before every rank has captured
    dist.barrier(group=group)
    return graph, outputs


def graph_case(rank: int, group: dist.ProcessGroup, kbuf, rbuf, dtype: str, do_expand: bool, seed: int,
                num_replays: int) -> int:  # fmt: skip
    """Capture a fresh dispatch without CPU sync, a cached dispatch and a combine in one graph; replay
    it with new data and new routing, each replay checked against the reference."""
    from kernel_checks import check_dispatch, equal, make_inputs
    from sweep import wide_bf16

    num_ranks = group.size()
    hidden, num_topk, num_experts, num_tokens = 2560, 8, 8 * num_ranks, 96

    def inputs(s: int) -> tuple:
        return make_inputs(rank, num_ranks, num_tokens, hidden, dtype, num_experts, num_topk, "uniform", 0.1, 1, s,
                           "cuda")  # fmt: skip

    def clone(value):
        return tuple(t.clone() for t in value) if isinstance(value, tuple) else value.clone()

    def assign(dst, src) -> None:
        for d, v in zip(
            dst if isinstance(dst, tuple) else (dst,), src if isinstance(src, tuple) else (src,), strict=True
        ):
            d.copy_(v)

    x, topk_idx, weights, bias = inputs(seed)
    static_x, static_x2, static_topk, static_w, static_bias = (
        clone(x),
        clone(x),
        topk_idx.clone(),
        weights.clone(),
        bias.clone(),
    )
    args = dict(num_experts=num_experts, do_expand=do_expand)
    handle_k = kbuf.dispatch(static_x, topk_idx=static_topk, topk_weights=static_w, do_cpu_sync=False, **args)[3]
    handle_r = rbuf.dispatch(static_x, topk_idx=static_topk, topk_weights=static_w, do_cpu_sync=False, **args)[3]
    rows = handle_k.num_expanded_tokens if do_expand else handle_k.num_recv_tokens
    static_y = torch.zeros((rows, hidden), dtype=torch.bfloat16, device="cuda")

    def ops() -> tuple:
        fresh = kbuf.dispatch(static_x, topk_idx=static_topk, topk_weights=static_w, do_cpu_sync=False, **args)
        cached = kbuf.dispatch(static_x2, handle=handle_k, do_expand=do_expand)
        combined = kbuf.combine(static_y, fresh[3], bias=static_bias)
        return fresh, cached, combined

    graph, (fresh, cached, combined) = capture_collective(ops, group)
    for replay in range(num_replays):
        new_x, new_topk, new_w, new_bias = inputs(seed + 10 + replay)
        new_x2 = inputs(seed + 50 + replay)[0]
        new_y = wide_bf16((rows, hidden), torch.Generator().manual_seed(seed + 100 * replay + rank), "cuda")
        for dst, src in ((static_x, new_x), (static_x2, new_x2), (static_topk, new_topk), (static_w, new_w),
                         (static_bias, new_bias), (static_y, new_y)):  # fmt: skip
            assign(dst, src)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        ref = rbuf.dispatch(new_x, topk_idx=new_topk, topk_weights=new_w, do_cpu_sync=False, **args)
        check_dispatch(fresh, ref, do_expand, False, f"{dtype} graph replay {replay}, fresh dispatch")
        ref_cached = rbuf.dispatch(new_x2, handle=handle_r, do_expand=do_expand)
        check_dispatch(cached, ref_cached, do_expand, False, f"{dtype} graph replay {replay}, cached dispatch")
        equal(combined[0], rbuf.combine(new_y, ref[3], bias=new_bias)[0], f"{dtype} graph replay {replay}, combined_x")
    del graph
    return num_replays


def graph_rank(rank: int, group: dist.ProcessGroup, seed: int, num_replays: int, **buffer_kwargs: Any) -> int:
    import deep_ep

    def make(backend: str):
        return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2560, num_topk=8, backend=backend,
                                     explicitly_destroy=True, **buffer_kwargs)  # fmt: skip

    kbuf, rbuf = make("kernels"), make("reference")
    checked = sum(graph_case(rank, group, kbuf, rbuf, dtype, do_expand, seed, num_replays)
                  for dtype in ("bf16", "fp32") for do_expand in (False, True))  # fmt: skip
    kbuf.destroy()
    rbuf.destroy()
    return checked
