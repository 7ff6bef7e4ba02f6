"""`deep-ep bench --host`: what a call costs the host, next to what it costs the GPU.

Per tokens-per-rank and dispatch dtype, on every rank, four operations: a fresh dispatch without
CPU sync, a fresh dispatch with CPU sync (exact shapes), a cached dispatch (`handle=`) and a
combine. Each call starts on a drained stream with every rank lined up (a barrier), so a launch
never waits behind a full queue and the host time is the call's own:

- host wall: from the call's entry to its return, the stream not waited for unless the call itself
  waits (the CPU-sync dispatch waits for the counts);
- host CPU: the calling thread's CPU time over the same span. With virtual ranks, threads of one
  process take turns in the interpreter; a turn spent waiting is wall time, not CPU time;
- release: the host time to drop the call's results right after it returned (freeing the outputs
  and the event: the caller's cost, later; before session 23 it was counted in the host wall);
- eager wall: the call, then a wait until its stream is idle (what an eager caller sees);
- GPU: the device time per call from CUDA-graph replays (GPUs; a CPU-sync dispatch cannot be
  captured, so it has none);
- moved wall: the host wall again, but with every address new each call (the inputs cycle through
  copies and the last calls' results are kept), so that no kernel parameter repeats the previous
  call's. A replay launches its kernels as one CUDA graph, which costs least when the parameters are
  the ones it holds (a loop over the same tensors); the moved wall is the price when they are not.

On GPUs the kernels' dispatch and combine of each case are first checked bitwise against
`deep_ep.reference`. Several ranks: the slowest rank's median, as in the bandwidth tables. With
`--profile`, the first rank's calls are then profiled (`deep_ep.bench.host_profile`).
"""

from __future__ import annotations

import collections
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..backends.kernels.steady import graphs_enabled
from ..host_reads import wait_for_stream
from . import HOST_COLUMNS, host_floor, host_profile, report
from .cases import BenchCase, BenchConfig, make_inputs, random_rows

HOST_OPS = ("dispatch_no_sync", "dispatch_cpu_sync", "cached_dispatch", "combine")
# The graph operation (deep_ep.bench.runner.capture_moe_ops) that times each host operation on the GPU
GRAPH_OPS = {"dispatch_no_sync": "dispatch", "cached_dispatch": "cached_dispatch", "combine": "combine"}
HOST_FIELDS = ("host_wall_us", "host_wall_moved_us", "host_cpu_us", "eager_wall_us", "release_us", "gpu_us",
               "count_wait_us", *host_floor.FLOOR_FIELDS)  # fmt: skip
# The copies of the inputs a moved call cycles through, and the results it keeps alive
NUM_MOVED = 3
# The host-time targets of issue 19 on one H200 (benchmark targets: reported, never asserted); a
# CPU-sync dispatch's is its count phase (the host's wait for the counts) plus this
HOST_TARGETS_US = {"dispatch_no_sync": 30.0, "cached_dispatch": 20.0, "combine": 20.0}
CPU_SYNC_TARGET_US = 30.0


def host_cases(config: BenchConfig) -> list[BenchCase]:
    """One case per (dtype, routing, tokens) of `config`, at the planner's SM pick."""
    return list({c.key: c for c in config.cases if c.num_sms == 0}.values())


def _time_call(call: Callable[[], Any], align: Callable[[], None], drain: Callable[[], None], num_warmups: int,
               num_iters: int) -> dict:  # fmt: skip
    """Median host wall, host CPU and eager wall microseconds of `call()` (collective); `drain()` waits
    until the stream is idle."""
    for _ in range(num_warmups):
        align()
        call()
    walls, cpus, eagers, releases = [], [], [], []
    for _ in range(num_iters):
        align()
        # The CPU clock is a system call (~0.7 us): read outside the wall's span, which holds only the
        # wall clock's own reads (tens of nanoseconds)
        cpu_started = time.thread_time_ns()
        started = time.perf_counter_ns()
        result = call()
        returned = time.perf_counter_ns()
        cpu_done = time.thread_time_ns()
        del result  # the caller's, after the call: timed on its own
        released = time.perf_counter_ns()
        drain()
        drained = time.perf_counter_ns()
        walls.append(returned - started)
        cpus.append(cpu_done - cpu_started)
        releases.append(released - returned)
        eagers.append(drained - started)
    return dict(host_wall_us=statistics.median(walls) / 1e3, host_cpu_us=statistics.median(cpus) / 1e3,
                eager_wall_us=statistics.median(eagers) / 1e3, release_us=statistics.median(releases) / 1e3)  # fmt: skip


