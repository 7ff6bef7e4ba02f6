"""Where one rank's host time goes, in wall time (a diagnostic, GPUs only): the main steps of
dispatch and combine are wrapped in perf_counter timers, and each step's inclusive microseconds per
call are printed. cProfile (`deep-ep bench --host --profile`) charges every Python call a fixed
cost, so it overstates code that makes many small calls; this does not, but it sees only the steps
wrapped here, and each wrapper adds well under a microsecond. `--no-wrap` times the calls alone.

    python3 bench/host_sections.py [--tokens 128] [--iters 200] [--no-wrap] [--json FILE]

One virtual rank (the numbers of `deep-ep bench --host --ranks 1`), FP8, hidden 7168, 256 experts,
top-8. Run from `bench/` (or with the checkout on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import time

import torch

import deep_ep.loopback  # (the CUDA settings of virtual ranks, before CUDA starts)
from deep_ep.bench.report import git_commit, hardware_name, utc_now

ACC: dict[str, int] = collections.defaultdict(int)
CNT: dict[str, int] = collections.defaultdict(int)
ACTIVE = [False]  # sections count only inside the timed call (not in the barrier between calls)


def wrap(name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        started = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            if ACTIVE[0]:
                ACC[name] += time.perf_counter_ns() - started
                CNT[name] += 1

    return timed


def patch(owner: object, attr: str, name: str) -> None:
    setattr(owner, attr, wrap(name, getattr(owner, attr)))


def install() -> None:
    from deep_ep.jit import kernel as jk

    import deep_ep.backends.kernels.backend as kb
    import deep_ep.backends.kernels.dispatch as kd
    import deep_ep.backends.kernels.runtime as kr
    import deep_ep.buffer as fb
    import deep_ep.event as ev

    # (owner, attribute, section name): the facade, the stream scope, the backend, the launch
    # sequence, the runtime's checks and waits, the JIT's launch and torch's allocations
    sections = [
        (fb, "validate_dispatch", "validate_dispatch"), (fb, "validate_combine", "validate_combine"),
        (fb, "EPHandle", "EPHandle()"), (fb.ElasticBuffer, "_checked", "facade._checked"),
        (fb.ElasticBuffer, "_communicate", "facade._communicate"), (ev.CommStreamScope, "__init__", "scope.enter"),
        (ev.CommStreamScope, "finish", "scope.finish"), (kb.NvlinkBackend, "dispatch", "backend.dispatch"),
        (kb.NvlinkBackend, "combine", "backend.combine"), (kb, "run_dispatch", "run_dispatch"),
        (kb, "run_combine", "run_combine"), (kd, "_dispatch_outputs", "_dispatch_outputs"),
        (kd, "_launch_dispatch_epilogue", "_launch_dispatch_epilogue"),
        (kr.NvlinkRuntime, "check_error", "runtime.check_error"),
        (kr.NvlinkRuntime, "take_input_error", "runtime.take_input_error"),
        (kr.NvlinkRuntime, "wait_counts", "runtime.wait_counts"), (jk.Kernel, "launch", "Kernel.launch"),
        (torch, "empty", "torch.empty"), (torch.Tensor, "record_stream", "record_stream"),
        (torch.Tensor, "clone", "clone"),
    ]  # fmt: skip
    for owner, attr, name in sections:
        patch(owner, attr, name)


def rank_fn(rank: int, group: object, args: argparse.Namespace) -> dict:
    from deep_ep.bench.cases import BenchCase, make_inputs, random_rows
    from deep_ep.host_reads import wait_for_stream

    case = BenchCase(num_tokens=args.tokens, hidden=7168, num_topk=8, num_experts=256, fp8_dispatch=True)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                                   num_topk=case.num_topk, use_fp8_dispatch=True, explicitly_destroy=True)  # fmt: skip
    x, topk_idx, weights = make_inputs(case, rank, group.size(), "cuda", 1234, 0.0)
    routed = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=256, num_max_tokens_per_rank=args.tokens)
    handle = buffer.dispatch(x, **routed)[3]
    rows = random_rows(args.tokens, case.hidden, "cuda", 7)[: handle.num_recv_tokens]
    calls = {
        "dispatch_no_sync": lambda: buffer.dispatch(x, do_cpu_sync=False, **routed),
        "dispatch_cpu_sync": lambda: buffer.dispatch(x, **routed),
        "cached_dispatch": lambda: buffer.dispatch(x, handle=handle),
        "combine": lambda: buffer.combine(rows, handle),
    }
    results = {}
    for op, call in calls.items():
        for _ in range(20):
            call()
        wait_for_stream()
        walls = []
        ACC.clear()
        CNT.clear()
        for _ in range(args.iters):
            buffer.barrier()
            wait_for_stream()
            ACTIVE[0] = True
            started = time.perf_counter_ns()
            call()
            walls.append(time.perf_counter_ns() - started)
            ACTIVE[0] = False
        wait_for_stream()
        sections = {k: (ACC[k] / args.iters / 1e3, CNT[k] / args.iters) for k in sorted(ACC, key=lambda k: -ACC[k])}
        results[op] = dict(wall_us=statistics.median(walls) / 1e3, mean_us=statistics.mean(walls) / 1e3,
                           sections=sections)  # fmt: skip
        print(f"{op}: median {results[op]['wall_us']:.1f} us, mean {results[op]['mean_us']:.1f} us")
        for k, (us, n) in sections.items():
            print(f"    {k:<28} {us:8.1f} us  x{n:g}")
    buffer.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--no-wrap", action="store_true")
    args = parser.parse_args()
    if not args.no_wrap:
        install()
    world = deep_ep.loopback.LoopbackWorld(1)
    out = world.run(rank_fn, args)[0]
    if args.json:
        document = dict(commit=git_commit(), command=" ".join(["python3", *sys.argv]), date=utc_now(),
                        hardware=hardware_name("cuda", 1, virtual_ranks=True), wrapped=not args.no_wrap,
                        num_tokens=args.tokens, num_iters=args.iters, results=out)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
