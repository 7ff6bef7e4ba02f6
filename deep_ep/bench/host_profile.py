"""`deep-ep bench --host --profile`: where the host time of each call goes.

Every rank makes the same calls (they are collective); the first rank's thread runs them under
`cProfile`, enabled only from a call's entry to its return, so the barriers between calls are left
out. From Python 3.12 on, cProfile sees every thread of the process, so with virtual ranks (threads)
profile one rank (`--ranks 1`; the CLI refuses more). A profiler's hooks add their own cost to every
Python function call, so its totals exceed the unprofiled host wall time: read the shares, not the
sums. The result per operation:

- `areas`: the profiler's own time (`tottime`) per call, summed by where the code lives (our
  validation, facade, backend, JIT, torch's Python, C functions such as torch's tensor methods and
  CUDA calls, the rest of Python), largest first;
- `top`: the functions with the largest own time per call, with their calls per call and their
  cumulative time per call.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

# Where a function lives -> its area; the first matching path fragment wins
_AREAS = (
    ("deep_ep/validation", "validation (deep_ep.validation)"),
    ("deep_ep/planner", "planner (deep_ep.planner)"),
    ("deep_ep/backends/kernels", "kernels backend (launch sequences, arguments)"),
    ("deep_ep/backends/reference", "reference backend"),
    ("deep_ep/jit", "JIT (spec lookup, argument packing, launch)"),
    ("deep_ep/event", "streams and events (deep_ep.event)"),
    ("deep_ep/host_reads", "host waits (deep_ep.host_reads)"),
    ("deep_ep/", "facade and handle (deep_ep.buffer, .handle, ...)"),
    ("torch/", "torch's Python"),
)
_C_AREA = "C functions (torch tensor methods, CUDA, builtins)"
_OTHER_AREA = "other Python (stdlib)"


def area_of(filename: str) -> str:
    """The area of a function defined in `filename` (`'~'` is cProfile's file of C functions)."""
    if filename == "~":
        return _C_AREA
    path = PurePath(filename).as_posix()
    return next((area for fragment, area in _AREAS if fragment in path), _OTHER_AREA)


def _short_name(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if filename == "~":
        return name
    path = PurePath(filename).as_posix()
    for root in ("deep_ep/", "torch/"):
        if root in path:
            path = root + path.split(root, 1)[1]
            break
    else:
        path = PurePath(filename).name
    return f"{path}:{line}({name})"


def profile_calls(call: Callable[[], Any], align: Callable[[], None], num_calls: int, enabled: bool) -> dict | None:
    """Make `num_calls` calls of `call()`, each after `align()`; with `enabled`, profile them and return
    the summary (`summarize_stats`), else `None` (the other ranks, which only take part)."""
    profiler = cProfile.Profile() if enabled else None
    for _ in range(num_calls):
        align()
        if profiler is None:
            call()
            continue
        profiler.enable()
        call()
        profiler.disable()
    return None if profiler is None else summarize_stats(pstats.Stats(profiler), num_calls)


def summarize_stats(stats: pstats.Stats, num_calls: int, num_top: int = 40) -> dict:
    """Per-call microseconds of `stats` (made of `num_calls` calls) by area and for the `num_top`
    functions of largest own time."""
    per_call_us = 1e6 / num_calls
    areas: dict[str, float] = {}
    functions = []
    for key, (_, num_function_calls, own_s, cumulative_s, _) in stats.stats.items():  # type: ignore[attr-defined]
        area = area_of(key[0])
        areas[area] = areas.get(area, 0.0) + own_s * per_call_us
        functions.append(dict(function=_short_name(key), area=area, calls_per_call=num_function_calls / num_calls,
                              own_us=own_s * per_call_us, cumulative_us=cumulative_s * per_call_us))  # fmt: skip
    functions.sort(key=lambda f: -f["own_us"])
    return dict(num_calls=num_calls, total_us=sum(areas.values()),
                areas=dict(sorted(areas.items(), key=lambda item: -item[1])), top=functions[:num_top])  # fmt: skip


def format_profile(op: str, case: str, profile: dict, num_top: int = 8) -> str:
    """The profile of one operation as text: its areas, then its top functions."""
    total = profile["total_us"]
    lines = [f"profile of {op}, {case}: {total:.1f} us per call under the profiler ({profile['num_calls']} calls)"]
    lines += [f"  {us:8.1f} us {100 * us / total:5.1f}%  {area}" for area, us in profile["areas"].items()]
    lines.append("  top functions (own us, cumulative us, calls per call):")
    lines += [f"  {f['own_us']:8.1f} {f['cumulative_us']:8.1f} {f['calls_per_call']:6.1f}  {f['function']}"
              for f in profile["top"][:num_top]]  # fmt: skip
    return "\n".join(lines)
