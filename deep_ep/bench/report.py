"""The report of `deep-ep bench`: one row per case, the tables, the checks, the JSON and the plot.

Rows hold times in microseconds, bandwidths in GB/s and ratios, by one rule for several ranks
(`deep_ep.bench.MULTI_RANK_RULE`): a time is the slowest rank's, a record count the mean over ranks
(`num_records`, `num_wire_records`; per rank in `*_per_rank`), and GB/s = records x record bytes /
time, so every GB/s can be recomputed from the row. `graph_*` fields come from CUDA-graph replays (the kernel
time of the bandwidth convention); the others from eager calls with CPU sync.

Checks:
- `planner_sm` (issue 5): in each SM sweep, the planner's pick reaches >= 95% of the sweep's best
  bandwidth and uses <= 1.25x the SMs of the smallest sweep point reaching 95%, for dispatch and
  combine (graph times when measured, else eager).
- `prediction` (issue 5): the planner's predicted time within 25% of the measured graph time
  (acceptance: T=8192 and 4096, FP8, uniform routing).
- `targets` (issue 6): the targets table (FP8, uniform routing; GPUs only).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

from . import MULTI_RANK_RULE, columns_text
from .cases import BenchConfig

# Row fields with times: (field, the record bytes they move)
TIMED = (
    ("dispatch", "dispatch_us", "dispatch_bytes"),
    ("combine", "combine_us", "combine_bytes"),
    ("graph_dispatch", "graph_dispatch_us", "dispatch_bytes"),
    ("graph_cached_dispatch", "graph_cached_dispatch_us", "dispatch_bytes"),
    ("graph_combine", "graph_combine_us", "combine_bytes"),
)
PLANNER_FRACTION, PLANNER_SM_RATIO, PREDICTION_TOLERANCE = 0.95, 1.25, 0.25


# ------------------------------------------------------------------------------------------ rows


def summarize(per_rank: list[list[dict]], meta: dict) -> list[dict]:
    """One row per case by `MULTI_RANK_RULE`: the slowest rank's times, the mean record counts over ranks,
    GB/s from those two, and the ratios."""
    sol = meta.get("speed_of_light_gbs")
    rows = []
    for case_rows in zip(*per_rank, strict=True):
        row = dict(case_rows[0])
        row.pop("rank")
        for key in ("num_records", "num_wire_records"):
            row[f"{key}_per_rank"] = [r[key] for r in case_rows]
            row[key] = statistics.mean(r[key] for r in case_rows)
        for prefix, time_key, bytes_key in TIMED:
            if case_rows[0][time_key] is None:
                row.update({f"{prefix}_logical_gbs": None, f"{prefix}_wire_gbs": None, f"{prefix}_wire_vs_sol": None})
                continue
            row[time_key] = max(r[time_key] for r in case_rows)
            row[f"{prefix}_logical_gbs"] = row["num_records"] * row[bytes_key] / row[time_key] / 1e3
            row[f"{prefix}_wire_gbs"] = row["num_wire_records"] * row[bytes_key] / row[time_key] / 1e3
            row[f"{prefix}_wire_vs_sol"] = row[f"{prefix}_wire_gbs"] / sol if sol else None
        row["speed_of_light_gbs"] = sol
        for key in ("torch_dispatch_us", "torch_combine_us"):
            row[key] = max(r[key] for r in case_rows)
        for op in ("dispatch", "combine"):
            row[f"{op}_speedup_vs_torch"] = row[f"torch_{op}_us"] / row[f"{op}_us"]
            graph_us = row[f"graph_{op}_us"]
            row[f"graph_{op}_speedup_vs_torch"] = row[f"torch_{op}_us"] / graph_us if graph_us else None
            predicted = row.get(f"predicted_{op}_us")
            row[f"predicted_{op}_error"] = predicted / graph_us - 1 if (predicted and graph_us) else None
        row["kernel_breakdown"] = slowest_breakdown([r.get("kernel_breakdown") for r in case_rows])
        rows.append(row)
    return rows


def slowest_breakdown(per_rank: list[dict | None]) -> dict | None:
    """The kernel breakdown by the multi-rank rule: each kernel's slowest rank; an operation whose
    profile failed on any rank keeps that rank's error."""
    measured = [b for b in per_rank if b]
    if not measured:
        return None
    merged: dict[str, dict] = {}
    for op in measured[0]:
        kernels = [b.get(op, {"error": "not profiled on every rank"}) for b in measured]
        failed = [k for k in kernels if "error" in k]
        if failed:
            merged[op] = failed[0]
            continue
        names = dict.fromkeys(name for k in kernels for name in k)
        merged[op] = {name: max(k.get(name, 0.0) for k in kernels) for name in names}
    return merged


