"""Before/after timing of the expanded layout on virtual ranks of one GPU: two checkouts, one at a time.

    PYTHONPATH=<checkout> python bench/expanded_ab.py run TAG RUNS.jsonl [--tokens 1024] [--samples 15]
    python bench/expanded_ab.py summarize RUNS.jsonl... --json OUT.json --command '...'

`run` times, with the `deep_ep` that `PYTHONPATH` names (this tree or an older checkout), an expanded
dispatch (fresh, no CPU sync) and a combine without multiple reduction (one row per token and local
expert: the kernels whose machine code a change touched, `bench/sass_diff.py`) on 8 virtual ranks,
hidden 7168, top-8, 256 experts, FP8 (1x128 scales) then BF16. Each is checked bitwise against
`deep_ep.reference` (received rows and combined tokens, CPU sync) before its CUDA graphs are timed
(2 calls per graph; median of `--samples` barrier-aligned samples per rank). It appends one line per
run: the tag, each rank's times, and the slowest rank's. Run the checkouts alternately (A B B A ...)
so that a drift of the machine falls on both.

`summarize` merges run lines of the tags `old` and `new` into one result file: per figure, the median
over runs of the slowest rank, the median over runs of the ranks' median, and new / old.

Virtual ranks share one GPU (each a share of its SMs): the figures are the kernels' own cost, not
NVLink's, and compare two trees only with each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

HIDDEN, NUM_TOPK, NUM_EXPERTS, NUM_RANKS = 7168, 8, 256, 8
CALLS_PER_GRAPH = 2
_START = time.monotonic()


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"[{time.monotonic() - _START:6.1f} s] {text}", flush=True)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _time_dtype(rank: int, group: Any, tag: str, fp8: bool, x_bf16: torch.Tensor, routing: dict, num_tokens: int,
                num_samples: int, gen: torch.Generator) -> dict[str, float]:  # fmt: skip
    """Check, then time, the expanded dispatch and the combine of one dispatch dtype on this rank."""
    import deep_ep
    from deep_ep.bench.timing import agree_on_replays, capture, release_captured, time_graphs
    from deep_ep.host_reads import wait_for_stream
    from deep_ep.utils.fp8 import per_token_cast_to_fp8

    dtype = "fp8" if fp8 else "bf16"
    x = tuple(t.cuda() for t in per_token_cast_to_fp8(x_bf16)) if fp8 else x_bf16.cuda()
    ours, reference = (
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_tokens, hidden=HIDDEN, num_topk=NUM_TOPK,
                              use_fp8_dispatch=fp8, allow_multiple_reduction=False, backend=backend,
                              explicitly_destroy=True, num_gpu_timeout_secs=15)
        for backend in ("auto", "reference")
    )  # fmt: skip
    _say(rank, f"{tag} {dtype}: {type(ours.backend).__name__}, checking against deep_ep.reference")
    out = ours.dispatch(x, do_cpu_sync=True, **routing)
    ref_out = reference.dispatch(x, do_cpu_sync=True, **routing)
    for a, b in zip(_as_tuple(out[0]), _as_tuple(ref_out[0]), strict=True):
        assert _bitwise(a, b), f"rank {rank}, {dtype}: recv_x differs from deep_ep.reference"
    y = torch.randn((out[3].num_expanded_tokens, HIDDEN), generator=gen).to(torch.bfloat16).cuda()
    combined, ref_combined = ours.combine(y, out[3])[0], reference.combine(y, ref_out[3])[0]
    wait_for_stream()
    assert _bitwise(combined, ref_combined), f"rank {rank}, {dtype}: combined_x differs from deep_ep.reference"
    reference.destroy()

    no_sync = dict(routing, num_max_tokens_per_rank=num_tokens, do_cpu_sync=False)
    handle = ours.dispatch(x, **no_sync)[3]
    rows = torch.randn((handle.num_expanded_tokens, HIDDEN), generator=gen).to(torch.bfloat16).cuda()
    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    ops = {
        "dispatch": capture(lambda r: ours.dispatch(x, **no_sync), 1, CALLS_PER_GRAPH, host_barrier=barrier),
        "combine": capture(lambda r: ours.combine(rows, handle), 1, CALLS_PER_GRAPH, host_barrier=barrier),
    }
    times = {}
    for name, op in ops.items():
        num_replays = agree_on_replays(op, ours.barrier, group)
        times[f"{dtype}_{name}_us"] = time_graphs(op, num_replays, num_samples, ours.barrier) * 1e6
        _say(rank, f"{tag} {dtype} {name}: {times[f'{dtype}_{name}_us']:.1f} us on rank 0")
    release_captured(list(ops.values()), barrier)
    ours.destroy()
    return times


def _rank(rank: int, group: Any, tag: str, num_tokens: int, num_samples: int) -> dict[str, float]:
    from deep_ep.utils.routing import uniform_routing

    gen = torch.Generator().manual_seed(1234 + rank)
    topk_idx, weights = uniform_routing(num_tokens, NUM_EXPERTS, NUM_TOPK, generator=gen)
    x_bf16 = torch.randn((num_tokens, HIDDEN), generator=gen).to(torch.bfloat16)
    routing = dict(topk_idx=topk_idx.cuda(), topk_weights=weights.cuda(), num_experts=NUM_EXPERTS, do_expand=True)
    times = {}
    for fp8 in (True, False):
        times.update(_time_dtype(rank, group, tag, fp8, x_bf16, routing, num_tokens, num_samples, gen))
    return times


def run(args: argparse.Namespace) -> None:
    import deep_ep
    from deep_ep.loopback import LoopbackWorld

    _say(0, f"{args.tag}: deep_ep from {deep_ep.__file__}")
    with LoopbackWorld(NUM_RANKS, timeout_s=240) as world:
        per_rank = world.run(_rank, args.tag, args.tokens, args.samples)
    slowest = {key: max(times[key] for times in per_rank) for key in per_rank[0]}
    print(f"{args.tag}, slowest rank: " + ", ".join(f"{k} {v:.1f}" for k, v in slowest.items()), flush=True)
    with open(args.runs, "a") as f:
        f.write(json.dumps(dict(tag=args.tag, num_tokens=args.tokens, num_samples=args.samples, slowest=slowest,
                                per_rank=per_rank, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                device=torch.cuda.get_device_name())) + "\n")  # fmt: skip


def summarize(args: argparse.Namespace) -> None:
    runs = [json.loads(line) for path in args.runs for line in open(path) if line.strip()]
    figures = {}
    for key in runs[0]["slowest"]:
        by_tag = {}
        for tag in ("old", "new"):
            mine = [r for r in runs if r["tag"] == tag]
            by_tag[tag] = dict(
                slowest_us=statistics.median(r["slowest"][key] for r in mine),
                rank_median_us=statistics.median(statistics.median(t[key] for t in r["per_rank"]) for r in mine),
                slowest_per_run_us=[r["slowest"][key] for r in mine],
            )  # fmt: skip
        figures[key] = dict(**by_tag, new_over_old_slowest=by_tag["new"]["slowest_us"] / by_tag["old"]["slowest_us"],
                            new_over_old_rank_median=by_tag["new"]["rank_median_us"] / by_tag["old"]["rank_median_us"])  # fmt: skip
    # When the runs were made (the first one's date; lines from before runs had one: when they are merged)
    dates = sorted(r["date"] for r in runs if "date" in r)
    date = dates[0] if dates else datetime.now(timezone.utc).isoformat(timespec="seconds")
    result = dict(commit=args.commit, old=args.old, command=args.command, hardware=args.hardware, date=date,
                  note=args.note, figures=figures, runs=runs)  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    for key, figure in figures.items():
        print(f"{key:18s} old {figure['old']['slowest_us']:8.1f}  new {figure['new']['slowest_us']:8.1f}  "
              f"new/old {figure['new_over_old_slowest']:.3f} (rank medians {figure['new_over_old_rank_median']:.3f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("run", help="time the deep_ep on PYTHONPATH once and append the run to RUNS")
    one.add_argument("tag", help="which checkout this is: old or new")
    one.add_argument("runs", help="the JSON-lines file to append to")
    one.add_argument("--tokens", type=int, default=1024, help="tokens per rank (the outputs are worst-case sized)")
    one.add_argument("--samples", type=int, default=15, help="timing samples per rank")
    merge = sub.add_parser("summarize", help="merge run files into one result file")
    merge.add_argument("runs", nargs="+")
    merge.add_argument("--json", required=True)
    merge.add_argument("--commit", required=True, help="the new checkout's commit")
    merge.add_argument("--old", required=True, help="the old checkout's commit")
    merge.add_argument("--command", required=True, help="how the runs were made")
    merge.add_argument("--hardware", required=True)
    merge.add_argument("--note", default="")
    args = parser.parse_args()
    (run if args.what == "run" else summarize)(args)


if __name__ == "__main__":
    sys.exit(main())
