"""Variants of the checkout with one fix taken back, to show on a GPU what the fix changes.

A variant is a copy of the checkout's sources with a few exact text edits. Two uses, both on
one GPU with virtual ranks:

- `knockouts`: each knock-out reverts one fix of the device-side hardening and runs the fault test
  that guards it in the copy; the test must fail there (and passes in the checkout). It shows that
  the test can fail and what it saw before the fix.
- `ordering-ab`: the checkout against a copy with the memory-ordering changes reverted (coherent
  loads of window data, the fences of the last arrivers), `deep-ep bench` alternating between the
  two, to measure what the ordering costs.

Usage, from the repository root on a GPU machine (writes under OUT, default bench/results/latest):

    python tests/loopback/variants.py knockouts [NAME ...]
    python tests/loopback/variants.py ordering-ab [--rounds 3] [--tokens 4096,128] [--each]

Every edit must match its file exactly once (`tests/loopback/test_variants_cpu.py` checks that on
CPU, so a variant cannot silently stop reverting anything).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Edit:
    """Replace `old` (which must occur exactly once) by `new` in `path` (relative to the root)."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Knockout:
    """One fix taken back (`edits`), the issue item it belongs to, and the test that must then fail."""

    name: str
    item: str
    edits: tuple[Edit, ...]
    test: str


_GPU_TESTS = "tests/loopback/test_loopback_gpu.py::"

KNOCKOUTS = (
    Knockout(
        "fault-not-posted-to-peers",
        "23 #1 / 15 #1: a failure reaches every peer's status word",
        (
            Edit(
                "include/deep_ep/common/fault.cuh",
                "for (int p = 0; p < num_ranks; ++p) {",
                "for (int p = 0; p < 0 * num_ranks; ++p) {",
            ),
        ),
        _GPU_TESTS + "test_a_rank_that_skips_a_call_stops_every_rank_within_one_deadline[4]",
    ),
    Knockout(
        "invalid-routing-sent",
        "23 #2: invalid topk_idx without a CPU sync sends nothing and is reported",
        (
            Edit(
                "include/deep_ep/kernels/dispatch.cuh",
                "is_bad = __syncthreads_or(any_bad);",
                "is_bad = __syncthreads_or(any_bad) and false;",
            ),
        ),
        _GPU_TESTS + "test_invalid_routing_without_cpu_sync_sends_nothing_and_raises_at_the_next_call",
    ),
    Knockout(
        "buffer-alive-after-exception",
        "23 #3: an exception between two launches marks the buffer dead",
        (
            Edit(
                "deep_ep/backends/kernels/runtime.py",
                '        """Mark the buffer dead: `op` raised `error` after its first kernel was launched."""\n'
                "        if self.dead_reason is None:",
                '        """Mark the buffer dead: `op` raised `error` after its first kernel was launched."""\n'
                "        if False:",
            ),
        ),
        _GPU_TESTS + "test_an_exception_between_two_launches_makes_the_buffer_unusable",
    ),
    Knockout(
        "operation-not-in-signature",
        "23 #5: ranks running different operations raise instead of reading wrong data",
        (
            Edit(
                "include/deep_ep/common/arrivals.cuh",
                "(static_cast<uint32_t>(op_hash) & 0xffffu)",
                "(static_cast<uint32_t>(op_hash) & 0u)",
            ),
        ),
        _GPU_TESTS + "test_ranks_running_different_operations_all_raise",
    ),
)

# The ordering changes of 23 #4, taken back to the code before them: window data through the
# non-coherent path, and `__threadfence(); atomicAdd` in the last-arriver patterns of the grid
# barrier, the epilogues and the task queues (no acquire in the last arriver)
ORDERING_REVERT = (
    Edit(
        "include/deep_ep/common/ptx.cuh",
        "__device__ __forceinline__ int4 ld_window_v4(const int4* ptr) {\n    int4 v;\n"
        '    asm volatile("ld.global.L1::no_allocate.v4.s32',
        "__device__ __forceinline__ int4 ld_window_v4(const int4* ptr) {\n    int4 v;\n"
        '    asm volatile("ld.global.nc.L1::no_allocate.v4.s32',
    ),
    Edit(
        "include/deep_ep/common/comm.cuh",
        "        if (atomic_add_acq_rel_gpu(arrive, 1) == num_ctas - 1) {\n",
        "        __threadfence();\n        if (atomicAdd(arrive, 1) == num_ctas - 1) {\n",
    ),
    Edit(
        "include/deep_ep/common/credits.cuh",
        "        is_last = atomic_add_acq_rel_gpu(done, 1) == num_ctas - 1;\n",
        "        __threadfence();\n        is_last = atomicAdd(done, 1) == num_ctas - 1;\n",
    ),
    Edit(
        "include/deep_ep/common/tasks.cuh",
        "        if (threadIdx.x == 0 and atomic_add_acq_rel_gpu(words_ + 1, 1) == static_cast<int>(num_ctas_) - 1)\n",
        "        if (threadIdx.x == 0 and atomicAdd(words_ + 1, 1) == static_cast<int>(num_ctas_) - 1)\n",
    ),
)