def _label(row: dict) -> str:
    c = row["case"]
    return f"T={c['num_tokens']} {'fp8' if c['fp8_dispatch'] else 'bf16'} {c['routing']}"


def _bandwidth(row: dict, op: str) -> tuple[float, str]:
    """The logical GB/s of `op` the checks use: from graph times when measured, else eager."""
    if row.get(f"graph_{op}_logical_gbs") is not None:
        return row[f"graph_{op}_logical_gbs"], "graph"
    return row[f"{op}_logical_gbs"], "eager"


# ------------------------------------------------------------------------------------------ checks


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        c = row["case"]
        key = (c["num_tokens"], c["hidden"], c["num_topk"], c["num_experts"], c["fp8_dispatch"], c["routing"])
        groups.setdefault(key, []).append(row)
    return groups


def planner_sm_checks(rows: list[dict]) -> list[dict]:
    """Issue 5: the planner's pick against each SM sweep, for dispatch and combine."""
    checks = []
    for group in _groups(rows).values():
        picks = [r for r in group if r["num_sms_source"] == "planner"]
        sweep = [r for r in group if r["num_sms_source"] == "sweep"]
        if not picks or len(sweep) < 2 or picks[0]["backend"] == "ReferenceBackend":
            continue  # the reference backend ignores the SM count
        pick = picks[0]
        for op in ("dispatch", "combine"):
            points = sorted((r["num_sms"], _bandwidth(r, op)[0]) for r in sweep)
            best_sms, best = max(points, key=lambda point: point[1])
            smallest = min(m for m, gbs in points if gbs >= PLANNER_FRACTION * best)
            pick_gbs, source = _bandwidth(pick, op)
            fraction, ratio = pick_gbs / best, pick["num_sms"] / smallest
            checks.append(dict(case=_label(pick), op=op, timing=source, best_gbs=best, best_sms=best_sms,
                               smallest_95_sms=smallest, pick_sms=pick["num_sms"], pick_gbs=pick_gbs,
                               pick_fraction=fraction, sms_ratio=ratio,
                               passed=fraction >= PLANNER_FRACTION and ratio <= PLANNER_SM_RATIO,
                               acceptance=_is_acceptance_case(pick)))  # fmt: skip
    return checks


def _is_acceptance_case(row: dict) -> bool:
    """Issue 5's acceptance cases: T=8192 and 4096, FP8 dispatch, uniform routing."""
    c = row["case"]
    return c["num_tokens"] in (8192, 4096) and c["fp8_dispatch"] and c["routing"] == "uniform"


def prediction_checks(rows: list[dict]) -> list[dict]:
    """Issue 5: predicted vs measured graph time at the planner's pick (acceptance: T=8192/4096 FP8 uniform)."""
    checks = []
    for row in rows:
        if row["num_sms_source"] != "planner" or row["graph_dispatch_us"] is None:
            continue
        for op in ("dispatch", "combine"):
            error = row[f"predicted_{op}_error"]
            checks.append(dict(case=_label(row), op=op, num_sms=row["num_sms"], measured_us=row[f"graph_{op}_us"],
                               predicted_us=row[f"predicted_{op}_us"], error=error,
                               passed=abs(error) <= PREDICTION_TOLERANCE, acceptance=_is_acceptance_case(row)))  # fmt: skip
    return checks


def _target(name: str, candidates: list[dict], value_of, limit: float, higher_is_better: bool, unit: str) -> dict:
    """The best candidate row's value against `limit`."""
    values = [(value_of(r), r) for r in candidates if value_of(r) is not None]
    if not values:
        return dict(target=name, value=None, limit=limit, unit=unit, passed=None, num_sms=None)
    value, row = max(values, key=lambda v: v[0]) if higher_is_better else min(values, key=lambda v: v[0])
    passed = value >= limit if higher_is_better else value <= limit
    return dict(target=name, value=value, limit=limit, unit=unit, passed=passed, num_sms=row["num_sms"])