def _copy(value: Any) -> Any:
    """A copy of a call's tensor argument (or of a tuple of them) at new addresses."""
    if isinstance(value, tuple):
        return tuple(_copy(v) for v in value)
    return None if value is None else value.clone()


def _moved(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """A call that makes each of `calls` (the same call on different copies of its inputs) in turn and
    keeps the results of the last `len(calls)`: each call's inputs and outputs are at addresses the
    previous one's were not."""
    kept: collections.deque = collections.deque(maxlen=len(calls))
    turns = itertools.cycle(calls)

    def call() -> Any:
        result = next(turns)()
        kept.append(result)
        return result

    return call


def _graph_ab(steady: Any, call: Callable[[], Any], moved: Callable[[], Any], align: Callable[[], None],
              drain: Callable[[], None], config: BenchConfig) -> dict:  # fmt: skip
    """The host wall and moved wall of `call`, replays launched as graphs then kernel by kernel, in
    `config.host_graph_ab_rounds` rounds that alternate which goes first (collective): per mode, the
    median over rounds of each round's median, and the ratio graphs / kernel by kernel. The machine's
    drift between runs is why the two are timed in one process, round by round."""
    walls: dict[str, list[float]] = {"graphs": [], "kernels": [], "graphs_moved": [], "kernels_moved": []}
    was_on = steady.use_graphs
    try:
        for index in range(config.host_graph_ab_rounds):
            for on in (True, False) if index % 2 == 0 else (False, True):
                steady.set_graphs(on)
                mode = "graphs" if on else "kernels"
                walls[mode].append(_time_call(call, align, drain, config.num_warmups, config.num_iters)["host_wall_us"])
                walls[f"{mode}_moved"].append(
                    _time_call(moved, align, drain, config.num_warmups, config.num_iters)["host_wall_us"]
                )
    finally:
        steady.set_graphs(was_on)
    medians = {f"{mode}_us": statistics.median(values) for mode, values in walls.items()}
    medians["ratio"] = medians["graphs_us"] / medians["kernels_us"]
    medians["ratio_moved"] = medians["graphs_moved_us"] / medians["kernels_moved_us"]
    return medians


def _soak(call: Callable[[], Any], align: Callable[[], None], drain: Callable[[], None], num_calls: int,
          on_gpu: bool) -> dict:  # fmt: skip
    """`num_calls` more calls (collective), drained every 100: the device memory allocated before and
    after them, and the peak between (the caching allocator's counters; 0 on CPU ranks)."""
    align()
    drain()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    for index in range(num_calls):
        call()
        if index % 100 == 99:
            drain()
    drain()
    after = torch.cuda.memory_allocated() if on_gpu else 0
    peak = torch.cuda.max_memory_allocated() if on_gpu else 0
    return dict(soak_calls=num_calls, soak_allocated_before=before, soak_allocated_after=after, soak_peak=peak)


def _graph_times_us(buffer: Any, inputs: tuple, rows: torch.Tensor, kwargs: dict, config: BenchConfig,
                    group: dist.ProcessGroup, align: Callable[[], None]) -> dict[str, float]:  # fmt: skip
    """Device microseconds per call of the capturable operations (collective; GPUs)."""
    from .runner import calls_per_graph, capture_moe_ops
    from .timing import agree_on_replays, release_captured, time_graphs

    x, topk_idx, weights = inputs
    handle = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, do_cpu_sync=False, **kwargs)[3]
    calls = calls_per_graph(kwargs["num_max_tokens_per_rank"])
    ops = capture_moe_ops(buffer, [inputs], [rows], [handle], kwargs, calls, group)
    try:
        times = {name: time_graphs(op, agree_on_replays(op, align, group), config.num_graph_samples, align) * 1e6
                 for name, op in ops.items()}  # fmt: skip
    finally:
        release_captured(list(ops.values()), lambda: dist.barrier(group=group))
    return {host_op: times[graph_op] for host_op, graph_op in GRAPH_OPS.items()}


def _check_against_reference(case: BenchCase, buffer: Any, out: tuple, x: Any, routed: dict,
                             recv_rows: torch.Tensor, group: dist.ProcessGroup) -> None:  # fmt: skip
    """Raise `AssertionError` unless `buffer`'s dispatch `out` of `x` and a combine of its handle are
    bitwise what `deep_ep.reference` gives (collective)."""
    import deep_ep

    from .runner import check_combine, check_dispatch

    reference = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                                      num_topk=case.num_topk, use_fp8_dispatch=case.fp8_dispatch,
                                      backend="reference", explicitly_destroy=True)  # fmt: skip
    try:
        ref_out = reference.dispatch(x, **routed)
        what = f"T={case.num_tokens} {case.dtype} {case.routing}, host bench"
        check_dispatch(out, ref_out, out[3].num_recv_tokens, f"{what} dispatch")
        check_combine(buffer.combine(recv_rows, out[3])[0], reference.combine(recv_rows, ref_out[3])[0],
                      f"{what} combine")  # fmt: skip
    finally:
        reference.destroy()