ORDERING_EDIT_NAMES = ("window-loads-nc", "grid-barrier-add", "epilogue-add", "task-queue-add")

# The A/B runs this bench (its cases are the planner's picks), with --tokens appended
ORDERING_AB_BENCH = ["bench", "--ranks", "4", "--dtype", "fp8,bf16"]


# What a variant does not copy: version control, environments, caches and results
_NOT_COPIED = (".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "results", "build", "*.egg-info")


def check_edits(edits: tuple[Edit, ...], root: Path = ROOT) -> None:
    """Raise `ValueError` unless every edit's `old` text occurs exactly once in its file."""
    for edit in edits:
        count = (root / edit.path).read_text().count(edit.old)
        if count != 1:
            raise ValueError(f"{edit.path}: the text to replace occurs {count} times, not once: {edit.old!r}")


def make_variant(edits: tuple[Edit, ...], dest: Path, root: Path = ROOT) -> Path:
    """Copy the checkout at `root` (sources, not `_NOT_COPIED`) to `dest` and apply `edits` there;
    returns `dest`."""
    check_edits(edits, root)
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(*_NOT_COPIED), dirs_exist_ok=True)
    for edit in edits:
        path = dest / edit.path
        path.write_text(path.read_text().replace(edit.old, edit.new, 1))
    return dest