def target_checks(rows: list[dict]) -> list[dict]:
    """Issue 6's targets, from FP8 uniform rows with graph times (the best row within each SM limit)."""
    base = [r for r in rows if r["case"]["fp8_dispatch"] and r["case"]["routing"] == "uniform"
            and r["graph_dispatch_us"] is not None]  # fmt: skip
    if not base or not base[0].get("speed_of_light_gbs"):
        return []

    def at(tokens: int, max_sms: int | None = None, planner: bool = False) -> list[dict]:
        return [r for r in base if r["case"]["num_tokens"] == tokens and (max_sms is None or r["num_sms"] <= max_sms)
                and (not planner or r["num_sms_source"] == "planner")]  # fmt: skip

    def sol(key: str):
        return lambda r: r[key]

    targets = [
        _target("T=8192 dispatch wire vs SoL, <= 24 SMs", at(8192, 24), sol("graph_dispatch_wire_vs_sol"), 0.90, True,
                "x SoL"),
        _target("T=8192 combine wire vs SoL, <= 24 SMs", at(8192, 24), sol("graph_combine_wire_vs_sol"), 0.90, True,
                "x SoL"),
        _target("T=4096 dispatch wire vs SoL, <= 24 SMs", at(4096, 24), sol("graph_dispatch_wire_vs_sol"), 0.85, True,
                "x SoL"),
        _target("T=4096 combine wire vs SoL, <= 24 SMs", at(4096, 24), sol("graph_combine_wire_vs_sol"), 0.85, True,
                "x SoL"),
        _target("T=8192 dispatch vs torch (graph), planner", at(8192, planner=True),
                sol("graph_dispatch_speedup_vs_torch"), 3.0, True, "x"),
        _target("T=8192 combine vs torch (graph), planner", at(8192, planner=True),
                sol("graph_combine_speedup_vs_torch"), 3.0, True, "x"),
        _target("T=8192 dispatch vs torch (eager), planner", at(8192, planner=True), sol("dispatch_speedup_vs_torch"),
                3.0, True, "x"),
        _target("T=8192 combine vs torch (eager), planner", at(8192, planner=True), sol("combine_speedup_vs_torch"),
                3.0, True, "x"),
        _target("T=128 dispatch (graph, cached or no-sync)", at(128),
                lambda r: min(r["graph_dispatch_us"], r["graph_cached_dispatch_us"]), 15.0, False, "us"),
        _target("T=128 combine (graph)", at(128), sol("graph_combine_us"), 15.0, False, "us"),
        _target("stretch: T=8192 dispatch wire vs SoL, <= 16 SMs", at(8192, 16), sol("graph_dispatch_wire_vs_sol"),
                0.90, True, "x SoL"),
        _target("stretch: T=8192 combine wire vs SoL, <= 16 SMs", at(8192, 16), sol("graph_combine_wire_vs_sol"),
                0.90, True, "x SoL"),
    ]  # fmt: skip
    for row in at(128, planner=True):
        for op, share in epilogue_shares(row).items():
            targets.append(dict(target=f"T=128 {op} epilogue share (report)", value=share, limit=None, unit="share",
                                passed=None, num_sms=row["num_sms"]))  # fmt: skip
    return targets


def epilogue_shares(row: dict) -> dict[str, float]:
    """Share of the device time spent in epilogue kernels, per operation, from the kernel breakdown."""
    shares = {}
    for op, kernels in (row.get("kernel_breakdown") or {}).items():
        if "error" in kernels:
            continue
        total = sum(kernels.values())
        if total > 0:
            shares[op] = sum(us for name, us in kernels.items() if "epilogue" in name) / total
    return shares


def checks(rows: list[dict], virtual_ranks: bool = False) -> dict[str, list[dict]]:
    """The planner, prediction and target checks; virtual ranks only check the planner's SM pick
    (their times are not NVLink's, which the predictions and the targets are about)."""
    if virtual_ranks:
        return dict(planner_sm=planner_sm_checks(rows), prediction=[], targets=[])
    return dict(planner_sm=planner_sm_checks(rows), prediction=prediction_checks(rows), targets=target_checks(rows))