def _host_case(case: BenchCase, buffer: Any, rank: int, group: dist.ProcessGroup, config: BenchConfig) -> list[dict]:
    """One case on one rank: a row per operation with this rank's medians (collective)."""
    num_ranks, device = group.size(), config.device
    on_gpu = device == "cuda"

    def align() -> None:
        if on_gpu:
            buffer.barrier()
            wait_for_stream()
        else:
            dist.barrier(group=group)

    x, topk_idx, weights = make_inputs(case, rank, num_ranks, device, config.seed, config.hot_fraction)
    kwargs = dict(num_experts=case.num_experts, num_max_tokens_per_rank=case.num_tokens, num_sms=0)
    routed = dict(topk_idx=topk_idx, topk_weights=weights, **kwargs)
    out = buffer.dispatch(x, **routed)
    handle = out[3]
    expert_rows = random_rows(num_ranks * case.num_tokens, case.hidden, device, config.seed * 7 + rank)
    recv_rows = expert_rows[: handle.num_recv_tokens]
    if on_gpu:  # what is timed is first checked against the reference (on CPU ranks it is the reference)
        _check_against_reference(case, buffer, out, x, routed, recv_rows, group)

    def op_calls(x: Any, topk_idx: Any, weights: Any, rows: torch.Tensor) -> dict[str, Callable[[], Any]]:
        """The timed calls on these inputs (the given ones, or copies of them at other addresses)."""
        routed = dict(topk_idx=topk_idx, topk_weights=weights, **kwargs)
        return {
            "dispatch_no_sync": lambda: buffer.dispatch(x, do_cpu_sync=False, **routed),
            "dispatch_cpu_sync": lambda: buffer.dispatch(x, **routed),
            "cached_dispatch": lambda: buffer.dispatch(x, handle=handle),
            "combine": lambda: buffer.combine(rows, handle),
        }

    calls = op_calls(x, topk_idx, weights, recv_rows)
    copies = [op_calls(*map(_copy, (x, topk_idx, weights, recv_rows))) for _ in range(NUM_MOVED)]
    drain = wait_for_stream if on_gpu else lambda: None  # CPU ranks: every call returns done
    steady = getattr(buffer, "_steady", None)  # the kernels' replays of recorded shapes

    def graph_updates() -> tuple[int, int]:
        stats = dict(launches=0, updates=0) if steady is None else steady.graph_stats()
        return stats["launches"], stats["updates"]

    runtime = getattr(buffer.backend, "runtime", None)  # the kernels' (its host waits for counts)

    def served() -> tuple[int, dict[str, int], int, int]:
        waits = (0, 0) if runtime is None else (runtime.num_counts_waits, runtime.counts_wait_ns)
        return (0, {}, *waits) if steady is None else (steady.num_calls, steady.phase_ns(), *waits)

    # The machine's floor in this run (an allocation the size of an FP8 `recv_x`), before the calls
    floor = host_floor.measure_floor(on_gpu, num_ranks * case.num_tokens * case.hidden,
                                     lambda: _time_call(lambda: None, align, drain, config.num_warmups,
                                                        config.num_iters)["host_wall_us"])  # fmt: skip
    times = {}
    for op in HOST_OPS:
        calls_before, phases_before, waits_before, wait_ns_before = served()
        graphs_before = graph_updates()
        times[op] = _time_call(calls[op], align, drain, config.num_warmups, config.num_iters)
        calls_after, phases_after, waits_after, wait_ns_after = served()
        graphs_after = graph_updates()
        moved = _time_call(_moved([c[op] for c in copies]), align, drain, config.num_warmups, config.num_iters)
        graphs_moved = graph_updates()
        times[op]["host_wall_moved_us"] = moved["host_wall_us"]
        # Graph launches and node parameter updates of the replays' programs over the num_warmups +
        # num_iters calls (as `steady_calls`), then over as many moved calls
        times[op]["graphs"] = {
            "launches": graphs_after[0] - graphs_before[0],
            "updates": graphs_after[1] - graphs_before[1],
            "moved_launches": graphs_moved[0] - graphs_after[0],
            "moved_updates": graphs_moved[1] - graphs_after[1],
        }
        # The host's wait for a CPU-sync dispatch's counts (its count phase as the host sees it: from
        # the kernel's launch to the counts in host memory), mean microseconds per call that waited
        num_waits = waits_after - waits_before
        times[op]["count_wait_us"] = (wait_ns_after - wait_ns_before) / 1e3 / num_waits if num_waits else None
        times[op].update(floor)
        times[op]["steady_calls"] = calls_after - calls_before  # of num_warmups + num_iters
        # Inside the C++ replays (deep_ep.backends.kernels.steady.PHASES), microseconds per call
        times[op]["steady_phase_us"] = (
            {
                name: (ns - phases_before.get(name, 0)) / 1e3 / times[op]["steady_calls"]
                for name, ns in phases_after.items()
            }
            if times[op]["steady_calls"]
            else None
        )
        if config.host_graph_ab_rounds and steady is not None and steady.graphs_refused is None:
            times[op]["graph_ab"] = _graph_ab(steady, calls[op], _moved([c[op] for c in copies]), align, drain, config)
        if config.host_soak_calls:
            times[op].update(_soak(calls[op], align, drain, config.host_soak_calls, on_gpu))
    profiles = {}
    if config.host_profile:  # after the timed calls: the profiler's hooks must not slow those
        profiles = {op: host_profile.profile_calls(calls[op], align, config.num_iters, rank == 0) for op in HOST_OPS}
    backend_name = type(buffer.backend).__name__
    gpu = {}
    if config.graphs and on_gpu and backend_name == "NvlinkBackend":
        gpu = _graph_times_us(buffer, (x, topk_idx, weights), expert_rows, kwargs, config, group, align)
    shape = dict(num_tokens=case.num_tokens, dtype=case.dtype, routing=case.routing, hidden=case.hidden,
                 num_topk=case.num_topk, num_experts=case.num_experts)  # fmt: skip
    if rank == 0:
        walls = ", ".join(f"{op} {times[op]['host_wall_us']:.1f} us, moved {times[op]['host_wall_moved_us']:.1f} "
                          f"({times[op]['steady_calls']} steady)" for op in HOST_OPS)  # fmt: skip
        print(f"host cost, T={case.num_tokens} {case.dtype} {case.routing}: {walls}", file=sys.stderr, flush=True)
        print(f"  {host_floor.format_floor('this rank', floor)}", file=sys.stderr, flush=True)
        for op in HOST_OPS:
            if times[op]["steady_phase_us"]:
                phases = ", ".join(f"{name} {us:.1f}" for name, us in times[op]["steady_phase_us"].items())
                print(f"  {op} in C++ (us per call): {phases}", file=sys.stderr, flush=True)
            graphs = ", ".join(f"{name} {n}" for name, n in times[op]["graphs"].items())
            print(f"  {op} graphs in {config.num_warmups + config.num_iters} calls each: {graphs}", file=sys.stderr,
                  flush=True)  # fmt: skip
        for op in HOST_OPS:
            if "graph_ab" in times[op]:
                ab = times[op]["graph_ab"]
                print(f"  {op} graphs / kernel by kernel over {config.host_graph_ab_rounds} rounds: "
                      f"{ab['graphs_us']:.1f} / {ab['kernels_us']:.1f} us ({ab['ratio']:.2f}), moved "
                      f"{ab['graphs_moved_us']:.1f} / {ab['kernels_moved_us']:.1f} us ({ab['ratio_moved']:.2f})",
                      file=sys.stderr, flush=True)  # fmt: skip
        if config.host_soak_calls:
            grown = ", ".join(f"{op} {times[op]['soak_allocated_after'] - times[op]['soak_allocated_before']:+d} B"
                              for op in HOST_OPS)  # fmt: skip
            print(f"memory after {config.host_soak_calls} more calls each: {grown}", file=sys.stderr, flush=True)
    return [dict(case=shape, op=op, rank=rank, backend=backend_name, gpu_us=gpu.get(op), profile=profiles.get(op),
                 **times[op]) for op in HOST_OPS]  # fmt: skip