def _env(tree: Path, commit: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    if commit is not None:
        env["EP_BENCH_COMMIT"] = commit
    return env


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return os.environ.get("EP_BENCH_COMMIT") or (found.stdout.strip() if found.returncode == 0 else "unknown")


def run_knockouts(names: list[str], out: Path, timeout_s: float) -> list[dict]:
    """Each selected knock-out: its test in a variant (must fail). Results also go to out/knockouts.json."""
    selected = [k for k in KNOCKOUTS if not names or k.name in names]
    results = []
    for knockout in selected:
        with tempfile.TemporaryDirectory(prefix=f"ep-{knockout.name}-") as tmp:
            tree = make_variant(knockout.edits, Path(tmp))
            command = [sys.executable, "-m", "pytest", "-m", "gpu", knockout.test, "-q", "-s", "-x",
                       "-p", "no:cacheprovider", "--timeout", str(int(timeout_s))]  # fmt: skip
            started = time.monotonic()
            try:
                done = subprocess.run(command, cwd=tree, env=_env(tree), capture_output=True, text=True,
                                      timeout=timeout_s + 60)  # fmt: skip
                rc, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as expired:
                rc, output = None, f"{expired.stdout or ''}{expired.stderr or ''}\n(killed after {timeout_s + 60:g} s)"
        log = out / f"knockout-{knockout.name}.log"
        log.write_text(output)
        result = dict(name=knockout.name, item=knockout.item, test=knockout.test, returncode=rc,
                      failed_as_expected=rc != 0, seconds=round(time.monotonic() - started, 1),
                      log=log.name, summary=_failure_summary(output))  # fmt: skip
        print(f"[{knockout.name}] {'FAILED as expected' if rc != 0 else 'PASSED: the test does not see it'} "
              f"in {result['seconds']} s: {result['summary']}", flush=True)  # fmt: skip
        results.append(result)
    document = dict(commit=_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    command=" ".join(["python", "tests/loopback/variants.py", "knockouts", *names]),
                    hardware=_hardware(), results=results)  # fmt: skip
    (out / "knockouts.json").write_text(json.dumps(document, indent=2) + "\n")
    return results


def _failure_summary(output: str) -> str:
    """What a pytest run ended with: its last exception or assertion lines and its count line."""
    ends = [line.strip() for line in output.splitlines()
            if re.match(r"E\s+(assert\b|AssertionError|([\w.]+\.)?\w*(Error|Exception)\b)", line)]  # fmt: skip
    counts = [line.strip("= ") for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return " | ".join(dict.fromkeys(ends[-3:] + counts[-1:]))[:800]


def _hardware() -> str:
    found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True)  # fmt: skip
    return ", ".join(found.stdout.split("\n")).strip(", ") if found.returncode == 0 else "unknown"


def _graph_times(path: Path) -> dict[str, float]:
    """`{"T=4096 fp8 fresh": us, ...}` of the planner's picks in one bench JSON."""
    rows = json.loads(path.read_text())["results"]
    times = {}
    for row in rows:
        if row["num_sms_source"] != "planner":
            continue
        case = row["case"]
        label = f"T={case['num_tokens']} {'fp8' if case['fp8_dispatch'] else 'bf16'}"
        for op, key in (("fresh", "graph_dispatch_us"), ("cached", "graph_cached_dispatch_us"),
                        ("combine", "graph_combine_us")):  # fmt: skip
            times[f"{label} {op}"] = row[key]
    return times


def ordering_variants(each: bool) -> dict[str, tuple[Edit, ...]]:
    """The B sides of the A/B: every ordering change reverted, and with `each` one change at a time."""
    variants = {"all-reverted": ORDERING_REVERT}
    if each:
        variants.update({name: (edit,) for name, edit in zip(ORDERING_EDIT_NAMES, ORDERING_REVERT, strict=True)})
    return variants


def run_ordering_ab(rounds: int, tokens: str, each: bool, out: Path, timeout_s: float) -> dict:
    """`deep-ep bench` on the checkout ("checkout") and on each ordering variant, the order rotated
    every round; the cost of a change is median(checkout) / median(variant) - 1 per case and
    operation. Writes out/ordering-ab.json (and the log of a failed run)."""
    commit = _commit()
    variants = ordering_variants(each)
    bench = [*ORDERING_AB_BENCH, "--tokens", tokens]
    names = ["checkout", *variants]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="ep-ordering-") as tmp:
        trees = {"checkout": ROOT} | {name: make_variant(edits, Path(tmp) / name) for name, edits in variants.items()}
        for round_idx in range(rounds):
            shift = round_idx % len(names)
            for name in names[shift:] + names[:shift]:
                path = Path(tmp) / f"{name}-{round_idx}.json"
                label = commit if name == "checkout" else f"{commit}+{name}"
                done = subprocess.run([sys.executable, "-m", "deep_ep.cli", *bench, "--json", str(path)],
                                      cwd=trees[name], env=_env(trees[name], label), capture_output=True, text=True,
                                      timeout=timeout_s)  # fmt: skip
                if done.returncode != 0:
                    (out / f"ordering-{name}-{round_idx}.log").write_text(done.stdout + done.stderr)
                    raise RuntimeError(
                        f"bench {name} round {round_idx} exited {done.returncode}: {done.stderr[-2000:]}"
                    )
                runs[name].append(_graph_times(path))
                print(f"round {round_idx} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()),
                      flush=True)  # fmt: skip
    cost: dict[str, dict] = {}
    for name in variants:
        cost[name] = {}
        for key in runs["checkout"][0]:
            a = statistics.median(r[key] for r in runs["checkout"])
            b = statistics.median(r[key] for r in runs[name])
            cost[name][key] = dict(checkout_us=a, variant_us=b, cost_percent=100 * (a / b - 1))
        mean = statistics.fmean(v["cost_percent"] for v in cost[name].values())
        print(f"{name}: the checkout is {mean:+.2f}% slower on average; " +
              ", ".join(f"{k} {v['cost_percent']:+.1f}%" for k, v in cost[name].items()))  # fmt: skip
    document = dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    command=f"python tests/loopback/variants.py ordering-ab --rounds {rounds} --tokens {tokens}"
                            + (" --each" if each else ""),
                    bench_command="deep-ep " + " ".join(bench), hardware=_hardware(),
                    note="CUDA-graph device time per call (us) of the planner's picks on 4 virtual ranks of one GPU; "
                         "checkout = the code as committed, a variant = the checkout with the named ordering "
                         "changes reverted (ORDERING_REVERT); cost = median over rounds, checkout / variant - 1",
                    runs=runs, cost=cost)  # fmt: skip
    (out / "ordering-ab.json").write_text(json.dumps(document, indent=2) + "\n")
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    knock = sub.add_parser("knockouts", help="each knock-out's test must fail in its variant")
    knock.add_argument("names", nargs="*", help=f"knock-outs to run (default all: {[k.name for k in KNOCKOUTS]})")
    knock.add_argument("--timeout", type=float, default=240.0, help="seconds per test")
    ab = sub.add_parser("ordering-ab", help="bench the checkout against the ordering-reverted variant")
    ab.add_argument("--rounds", type=int, default=3)
    ab.add_argument("--tokens", default="4096,128", help="the bench's --tokens")
    ab.add_argument("--each", action="store_true", help="also one variant per ordering change")
    ab.add_argument("--timeout", type=float, default=150.0, help="seconds per bench run")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT", ROOT / "bench" / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "knockouts":
        results = run_knockouts(args.names, out, args.timeout)
        return 0 if all(r["failed_as_expected"] for r in results) else 1
    run_ordering_ab(args.rounds, args.tokens, args.each, out, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