# ------------------------------------------------------------------------------------------ text


def _f(value: float | None, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'n/a':>{width}}"


def _gbs(value: float, width: int) -> str:
    """GB/s with one decimal, or three below 1 GB/s (CPU ranks), so that no rate prints as 0.0."""
    return f"{value:>{width}.1f}" if value >= 1 else f"{value:>{width}.3f}"


def _pair(a: float | None, b: float | None, spec: str, width: int) -> str:
    if a is None or b is None:
        return f"{'n/a':>{width}}"
    return f"{f'{a:{spec}}/{b:{spec}}':>{width}}"


def _uses_sms(row: dict) -> bool:
    """Whether the SM count means anything: the reference backend (torch collectives) has no SMs."""
    return row["backend"] != "ReferenceBackend"


def _sms(row: dict) -> str:
    if not _uses_sms(row):
        return "n/a"
    return f"{row['num_sms']}{'*' if row['num_sms_source'] == 'planner' else ''}"


def _case_columns(row: dict) -> str:
    c = row["case"]
    return f"{c['num_tokens']:>6} {'fp8' if c['fp8_dispatch'] else 'bf16':>5} {c['routing']:>10} {_sms(row):>5}"


def progress_line(done: int, total: int, row: dict) -> str:
    """The line printed after a case: its row by `MULTI_RANK_RULE` (the figures the table shows)."""
    text = (f"[{done}/{total}] {_label(row)} SMs={_sms(row)}: eager {row['dispatch_us']:.1f}/{row['combine_us']:.1f} us "
            "(dispatch/combine, slowest rank)")  # fmt: skip
    if row["graph_dispatch_us"] is not None:
        text += (f", graph {row['graph_dispatch_us']:.1f}/{row['graph_cached_dispatch_us']:.1f}/"
                 f"{row['graph_combine_us']:.1f} us (fresh/cached/combine)")  # fmt: skip
    return text


def format_eager_table(rows: list[dict]) -> str:
    """The eager table; the %SoL column only where the speed of light was measured (GPUs)."""
    with_sol = any(r["dispatch_wire_vs_sol"] is not None for r in rows)
    header = (f"{'T':>6} {'dtype':>5} {'routing':>10} {'SMs':>5} | {'dispatch us':>11} {'log GB/s':>8} {'wire GB/s':>9} | "
              f"{'combine us':>10} {'log GB/s':>8} {'wire GB/s':>9} | {'torch d/c us':>17} {'x torch d/c':>11}"
              + (f" | {'%SoL d/c':>9}" if with_sol else ""))  # fmt: skip
    lines = [
        "eager calls (dispatch with CPU sync = exact shapes, then combine of its handle):",
        header,
        "-" * len(header),
    ]
    for r in rows:
        pct = (_pair(100 * r["dispatch_wire_vs_sol"], 100 * r["combine_wire_vs_sol"], ".0f", 9)
               if r["dispatch_wire_vs_sol"] is not None else f"{'n/a':>9}")  # fmt: skip
        lines.append(
            f"{_case_columns(r)} | {r['dispatch_us']:>11.1f} {_gbs(r['dispatch_logical_gbs'], 8)} "
            f"{_gbs(r['dispatch_wire_gbs'], 9)} | {r['combine_us']:>10.1f} {_gbs(r['combine_logical_gbs'], 8)} "
            f"{_gbs(r['combine_wire_gbs'], 9)} | {_pair(r['torch_dispatch_us'], r['torch_combine_us'], '.1f', 17)} "
            f"{_pair(r['dispatch_speedup_vs_torch'], r['combine_speedup_vs_torch'], '.2f', 11)}"
            + (f" | {pct}" if with_sol else "")
        )  # fmt: skip
    return "\n".join(lines)


