"""A fuzzer of the NVLink kernels against the reference, on virtual ranks of one GPU.

    python3 tests/loopback/fuzz_kernels.py --cases 1000 [--seed S] [--ranks 2,3,4,8,16] [--case EP:INDEX]
                                           [--json FILE] [--dry-run]

The cases are `sweep.make_cases` (random shapes, dtypes, routings, token counts per rank, layouts,
SMs, stream modes, cached dispatch, weights, biases, statistics), spread over the world sizes by
`WEIGHTS` (small worlds run faster: 1000 cases take about six minutes on one H200), each run by
`sweep.run_case`: kernels and reference buffers make the same calls and every output is compared
bitwise. The cases of a world size run one after another on the same buffers, so tokens per rank,
shapes and modes change from call to call on one buffer. Every kernel is compiled before the first
case.

A failing case is printed with its dict, the seed and two reproducers: `--seed S --case EP:INDEX`
reruns that case alone on fresh buffers (its inputs depend on the seed and the index only), and
`--seed S --case EP:FIRST-INDEX` reruns the sequence of calls that led to it. The world is then
replaced and the run goes on with the next case, up to `--max-failures` per world size; the exit
status is 1 when any case failed. The seed is a fresh one unless `--seed`, and always printed.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from typing import Any

from runinfo import provenance, use_checkout, write_json

use_checkout()

import torch  # noqa: E402
from sweep import SHAPES, kernel_specs, make_buffers, make_cases, run_case  # noqa: E402

import deep_ep.loopback  # noqa: E402  (sets the CUDA settings of virtual ranks before CUDA starts)

# Shares of the cases per world size, and cases per second on one H200 (the sweep's rates) for the
# estimate: EP2-EP4 run about three times as many cases per second as EP16
WEIGHTS = {2: 32, 3: 27, 4: 30, 8: 7, 16: 4}
RATES = {2: 3.0, 3: 3.0, 4: 3.0, 8: 1.6, 16: 1.0}
# Every world size that runs gets at least its corner cases (make_cases pins the first four)
NUM_CORNERS = 4
SCRIPT = "tests/loopback/fuzz_kernels.py"


def spread_cases(total: int, ranks: list[int]) -> dict[int, int]:
    """`total` cases over the world sizes `ranks`: the corners of each first, the rest by `WEIGHTS`
    (largest remainders), summing to `total` exactly."""
    floor = min(NUM_CORNERS, total // len(ranks))
    counts = dict.fromkeys(ranks, floor)
    rest = total - floor * len(ranks)
    weight = sum(WEIGHTS[n] for n in ranks)
    exact = {n: rest * WEIGHTS[n] / weight for n in ranks}
    for n in ranks:
        counts[n] += int(exact[n])
    for n in sorted(ranks, key=lambda n: (int(exact[n]) - exact[n], n))[: total - sum(counts.values())]:
        counts[n] += 1
    return counts


def parse_case(text: str) -> tuple[int, int, int]:
    """`EP:INDEX` or `EP:FIRST-LAST` as `(ep, first, last)`; `argparse.ArgumentTypeError` when malformed."""
    found = re.fullmatch(r"(\d+):(\d+)(?:-(\d+))?", text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected EP:INDEX or EP:FIRST-LAST, e.g. 4:17 or 4:0-17")
    ep, first = int(found[1]), int(found[2])
    last = int(found[3]) if found[3] is not None else first
    if ep not in SHAPES:
        raise argparse.ArgumentTypeError(f"{text!r}: EP must be one of {sorted(SHAPES)}")
    if last < first:
        raise argparse.ArgumentTypeError(f"{text!r}: FIRST must not exceed LAST")
    return ep, first, last


def parse_ranks(text: str) -> list[int]:
    """`2,3,4` as `[2, 3, 4]` (each a world size of `sweep.SHAPES`)."""
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected world sizes separated by commas") from None
    if not ranks or any(n not in SHAPES for n in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: every world size must be one of {sorted(SHAPES)}")
    return list(dict.fromkeys(ranks))


def select_cases(ep: int, first: int, last: int, seed: int) -> list[dict[str, Any]]:
    """Cases `first` to `last` of world size `ep`: the same dicts as in any longer list of that seed
    (`make_cases` draws case by case, so a case depends only on the cases before it)."""
    return make_cases(ep, last + 1, seed)[first:]


def build_plan(args: argparse.Namespace, seed: int) -> dict[int, list[dict[str, Any]]]:
    """The cases to run per world size: those of `--case`, in the order given, or `--cases` spread."""
    if args.case:
        plan: dict[int, list[dict[str, Any]]] = {}
        for ep, first, last in args.case:
            plan.setdefault(ep, []).extend(select_cases(ep, first, last, seed))
        return plan
    counts = spread_cases(args.cases, args.ranks)
    return {n: make_cases(n, count, seed) for n, count in counts.items() if count > 0}


def reproducers(seed: int, ep: int, first: int, index: int) -> list[str]:
    """Command lines that rerun case `index` of world size `ep` alone, and the sequence that led to it
    (the world ran cases `first` to `index` on the same buffers)."""
    alone = f"python3 {SCRIPT} --seed {seed} --case {ep}:{index}"
    return [alone] if first == index else [alone, f"python3 {SCRIPT} --seed {seed} --case {ep}:{first}-{index}"]


class CaseFailure(AssertionError):
    """Case `index` raised on `rank` (the message names the check that failed)."""

    def __init__(self, index: int, rank: int, message: str) -> None:
        super().__init__(message)
        self.index, self.rank = index, rank


def _destroy(buffers: dict, quiet: bool) -> None:
    for pair in buffers.values():
        for buffer in pair:
            try:
                buffer.destroy()
            except Exception:
                if not quiet:  # a release error must not hide the failure that is on its way up
                    raise


def fuzz_rank(rank: int, group: Any, cases: list[dict[str, Any]], seed: int) -> int:
    """Every case on one rank, on buffers created once; a failure raises `CaseFailure`."""
    num_ranks = group.size()
    buffers = make_buffers(group, num_ranks)
    try:
        for case in cases:
            try:
                run_case(buffers, rank, num_ranks, case, seed)
            except Exception as error:
                raise CaseFailure(case["index"], rank, f"{type(error).__name__}: {error}") from error
    except BaseException:
        _destroy(buffers, quiet=True)
        raise
    _destroy(buffers, quiet=False)
    return len(cases)


def _failure_of(error: deep_ep.loopback.LoopbackRankError, ep: int, seed: int, first: int,
                cases: dict[int, dict]) -> dict[str, Any]:  # fmt: skip
    """The failing case of a world run: the earliest `CaseFailure`, from the rank that raised first."""
    found = [e for e in error.errors if isinstance(e, CaseFailure)]
    origin = re.search(r"rank (\d+) first", str(error))
    if not found:
        rank = int(origin[1]) if origin else None
        return dict(ep=ep, index=None, rank=rank, case=None, error=str(error)[:4000], reproducers=[])
    index = min(e.index for e in found)
    at_index = [e for e in found if e.index == index]
    chosen = next((e for e in at_index if origin and e.rank == int(origin[1])), at_index[0])
    per_rank = {r: f"{type(e).__name__}: {e}" for r, e in enumerate(error.errors) if e is not None}
    return dict(ep=ep, index=index, rank=chosen.rank, case=cases[index], error=str(chosen),
                traceback=getattr(chosen, "loopback_traceback", ""), errors_per_rank=per_rank,
                reproducers=reproducers(seed, ep, first, index))  # fmt: skip


def _print_failure(failure: dict[str, Any], seed: int) -> None:
    print(f"\nFAILED: EP{failure['ep']} case {failure['index']} (seed {seed}), rank {failure['rank']}: "
          f"{failure['error']}\ncase: {failure['case']}", flush=True)  # fmt: skip
    for line in failure["reproducers"]:
        print(f"reproduce: {line}", flush=True)


def run_world(ep: int, cases: list[dict[str, Any]], seed: int, max_failures: int) -> dict[str, Any]:
    """The cases of one world size in order; after a failure, a fresh world goes on with the next case."""
    by_index = {case["index"]: case for case in cases}
    passed, failures, todo = 0, [], list(cases)
    started = time.monotonic()
    while todo and len(failures) < max_failures:
        first = todo[0]["index"]
        world = deep_ep.loopback.LoopbackWorld(ep)
        try:
            # The world's deadline bounds the whole run: a slow case gets ten times the sweep's rate
            world.run(fuzz_rank, todo, seed, timeout_s=120 + 10 * len(todo) / RATES[ep])
            passed, todo = passed + len(todo), []
        except deep_ep.loopback.LoopbackRankError as error:
            failure = _failure_of(error, ep, seed, first, by_index)
            failures.append(failure)
            _print_failure(failure, seed)
            position = next((i for i, c in enumerate(todo) if c["index"] == failure["index"]), None)
            if position is None:  # not inside a case (e.g. the buffers): the rest cannot run either
                break
            passed, todo = passed + position, todo[position + 1 :]
        finally:
            world.close()
    return dict(cases=len(cases), passed=passed, not_run=len(todo), failures=failures,
                seconds=round(time.monotonic() - started, 1))  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="cases in all, spread over --ranks")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--ranks", type=parse_ranks, default=sorted(SHAPES), help="world sizes, e.g. 2,3,4,8,16")
    parser.add_argument("--case", type=parse_case, action="append", default=[],
                        help="run only case INDEX (or cases FIRST-LAST, in order) of world size EP; repeatable")  # fmt: skip
    parser.add_argument("--max-failures", type=int, default=3, help="failures per world size before moving on")
    parser.add_argument("--json", default=None, help="write the result (cases, failures, provenance) here")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimate; run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; 0 when every case matched the reference, 1 when one did not, 2 for a bad request."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cases < 1 or args.max_failures < 1:
        parser.error("--cases and --max-failures must be at least 1")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    plan = build_plan(args, seed)
    estimate = sum(len(cases) / RATES[ep] for ep, cases in plan.items())
    print(f"fuzz: seed {seed}, {sum(map(len, plan.values()))} cases (" +
          ", ".join(f"EP{ep} {len(cases)}" for ep, cases in plan.items()) +
          f"), about {estimate:.0f} s on one H200 after compiling", flush=True)  # fmt: skip
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("fuzz: needs a CUDA GPU (the kernels run on virtual ranks of one device)", file=sys.stderr)
        return 2
    from deep_ep.jit import compile_many

    started = time.monotonic()
    compile_many(list(dict.fromkeys(spec for ep in plan for spec in kernel_specs(ep))))
    compile_s = time.monotonic() - started
    results: dict[int, dict[str, Any]] = {}
    stopped = None
    base = dict(provenance(SCRIPT, argv), seed=seed, cases_requested=None if args.case else args.cases,
                cases_per_world={ep: len(cases) for ep, cases in plan.items()}, compile_seconds=round(compile_s, 1))  # fmt: skip

    def document(complete: bool) -> dict[str, Any]:
        failures = [f for r in results.values() for f in r["failures"]]
        summary = {ep: {k: v for k, v in r.items() if k != "failures"} for ep, r in results.items()}
        passed = complete and not failures and stopped is None and len(results) == len(plan)
        return dict(base, passed=passed, complete=complete, failures=failures, results=summary, stopped=stopped,
                    seconds=round(time.monotonic() - started - compile_s, 1))  # fmt: skip

    for ep, cases in plan.items():
        try:
            results[ep] = run_world(ep, cases, seed, args.max_failures)
        except TimeoutError as error:
            # Ranks still running in their threads: no other world can safely start
            stopped = f"EP{ep}: {error}"
            print(f"\nSTOPPED: {stopped}", flush=True)
            break
        except Exception as error:  # the world itself (e.g. a device fault left by an earlier case)
            results[ep] = dict(cases=len(cases), passed=0, not_run=len(cases), seconds=0.0, failures=[
                dict(ep=ep, index=None, rank=None, case=None, error=f"{type(error).__name__}: {error}",
                     reproducers=[])])  # fmt: skip
            print(f"\nFAILED: EP{ep} could not run: {type(error).__name__}: {error}", flush=True)
        result = results[ep]
        print(f"EP{ep}: {result['passed']} of {result['cases']} cases bitwise equal to the reference in "
              f"{result['seconds']} s, {len(result['failures'])} failures", flush=True)  # fmt: skip
        write_json(args.json, document(complete=False), quiet=True)
    final = document(complete=True)
    print(f"fuzz {'PASSED' if final['passed'] else 'FAILED'}: seed {seed}, "
          f"{sum(r['passed'] for r in results.values())} cases passed, {len(final['failures'])} failed, "
          f"{final['seconds']} s (+{compile_s:.1f} s compiling)", flush=True)  # fmt: skip
    for failure in final["failures"]:
        for line in failure["reproducers"][:1]:
            print(f"reproduce: {line}")
    write_json(args.json, final)
    return 0 if final["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