def host_rank(rank: int, group: dist.ProcessGroup, config: BenchConfig) -> list[dict]:
    """Every host case on this rank of `group`: one row per (case, operation) with this rank's medians."""
    import deep_ep

    rows = []
    for case in host_cases(config):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                                       num_topk=case.num_topk, use_fp8_dispatch=case.fp8_dispatch,
                                       explicitly_destroy=True)  # fmt: skip
        try:
            rows += _host_case(case, buffer, rank, group, config)
        finally:
            if config.device == "cuda":
                wait_for_stream()
            buffer.destroy()
    return rows


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (case, operation): each time field is the slowest rank's median (`None` when no
    rank measured it), with the target where issue 19 sets one (for the kernels, not the reference),
    and the first rank's profile (`None` without `--profile`)."""
    summary = []
    for same in zip(*per_rank, strict=True):
        row = {k: v for k, v in same[0].items() if k not in (*HOST_FIELDS, "rank")}
        for name in HOST_FIELDS:
            values = [r[name] for r in same if r[name] is not None]
            row[name] = max(values) if values else None
        target = HOST_TARGETS_US.get(row["op"])
        if row["op"] == "dispatch_cpu_sync" and row["count_wait_us"] is not None:
            target = row["count_wait_us"] + CPU_SYNC_TARGET_US
        row["host_target_us"] = target if row["backend"] == "NvlinkBackend" else None
        summary.append(row)
    return summary


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_table(rows: list[dict], hardware: str, virtual_ranks: bool) -> str:
    lines = []
    if virtual_ranks:
        lines.append(report.VIRTUAL_RANKS_NOTE)
        lines.append("")
    lines.append(f"host cost per call ({hardware}; slowest rank's median):")
    header = (f"{'T':>6} {'dtype':>5} {'routing':>10} {'operation':>18} | {'host wall us':>12} {'moved us':>8} "
              f"{'host CPU us':>11} {'eager wall us':>13} {'release us':>10} {'GPU us':>8} {'count wait us':>13} | "
              f"{'target us (wall/moved)':>24}")  # fmt: skip
    lines += [header, "-" * len(header)]
    for r in rows:
        c = r["case"]
        target = r["host_target_us"]
        verdict = ""
        if target is not None:
            verdict = "/".join(
                "met" if r[name] <= target else "missed" for name in ("host_wall_us", "host_wall_moved_us")
            )
            verdict = f"{target:.0f} {verdict}"
        lines.append(f"{c['num_tokens']:>6} {c['dtype']:>5} {c['routing']:>10} {r['op']:>18} | "
                     f"{_us(r['host_wall_us']):>12} {_us(r['host_wall_moved_us']):>8} {_us(r['host_cpu_us']):>11} "
                     f"{_us(r['eager_wall_us']):>13} {_us(r['release_us']):>10} "
                     f"{_us(r['gpu_us']):>8} {_us(r['count_wait_us']):>13} | {verdict:>24}")  # fmt: skip
    lines.append("")
    labels = {f"T={r['case']['num_tokens']} {r['case']['dtype']} {r['case']['routing']}": r for r in rows}
    lines += [host_floor.format_floor(label, r) for label, r in labels.items()]  # a case's rows share its floor
    lines.append("")
    lines.append(HOST_COLUMNS)
    return "\n".join(lines)