def format_graph_table(rows: list[dict]) -> str:
    header = (f"{'T':>6} {'dtype':>5} {'routing':>10} {'SMs':>5} | {'fresh us':>8} {'log/wire GB/s':>13} {'%SoL':>4} | "
              f"{'cached us':>9} {'wire GB/s':>9} {'%SoL':>4} | {'combine us':>10} {'log/wire GB/s':>13} {'%SoL':>4} | "
              f"{'x torch d/c':>13} | {'pred d/c us':>13} {'err d/c %':>9}")  # fmt: skip
    lines = ["CUDA-graph replay, device time per call (fresh = dispatch without CPU sync; cached = handle=):", header,
             "-" * len(header)]  # fmt: skip

    def pct(value: float | None) -> str:
        return _f(None if value is None else 100 * value, ".0f", 4)

    for r in rows:
        if r["graph_dispatch_us"] is None:
            continue
        errors = (_pair(100 * r["predicted_dispatch_error"], 100 * r["predicted_combine_error"], "+.0f", 9)
                  if r["predicted_dispatch_error"] is not None else f"{'n/a':>9}")  # fmt: skip
        lines.append(
            f"{_case_columns(r)} | {r['graph_dispatch_us']:>8.1f} "
            f"{_pair(r['graph_dispatch_logical_gbs'], r['graph_dispatch_wire_gbs'], '.0f', 13)} "
            f"{pct(r['graph_dispatch_wire_vs_sol'])} | {r['graph_cached_dispatch_us']:>9.1f} "
            f"{r['graph_cached_dispatch_wire_gbs']:>9.1f} {pct(r['graph_cached_dispatch_wire_vs_sol'])} | "
            f"{r['graph_combine_us']:>10.1f} {_pair(r['graph_combine_logical_gbs'], r['graph_combine_wire_gbs'], '.0f', 13)} "
            f"{pct(r['graph_combine_wire_vs_sol'])} | "
            f"{_pair(r['graph_dispatch_speedup_vs_torch'], r['graph_combine_speedup_vs_torch'], '.2f', 13)} | "
            f"{_pair(r['predicted_dispatch_us'], r['predicted_combine_us'], '.0f', 13)} {errors}"
        )  # fmt: skip
    return "\n".join(lines)


def _verdict(passed: bool | None) -> str:
    return {True: "ok", False: "MISSED", None: "-"}[passed]


def format_checks(found: dict[str, list[dict]]) -> str:
    lines = []
    if found["planner_sm"]:
        lines.append("planner's SM pick vs the sweep (>= 95% of the best, <= 1.25x the smallest SMs reaching 95%; "
                     "* = acceptance case):")  # fmt: skip
        for c in found["planner_sm"]:
            lines.append(f"  {c['case']:<26} {c['op']:<8} pick {c['pick_sms']:>3} SMs: {100 * c['pick_fraction']:5.1f}% of "
                         f"best {c['best_gbs']:.0f} GB/s ({c['best_sms']} SMs); 95% from {c['smallest_95_sms']} SMs, "
                         f"ratio {c['sms_ratio']:.2f} [{c['timing']}] {'*' if c['acceptance'] else ' '} "
                         f"{_verdict(c['passed'])}")  # fmt: skip
    if found["prediction"]:
        lines.append("planner's predicted vs measured graph time at its pick (within 25%; * = acceptance case):")
        for c in found["prediction"]:
            lines.append(f"  {c['case']:<26} {c['op']:<8} {c['num_sms']:>3} SMs: predicted {c['predicted_us']:8.1f} us, "
                         f"measured {c['measured_us']:8.1f} us, {100 * c['error']:+6.1f}% "
                         f"{'*' if c['acceptance'] else ' '} {_verdict(c['passed'])}")  # fmt: skip
    if found["targets"]:
        lines.append("issue 6 targets (FP8 dispatch, uniform routing, graph times; best row within the SM limit):")
        for t in found["targets"]:
            limit = "" if t["limit"] is None else f" (target {'>=' if t['unit'] != 'us' else '<='} {t['limit']:g})"
            value = "n/a" if t["value"] is None else f"{t['value']:.2f}{' ' + t['unit']}"
            sms = "" if t["num_sms"] is None else f" at {t['num_sms']} SMs"
            lines.append(f"  {t['target']:<50} {value}{sms}{limit} {_verdict(t['passed'])}")
    return "\n".join(lines)


