"""What the benches of the side operations (`--op agrs|pp|engram`) share: the wall time of a call,
the slowest rank's row, the run on virtual ranks and its JSON with provenance.

Each op's module gives `bench_rank(rank, group, sizes, num_iters, seed) -> rows` (every row with
`ours_us` and `torch_us`, checked before timed) and `format_table(rows, hardware)`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..host_reads import wait_for_stream
from . import report


def wall_us(call: Callable[[], Any], device: torch.device, num_iters: int) -> float:
    """Median wall time of `call()` and the wait for the device to finish it, in microseconds."""
    samples = []
    for _ in range(num_iters):
        start = time.perf_counter()
        call()
        # Polled, not synchronised: a virtual rank blocked in the driver would hold back its peers' launches
        if device.type == "cuda" and not wait_for_stream(timeout_s=600):
            raise TimeoutError("bench: the device did not finish a timed call within 600 s")
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (op, size): the slowest rank's medians, and ours over torch's."""
    rows = []
    for same in zip(*per_rank, strict=True):
        ours, theirs = max(r["ours_us"] for r in same), max(r["torch_us"] for r in same)
        rows.append(dict(same[0], ours_us=ours, torch_us=theirs, ours_over_torch=ours / theirs))
    return rows


def run_side_op(name: str, bench_rank: Callable[..., list[dict]], format_table: Callable[[list[dict], str], str],
                checked_against: str, num_ranks: int, device: str, sizes: tuple[int, ...], num_iters: int,
                seed: int, json_path: str | None, command: str | None) -> list[dict]:  # fmt: skip
    """Run `bench_rank` on `num_ranks` virtual ranks of `device` (`'cuda'`: one GPU; `'cpu'`: the
    reference backend), print the table and write the JSON when asked."""
    from ..loopback import LoopbackWorld

    hardware = report.hardware_name(device, num_ranks, True)
    print(f"deep-ep bench --op {name}: {len(sizes)} size(s) on {hardware}, seed {seed}", file=sys.stderr, flush=True)
    with LoopbackWorld(num_ranks, 0 if device == "cuda" else "cpu", timeout_s=1800) as world:
        per_rank = world.run(bench_rank, sizes, num_iters, seed)
    rows = summarize(per_rank)
    print(format_table(rows, hardware))
    print(f"measured: {report.provenance(command, hardware)}")
    if json_path:
        document = dict(commit=report.git_commit(), command=command or " ".join(sys.argv), hardware=hardware,
                        date=report.utc_now(), torch=torch.__version__, seed=seed, num_iters=num_iters,
                        checked_against=checked_against, rows=rows, per_rank=per_rank)  # fmt: skip
        Path(json_path).write_text(json.dumps(document, indent=2) + "\n")
    return rows