def run_host(config: BenchConfig, json_path: str | None = None, command: str | None = None) -> list[dict]:
    """Spawn the ranks, measure every host case, print the table and write the JSON when asked."""
    from .runner import run_ranks

    hardware = report.hardware_name(config.device, config.num_ranks, config.virtual_ranks)
    print(f"deep-ep bench --host: {len(host_cases(config))} case(s) x {len(HOST_OPS)} operations on {hardware}, "
          f"seed {config.seed}", file=sys.stderr, flush=True)  # fmt: skip
    per_rank = run_ranks(host_rank, config)
    rows = summarize(per_rank)
    print(format_table(rows, hardware, config.virtual_ranks))
    for row in rows:
        if row["profile"] is not None:
            c = row["case"]
            print(host_profile.format_profile(row["op"], f"T={c['num_tokens']} {c['dtype']} {c['routing']}",
                                              row["profile"]))  # fmt: skip
    print(f"measured: {report.provenance(command, hardware)}")
    if json_path:
        document = dict(commit=report.git_commit(), command=command or " ".join(sys.argv), hardware=hardware,
                        date=report.utc_now(), num_ranks=config.num_ranks, virtual_ranks=config.virtual_ranks,
                        torch=torch.__version__, seed=config.seed, num_iters=config.num_iters,
                        num_warmups=config.num_warmups, multi_rank_rule="the slowest rank's median per field",
                        steady_graphs=graphs_enabled(),
                        columns=HOST_COLUMNS, results=rows, per_rank=per_rank)  # fmt: skip
        Path(json_path).write_text(json.dumps(document, indent=2) + "\n")
    return rows