def format_breakdowns(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        for op, kernels in (r.get("kernel_breakdown") or {}).items():
            parts = ", ".join(
                f"{name} {us:.1f}" if isinstance(us, float) else f"{name} {us}" for name, us in kernels.items()
            )
            op_us = r.get(f"graph_{op}_us")
            longest = max((us for us in kernels.values() if isinstance(us, float)), default=0.0)
            # A kernel cannot outlast the operation it belongs to: such a figure is the profiler's
            flag = (
                " (longer than the operation's graph time: not a kernel time)"
                if op_us and longest > 1.1 * op_us
                else ""
            )
            lines.append(f"  {_label(r)} SMs={r['num_sms']} {op} ({op_us or 0:.1f} us): {parts}{flag}")
    title = ("kernel breakdown (us per call: median launch x launches per call, slowest rank; a kernel and the "
             "epilogue that waits for it overlap, so they do not add up to the operation's time):")  # fmt: skip
    return (title + "\n" + "\n".join(lines)) if lines else ""


VIRTUAL_RANKS_NOTE = (
    "VIRTUAL RANKS: every rank is a thread of one process and all of them share one GPU (deep_ep.loopback). "
    "Times show the kernels' own cost (layouts, epilogues, host launches), not NVLink; the torch path runs "
    "over thread collectives, not NCCL; the speed of light is peer stores inside one GPU's memory. "
    "No NVLink target or prediction is checked."
)


SELF_CHECK_NOTE = (
    "checked: the reference backend is what runs here, so each case was checked against itself (a "
    "self-consistency check of dispatch and combine); on GPUs the kernels are checked against deep_ep.reference"
)


def format_report(rows: list[dict], found: dict[str, list[dict]], meta: dict) -> str:
    """The tables, the checks and a footer: the columns, the multi-rank rule, the check and the provenance."""
    parts = [VIRTUAL_RANKS_NOTE] if meta.get("virtual_ranks") else []
    parts.append(format_eager_table(rows))
    on_gpu = any(_uses_sms(r) for r in rows)
    if any(r["graph_dispatch_us"] is not None for r in rows):
        parts.append(format_graph_table(rows))
    elif on_gpu:
        parts.append("CUDA-graph replay: not measured (--no-graphs)")
    else:
        parts.append("CUDA-graph replay: not measured (GPUs only; CPU ranks run the reference backend)")
    sol = meta.get("speed_of_light_gbs")
    if sol:
        by_sms = ", ".join(f"{m}: {v:.0f}" for m, v in (meta.get("speed_of_light_by_sms") or {}).items())
        where = " between virtual ranks of one GPU" if meta.get("virtual_ranks") else ""
        parts.append(f"speed of light (peer-store probe{where}, every rank writing): {sol:.1f} GB/s per direction "
                     f"(by SMs: {by_sms})")  # fmt: skip
    if on_gpu:
        parts.append("* = the planner's pick (num_sms=0, ElasticBuffer.get_theoretical_num_sms for this shape); "
                     f"planner rates: {meta.get('planner_source')}")  # fmt: skip
    for text in (format_checks(found), format_breakdowns(rows)):
        if text:
            parts.append(text)
    footer = [columns_text(cpu=not on_gpu)]
    if meta.get("checked_against") == "itself":
        footer.append(SELF_CHECK_NOTE)
    if meta.get("provenance"):
        footer.append(f"measured: {meta['provenance']}")
    parts.append("\n".join(footer))
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------ files


def git_commit(where: Path | None = None) -> str:
    """The commit measured: `EP_BENCH_COMMIT` (a copy of the tree without .git names it), else git's
    HEAD of the checkout at `where` (this package's by default), with `-dirty` when its tracked files
    differ from HEAD: the code measured is then not that commit's (uncommitted changes, or a copied
    tree whose .git is older than its files), and the result must not pass for it."""
    if os.environ.get("EP_BENCH_COMMIT"):
        return os.environ["EP_BENCH_COMMIT"]
    cwd = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=cwd).stdout.strip()  # fmt: skip
        differs = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True, cwd=cwd).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if differs == 1 else "")


def hardware_name(device: str, num_ranks: int, virtual_ranks: bool = False) -> str:
    ranks = "rank" if num_ranks == 1 else "ranks"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        if virtual_ranks:
            return (f"{num_ranks} virtual {ranks} sharing one {props.name} ({props.multi_processor_count} SMs; "
                    "deep_ep.loopback, no NVLink)")  # fmt: skip
        return f"{num_ranks}x {props.name} ({props.multi_processor_count} SMs)"
    if virtual_ranks:
        return f"{num_ranks} virtual CPU {ranks} (threads, deep_ep.loopback) on {platform.processor() or platform.machine()}"
    return f"{num_ranks} CPU {ranks} (gloo) on {platform.processor() or platform.machine()}"


def provenance(command: str | None, hardware: str) -> str:
    """One line naming what a result measured: commit, command, hardware and date."""
    import sys

    head, dash, state = git_commit().partition("-")
    return f"commit {head[:12]}{dash}{state}, `{command or ' '.join(sys.argv)}`, {hardware}, {utc_now()}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: str, rows: list[dict], found: dict, meta: dict, config: BenchConfig, command: str | None,
               hardware: str) -> None:  # fmt: skip
    import sys

    document = dict(
        commit=git_commit(), command=command or " ".join(sys.argv), hardware=hardware, date=utc_now(),
        num_ranks=config.num_ranks, virtual_ranks=config.virtual_ranks,
        virtual_ranks_note=VIRTUAL_RANKS_NOTE if config.virtual_ranks else None,
        torch=torch.__version__, seed=config.seed, num_iters=config.num_iters, num_warmups=config.num_warmups,
        num_rotations=config.num_rotations, num_graph_rotations=config.num_graph_rotations,
        num_graph_samples=config.num_graph_samples,
        hot_fraction=config.hot_fraction, multi_rank_rule=MULTI_RANK_RULE,
        checked_against=meta.get("checked_against"), speed_of_light_gbs=meta.get("speed_of_light_gbs"),
        speed_of_light_by_sms=meta.get("speed_of_light_by_sms"), planner_source=meta.get("planner_source"),
        checks=found, results=rows,
    )  # fmt: skip
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


# Markers of the plots' cases (never "*": a star is the planner's pick); 11 markers and 20 colours give 220
# distinct (colour, marker) pairs
PLOT_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "p")


def plot_styles(num: int) -> list[tuple[tuple, str]]:
    """`num` distinct (colour, marker) pairs: tab20's dark shades, then its light ones, with the markers."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    colors = [cmap(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    return [(colors[i % len(colors)], PLOT_MARKERS[i % len(PLOT_MARKERS)]) for i in range(num)]


def build_figure(rows: list[dict], meta: dict, provenance: str | None = None):
    """The figure of `plot`: three panels (wire GB/s vs tokens at the planner's pick; dispatch and combine
    wire GB/s vs SMs), each case with its own colour and marker, the legends below the panels (outside the
    data), integer SM ticks. Returns the matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

    graph = any(r["graph_dispatch_us"] is not None for r in rows)
    prefix = "graph_" if graph else ""
    timing = "graph" if graph else "eager"
    series: dict[str, list[dict]] = {}
    for row in rows:
        c = row["case"]
        series.setdefault(f"{'fp8' if c['fp8_dispatch'] else 'bf16'} {c['routing']}", []).append(row)
    groups = list(_groups(rows).values())
    series_styles = dict(zip(series, plot_styles(len(series)), strict=True))
    group_styles = plot_styles(len(groups))

    # Legends go in a row of their own below the panels; its height follows the number of entries
    num_legend_rows = max(-(-(2 * len(series) + 1) // 2), -(-(len(groups) + 3) // 3))
    legend_height = 0.2 * num_legend_rows + 0.2
    fig = plt.figure(figsize=(18, 5 + legend_height))
    grid = fig.add_gridspec(2, 3, height_ratios=[5, legend_height])
    by_tokens = fig.add_subplot(grid[0, 0])
    by_sms = [fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[0, 2])]
    token_legend, case_legend = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1:])
    for axis in (token_legend, case_legend):
        axis.axis("off")

    tokens_seen: set[int] = set()
    for name, group in series.items():
        color, marker = series_styles[name]
        picks = sorted((r for r in group if r["num_sms_source"] == "planner"), key=lambda r: r["case"]["num_tokens"])
        for op, style in (("dispatch", "-"), ("combine", "--")):
            points = [(r["case"]["num_tokens"], r[f"{prefix}{op}_wire_gbs"]) for r in picks
                      if r[f"{prefix}{op}_wire_gbs"] is not None]  # fmt: skip
            if points:
                tokens_seen.update(t for t, _ in points)
                by_tokens.plot(*zip(*points, strict=True), style, color=color, marker=marker, label=f"{op}, {name}")
    sms_seen: set[int] = set()
    uses_sms = any(_uses_sms(r) for r in rows)
    for axis, op in zip(by_sms, ("dispatch", "combine"), strict=True):
        if not uses_sms:
            axis.text(0.5, 0.5, "n/a: the reference backend (torch collectives)\nuses no SMs", ha="center",
                      va="center", transform=axis.transAxes)  # fmt: skip
            axis.set_xticks([])
            axis.set_yticks([])
        for group, (color, marker) in zip(groups, group_styles, strict=True) if uses_sms else ():
            label = _label(group[0])
            sweep = sorted((r["num_sms"], r[f"{prefix}{op}_wire_gbs"]) for r in group
                           if r["num_sms_source"] == "sweep" and r[f"{prefix}{op}_wire_gbs"] is not None)  # fmt: skip
            picks = [(r["num_sms"], r[f"{prefix}{op}_wire_gbs"]) for r in group
                     if r["num_sms_source"] == "planner" and r[f"{prefix}{op}_wire_gbs"] is not None]  # fmt: skip
            sms_seen.update(m for m, _ in sweep + picks)
            if sweep:
                axis.plot(*zip(*sweep, strict=True), color=color, marker=marker, label=label)
            for m, gbs in picks:
                axis.scatter([m], [gbs], marker="*", s=220, color=color, edgecolors="black", zorder=5,
                             label=None if sweep else label)  # fmt: skip
        probe = meta.get("speed_of_light_by_sms") or {}
        if probe:
            points = sorted((int(m), v) for m, v in probe.items())
            axis.plot(*zip(*points, strict=True), ":", color="gray", label="peer-store probe")
        axis.set_title(f"{op} ({timing} time) vs SMs")
        axis.set_xlabel("SMs")
        if uses_sms:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(sms_seen) == 1:  # one SM count: a readable range around it, integer ticks
        (only,) = sms_seen
        for axis in by_sms:
            axis.set_xlim(max(0, only - 4), only + 4)
    sol = meta.get("speed_of_light_gbs")
    for axis in (by_tokens, *by_sms):
        if sol:
            axis.axhline(sol, linestyle="--", color="gray", linewidth=0.8,
                         label="peer-store SoL, one GPU" if meta.get("virtual_ranks") else "NVLink SoL (per direction)")  # fmt: skip
        axis.set_ylabel("wire GB/s (per direction)")
        top = axis.get_ylim()[1]
        axis.set_ylim(0, 1.08 * top if top > 0 else 1)  # from 0, with room above the highest point
        axis.grid(alpha=0.3)
    picked = "planner's pick" if uses_sms else "every case"
    by_tokens.set_title(f"{picked} ({timing} time) vs tokens")
    by_tokens.set_xlabel("tokens per rank")
    by_tokens.set_xscale("log", base=2)
    if 0 < len(tokens_seen) <= 6:  # ticks at the measured token counts (else powers of 2), written out
        by_tokens.xaxis.set_major_locator(FixedLocator(sorted(tokens_seen)))
    by_tokens.xaxis.set_minor_locator(NullLocator())
    by_tokens.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.0f}"))

    handles, labels = by_tokens.get_legend_handles_labels()
    if handles:
        token_legend.legend(handles, labels, loc="upper center", ncol=2, fontsize=8, frameon=False)
    handles, labels = by_sms[0].get_legend_handles_labels()
    if uses_sms:
        handles.append(Line2D([], [], linestyle="", marker="*", markersize=13, color="white", markeredgecolor="black"))
        labels.append("the planner's pick (star, in the case's colour)")
    if handles:
        case_legend.legend(handles, labels, loc="upper center", ncol=3, fontsize=8, frameon=False)
    if provenance:
        fig.suptitle(provenance, fontsize=8)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: str, meta: dict, provenance: str | None = None) -> None:
    """Write `build_figure`'s PNG to `path`; `provenance` (commit, command, hardware, date) goes into the
    figure and the PNG's metadata."""
    import matplotlib.pyplot as plt

    fig = build_figure(rows, meta, provenance)
    fig.savefig(path, dpi=110, metadata={"Description": provenance} if provenance else None)
    plt.close(fig)
