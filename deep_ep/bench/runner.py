"""`deep-ep bench`: dispatch/combine timed against the torch all-to-all path and the NVLink speed of light.

Runs on whatever is present: all local GPUs with the NVLink kernels; with one GPU, virtual ranks on
it (`deep_ep.loopback`: the same kernels, every window in one GPU's memory, so times show the
kernels' own cost, not NVLink); or 2 CPU ranks (gloo) with the reference backend. Every case is
checked bitwise against `deep_ep.reference` before it is timed (on GPUs also the first replay of
every captured graph). Per case, on GPUs:

- eager: a dispatch with CPU sync (exact shapes), then a combine of its handle; medians over
  barrier-aligned iterations with CUDA events, inputs rotated (`timing.time_eager`);
- graph: the device time of the whole kernel sequence, from CUDA-graph replays of a fresh dispatch
  without CPU sync, a cached dispatch (`handle=`) and a combine (`timing.time_graphs`). This is the
  kernel time of the bandwidth convention (design section 6);
- torch: the `all_to_all_single` path a user would write (same dtype, same routing), eager.

Each (tokens, dispatch dtype) runs on its own `ElasticBuffer` sized for it
(`num_max_tokens_per_rank` = tokens), so `num_sms=0` is what `get_theoretical_num_sms` picks for
exactly that shape. The speed of light is our peer-store probe on all SMs, every rank writing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..host_reads import host_list, wait_for_stream
from ..utils.spawn import spawn_ranks
from . import report
from .cases import BenchCase, BenchConfig, make_inputs, payload_bytes, random_rows, records_per_rank
from .timing import (
    CapturedOp,
    agree_on_replays,
    capture,
    kernel_breakdown,
    release_captured,
    time_eager,
    time_graphs,
)
from .torch_path import torch_combine, torch_dispatch


@dataclass
class KeyState:
    """What the cases of one key (everything but the SM count) share on one rank."""

    rotations: list[tuple[Any, torch.Tensor, torch.Tensor]]
    rows: list[torch.Tensor]  # per rotation: [N * T, H] BF16 expert outputs (combine inputs)
    ref_out: Any = None  # the reference's dispatch of rotation 0 (CPU sync)
    ref_combined: torch.Tensor | None = None  # the reference's combine of rotation 0's rows
    num_recv: int = 0  # rows the reference received for rotation 0
    traffic: dict = field(default_factory=dict)
    torch_us: tuple[float, float] | None = None


def calls_per_graph(num_tokens: int) -> int:
    """Calls captured back to back in one graph: several for small T, so replay launches stay hidden."""
    return max(1, min(8, 4096 // max(1, num_tokens)))


# ------------------------------------------------------------------------------------------ checks


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _equal_rows(a: torch.Tensor, b: torch.Tensor, num_rows: int) -> bool:
    a, b = a[:num_rows], b[:num_rows]
    if a.element_size() == 1:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return a.shape == b.shape and torch.equal(a, b)


def check_dispatch(out: Any, ref_out: Any, num_recv: int, what: str, full: bool = True) -> None:
    """Raise `AssertionError` unless `out` (a dispatch's return tuple) holds the reference's rows.

    Compares the first `num_recv` rows of `recv_x` (and scales); with `full`, also the received
    top-k ids and weights, the per-rank prefix sums and the per-expert counts.
    """
    for a, b in zip(_as_tuple(out[0]), _as_tuple(ref_out[0]), strict=True):
        if not _equal_rows(a, b, num_recv):
            raise AssertionError(f"{what}: recv_x differs from deep_ep.reference")
    if not full:
        return
    for index, name in ((1, "recv_topk_idx"), (2, "recv_topk_weights")):
        if (out[index] is None) != (ref_out[index] is None):
            raise AssertionError(f"{what}: {name} is None on one side only")
        if out[index] is not None and not _equal_rows(out[index], ref_out[index], num_recv):
            raise AssertionError(f"{what}: {name} differs from deep_ep.reference")
    handle, ref_handle = out[3], ref_out[3]
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "num_unaligned_recv_tokens_per_expert"):
        if not torch.equal(getattr(handle, name).cpu(), getattr(ref_handle, name).cpu()):
            raise AssertionError(f"{what}: handle.{name} differs from deep_ep.reference")


def check_combine(combined: torch.Tensor, ref_combined: torch.Tensor, what: str) -> None:
    if not torch.equal(combined, ref_combined):
        raise AssertionError(f"{what}: combine differs from deep_ep.reference")


# ------------------------------------------------------------------------------------------ per case


def _key_state(case: BenchCase, reference: Any, rank: int, num_ranks: int, config: BenchConfig,
               group: dist.ProcessGroup, align: Callable[[], None]) -> KeyState:  # fmt: skip
    """Inputs, the reference's results and the torch path's times of one key."""
    device = config.device
    rotations = [
        make_inputs(case, rank, num_ranks, device, config.seed + r, config.hot_fraction)
        for r in range(config.num_rotations)
    ]
    rows = [
        random_rows(num_ranks * case.num_tokens, case.hidden, device, config.seed * 7 + r * 101 + rank)
        for r in range(config.num_rotations)
    ]
    state = KeyState(rotations, rows)
    x, topk_idx, weights = rotations[0]
    state.ref_out = reference.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=case.num_experts,
                                       num_max_tokens_per_rank=case.num_tokens)  # fmt: skip
    state.num_recv = int(state.ref_out[3].psum_num_recv_tokens_per_scaleup_rank[-1])
    state.ref_combined = reference.combine(rows[0][: state.num_recv], state.ref_out[3])[0]

    hits = records_per_rank(topk_idx, case.num_experts, num_ranks)
    state.traffic = dict(num_records=sum(hits), num_wire_records=sum(hits) - hits[rank],
                         dispatch_bytes=payload_bytes(x, case.num_topk), combine_bytes=case.hidden * 2)  # fmt: skip

    # The torch all-to-all path (independent of the SM count)
    t_dispatch = time_eager(lambda a: torch_dispatch(a[0], a[1], case.num_experts, group), rotations,
                            config.num_warmups, config.num_iters, align, device)  # fmt: skip
    torch_state = [torch_dispatch(a[0], a[1], case.num_experts, group) for a in rotations]
    torch_inputs = [
        (random_rows(sum(s[3]), case.hidden, device, config.seed + i), s) for i, s in enumerate(torch_state)
    ]
    t_combine = time_eager(lambda a: torch_combine(a[0], a[1][1], a[1][2], a[1][3], case.num_tokens, group),
                           torch_inputs, config.num_warmups, config.num_iters, align, device)  # fmt: skip
    state.torch_us = (t_dispatch * 1e6, t_combine * 1e6)
    return state


def capture_moe_ops(buffer: Any, rotations: list, rows: list, handles: list, kwargs: dict, calls: int,
                    group: dist.ProcessGroup) -> dict[str, CapturedOp]:  # fmt: skip
    """CUDA graphs of a fresh dispatch without CPU sync, a cached dispatch (`handle=`) and a combine,
    one graph per input set `r`: `rotations[r]` = `(x, topk_idx, topk_weights)`, `rows[r]` the combine
    input, `handles[r]` a no-sync handle of `rotations[r]`; `kwargs` holds `num_experts`,
    `num_max_tokens_per_rank` and `num_sms`. Collective over `group`."""
    num_sms = kwargs["num_sms"]

    def fresh(r: int) -> Any:
        x, topk_idx, weights = rotations[r]
        return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, do_cpu_sync=False, **kwargs)

    def cached(r: int) -> Any:
        return buffer.dispatch(rotations[r][0], handle=handles[r], num_sms=num_sms)

    def combine(r: int) -> Any:
        return buffer.combine(rows[r], handles[r], num_sms=num_sms)

    ops: dict[str, CapturedOp] = {}
    try:
        for name, call in (("dispatch", fresh), ("cached_dispatch", cached), ("combine", combine)):
            ops[name] = capture(call, len(rotations), calls, host_barrier=lambda: dist.barrier(group=group))
    except BaseException:
        for op in ops.values():
            op.release()
        raise
    return ops


def _graph_times(case: BenchCase, ours: Any, state: KeyState, num_sms: int, config: BenchConfig,
                 group: dist.ProcessGroup, align: Callable[[], None]) -> dict:  # fmt: skip
    """Capture fresh (no CPU sync) and cached dispatches and combines, check their first replays
    against the reference, and time their replays."""
    kwargs = dict(num_experts=case.num_experts, num_max_tokens_per_rank=case.num_tokens, num_sms=num_sms)
    rotations = state.rotations[: max(1, config.num_graph_rotations)]
    handles = [
        ours.dispatch(x, topk_idx=topk_idx, topk_weights=weights, do_cpu_sync=False, **kwargs)[3]
        for x, topk_idx, weights in rotations
    ]
    calls = calls_per_graph(case.num_tokens)
    ops = capture_moe_ops(ours, rotations, state.rows, handles, kwargs, calls, group)
    try:
        what = f"T={case.num_tokens} {case.dtype} {case.routing} SMs={num_sms}, graph replay of"
        check_dispatch(ops["dispatch"].replay_first(), state.ref_out, state.num_recv, f"{what} a fresh dispatch")
        check_dispatch(ops["cached_dispatch"].replay_first(), state.ref_out, state.num_recv,
                       f"{what} a cached dispatch", full=False)  # fmt: skip
        check_combine(ops["combine"].replay_first()[0], state.ref_combined, f"{what} a combine")
        times = {}
        for name, op in ops.items():
            num_replays = agree_on_replays(op, align, group)
            times[name] = time_graphs(op, num_replays, config.num_graph_samples, align) * 1e6
    except BaseException:
        for op in ops.values():
            op.release()
        raise
    release_captured(list(ops.values()), lambda: dist.barrier(group=group))
    return dict(graph_dispatch_us=times["dispatch"], graph_cached_dispatch_us=times["cached_dispatch"],
                graph_combine_us=times["combine"], graph_calls_per_replay=calls, graph_checked=True)  # fmt: skip


def _kernel_breakdowns(case: BenchCase, ours: Any, rank: int, num_ranks: int, config: BenchConfig,
                       group: dist.ProcessGroup, align: Callable[[], None]) -> dict:  # fmt: skip
    """Per-kernel device time per call of each captured operation, from the torch profiler. Runs after
    every timing of the run (the profiler's instrumentation must not touch a timed case)."""
    num_sms = ours.get_theoretical_num_sms(case.num_experts, case.num_topk)
    kwargs = dict(num_experts=case.num_experts, num_max_tokens_per_rank=case.num_tokens, num_sms=num_sms)
    rotations = [make_inputs(case, rank, num_ranks, config.device, config.seed + r, config.hot_fraction)
                 for r in range(max(1, config.num_graph_rotations))]  # fmt: skip
    rows = [random_rows(num_ranks * case.num_tokens, case.hidden, config.device, config.seed * 7 + r * 101 + rank)
            for r in range(len(rotations))]  # fmt: skip
    handles = [ours.dispatch(x, topk_idx=t, topk_weights=w, do_cpu_sync=False, **kwargs)[3] for x, t, w in rotations]
    ops = capture_moe_ops(ours, rotations, rows, handles, kwargs, calls_per_graph(case.num_tokens), group)
    try:
        breakdowns = {name: kernel_breakdown(op, min(agree_on_replays(op, align, group), 16), align)
                      for name, op in ops.items()}  # fmt: skip
    except BaseException:
        for op in ops.values():
            op.release()
        raise
    release_captured(list(ops.values()), lambda: dist.barrier(group=group))
    return breakdowns


def _bench_case(case: BenchCase, ours: Any, state: KeyState, rank: int, num_ranks: int, config: BenchConfig,
                group: dist.ProcessGroup, align: Callable[[], None]) -> dict:  # fmt: skip
    """Check one case against the reference, then time ours (eager, and graphs on GPUs) on this rank."""
    device = config.device
    planner_sms = ours.get_theoretical_num_sms(case.num_experts, case.num_topk)
    num_sms = case.num_sms or planner_sms
    kwargs = dict(num_experts=case.num_experts, num_max_tokens_per_rank=case.num_tokens, num_sms=num_sms)

    # Correctness first: our eager path against the reference, on the first rotation
    x, topk_idx, weights = state.rotations[0]
    out = ours.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **kwargs)
    what = f"T={case.num_tokens} {case.dtype} {case.routing} SMs={num_sms}"
    check_dispatch(out, state.ref_out, state.num_recv, f"{what}, eager dispatch")
    check_combine(ours.combine(state.rows[0][: state.num_recv], out[3], num_sms=num_sms)[0], state.ref_combined,
                  f"{what}, eager combine")  # fmt: skip

    # Eager: dispatch with CPU sync (exact shapes), then a combine of its handle
    def run_dispatch(inputs):
        ours.dispatch(inputs[0], topk_idx=inputs[1], topk_weights=inputs[2], **kwargs)

    t_dispatch = time_eager(run_dispatch, state.rotations, config.num_warmups, config.num_iters, align, device)
    combine_inputs = []
    for r, (x, topk_idx, _) in enumerate(state.rotations):
        handle = ours.dispatch(x, topk_idx=topk_idx, **kwargs)[3]
        combine_inputs.append((state.rows[r][: handle.num_recv_tokens], handle))
    t_combine = time_eager(lambda a: ours.combine(a[0], a[1], num_sms=num_sms), combine_inputs, config.num_warmups,
                           config.num_iters, align, device)  # fmt: skip

    row = dict(case=asdict(case), num_sms=num_sms, planner_num_sms=planner_sms,
               num_sms_source="planner" if case.num_sms == 0 else "sweep", backend=type(ours.backend).__name__,
               rank=rank, dispatch_us=t_dispatch * 1e6, combine_us=t_combine * 1e6,
               torch_dispatch_us=state.torch_us[0], torch_combine_us=state.torch_us[1], **state.traffic,
               graph_dispatch_us=None, graph_cached_dispatch_us=None, graph_combine_us=None,
               graph_calls_per_replay=None, graph_checked=False, kernel_breakdown=None)  # fmt: skip
    if _uses_graphs(config, row["backend"]):
        row.update(_graph_times(case, ours, state, num_sms, config, group, align))
    row.update(_prediction(case, num_sms, num_ranks, device, config.virtual_ranks))
    return row


def _uses_graphs(config: BenchConfig, backend_name: str) -> bool:
    """CUDA graphs run on GPUs with the NVLink kernels (the reference backend syncs with the host)."""
    return config.graphs and config.device == "cuda" and backend_name == "NvlinkBackend"


def _prediction(case: BenchCase, num_sms: int, num_ranks: int, device: str, virtual_ranks: bool) -> dict:
    """The planner's predicted graph times of this case at its SM count (uniform routing); none for
    virtual ranks (the planner models NVLink)."""
    from .. import planner

    if virtual_ranks:
        return dict(predicted_dispatch_us=None, predicted_combine_us=None)
    num_device_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
        if device == "cuda" else None  # fmt: skip
    shape = planner.MoEShape(case.num_tokens, case.hidden, case.num_topk, case.num_experts, case.fp8_dispatch)
    predicted = planner.plan(shape, num_ranks, num_ranks, hardware=planner.detect_hardware(num_device_sms),
                             num_sms=num_sms)  # fmt: skip
    return dict(predicted_dispatch_us=predicted.predicted_dispatch_us,
                predicted_combine_us=predicted.predicted_combine_us)  # fmt: skip


# ------------------------------------------------------------------------------------------ per rank


def _speed_of_light(buffer: Any, sms: list[int], config: BenchConfig, align: Callable[[], None],
                    host_barrier: Callable[[], None]) -> dict[int, float]:  # fmt: skip
    """GB/s per direction of our peer-store probe on each SM count, every rank writing at once."""
    from ..backends.kernels.runtime import peer_store

    runtime = buffer.backend.runtime
    num_bytes = min(256 << 20, (runtime.data_bytes - (1 << 20)) // 16 * 16)
    if config.virtual_ranks:  # every rank writes into one GPU's memory: about 2 GiB per iteration in all
        num_bytes = min(num_bytes, (2 << 30) // (runtime.num_ranks * (runtime.num_ranks - 1)) // 16 * 16)
    sources = [torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    # Every rank allocates before any rank's barrier kernel waits (an allocation can wait for the device)
    wait_for_stream()
    host_barrier()
    result = {}
    for num_sms in sms:
        seconds = time_eager(lambda src, m=num_sms: peer_store(runtime, torch.cuda.current_stream(), src, m),
                             sources, 2, max(3, config.num_iters // 3), align, "cuda")  # fmt: skip
        result[num_sms] = num_bytes * (runtime.num_ranks - 1) / seconds / 1e9
    return result


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(text, file=sys.stderr, flush=True)


# The fields of a row that differ between ranks (times and record counts)
PER_RANK_FIELDS = ("dispatch_us", "combine_us", "graph_dispatch_us", "graph_cached_dispatch_us", "graph_combine_us",
                   "torch_dispatch_us", "torch_combine_us", "num_records", "num_wire_records")  # fmt: skip


def gather_rows(row: dict, group: dist.ProcessGroup, device: str) -> list[dict]:
    """Every rank's version of `row` (collective): `row` with each rank's `PER_RANK_FIELDS`, so that the
    progress line can follow the multi-rank rule of the table (`report.summarize`)."""
    values = torch.tensor([math.nan if row[k] is None else float(row[k]) for k in PER_RANK_FIELDS],
                          dtype=torch.float64, device=device)  # fmt: skip
    gathered = [torch.empty_like(values) for _ in range(group.size())]
    dist.all_gather(gathered, values, group=group)
    rows = []
    for rank, tensor in enumerate(gathered):
        fields = {}
        for key, value in zip(PER_RANK_FIELDS, host_list(tensor), strict=True):  # polls: see deep_ep.host_reads
            fields[key] = None if math.isnan(value) else (int(value) if key.startswith("num_") else value)
        rows.append(dict(row, rank=rank, **fields))
    return rows


def bench_rank(rank: int, group: dist.ProcessGroup, config: BenchConfig) -> dict:
    """Run every case on this rank of `group`; returns `{"rows": [...], "meta": {...}}`."""
    import deep_ep

    from .. import planner

    num_ranks = group.size()
    device = config.device
    make = lambda backend, num_tokens, hidden, num_topk, fp8: deep_ep.ElasticBuffer(  # noqa: E731
        group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk, use_fp8_dispatch=fp8,
        backend=backend, explicitly_destroy=True)  # fmt: skip
    reference = None
    if device == "cuda":
        reference = make("reference", max(c.num_tokens for c in config.cases), max(c.hidden for c in config.cases),
                         max(c.num_topk for c in config.cases), True)  # fmt: skip

    # One buffer per (tokens, hidden, top-k, dispatch dtype), in the order the cases first use them
    buffer_keys = list(dict.fromkeys((c.num_tokens, c.hidden, c.num_topk, c.fp8_dispatch) for c in config.cases))
    largest = max(buffer_keys, key=lambda k: k[0] * k[1])
    rows: list[dict | None] = [None] * len(config.cases)
    meta: dict[str, Any] = dict(speed_of_light_gbs=None, speed_of_light_by_sms=None, num_device_sms=None,
                                planner_source=planner.HOPPER.source, virtual_ranks=config.virtual_ranks,
                                checked_against="itself" if reference is None else "deep_ep.reference")  # fmt: skip
    done = 0
    for buffer_key in buffer_keys:
        ours = make("auto", *buffer_key)
        oracle = reference if reference is not None else ours
        backend_name = type(ours.backend).__name__

        def align(buffer=ours) -> None:
            if device == "cuda":
                buffer.barrier()
            else:
                dist.barrier(group=group)

        states: dict[tuple, KeyState] = {}
        for index, case in enumerate(config.cases):
            if (case.num_tokens, case.hidden, case.num_topk, case.fp8_dispatch) != buffer_key:
                continue
            sms = "n/a" if backend_name == "ReferenceBackend" else (case.num_sms or "the planner's pick")
            graphs = " and graph replays" if _uses_graphs(config, backend_name) else ""
            _progress(rank, f"[{done + 1}/{len(config.cases)}] T={case.num_tokens} {case.dtype} {case.routing} "
                            f"SMs={sms}: checking against {meta['checked_against']}, then timing "
                            f"{config.num_iters} eager iterations{graphs}")  # fmt: skip
            if case.key not in states:
                states[case.key] = _key_state(case, oracle, rank, num_ranks, config, group, align)
            rows[index] = _bench_case(case, ours, states[case.key], rank, num_ranks, config, group, align)
            done += 1
            summary = report.summarize([[r] for r in gather_rows(rows[index], group, device)], meta)[0]
            _progress(rank, report.progress_line(done, len(config.cases), summary))
        if device == "cuda" and config.speed_of_light and backend_name == "NvlinkBackend" and buffer_key == largest:
            num_device_sms = ours.backend.runtime.num_device_sms
            sms = sorted({min(c.num_sms, num_device_sms) for c in config.cases if c.num_sms} | {num_device_sms})
            by_sms = _speed_of_light(ours, sms, config, align, lambda: dist.barrier(group=group))
            meta.update(speed_of_light_gbs=by_sms[num_device_sms], speed_of_light_by_sms=by_sms,
                        num_device_sms=num_device_sms)  # fmt: skip
            _progress(rank, f"speed of light (peer stores, {num_device_sms} SMs): {by_sms[num_device_sms]:.1f} GB/s")
        states.clear()
        ours.destroy()
        if device == "cuda" and not config.virtual_ranks:  # virtual ranks keep their allocator reserve
            torch.cuda.empty_cache()

    # Kernel breakdowns of the planner's cases, after every timing
    if config.breakdown:
        for buffer_key in buffer_keys:
            picked = [i for i, c in enumerate(config.cases) if c.num_sms == 0
                      and (c.num_tokens, c.hidden, c.num_topk, c.fp8_dispatch) == buffer_key]  # fmt: skip
            if not picked or not rows[picked[0]]["graph_checked"]:
                continue
            ours = make("auto", *buffer_key)
            try:
                for index in picked:
                    rows[index]["kernel_breakdown"] = _kernel_breakdowns(config.cases[index], ours, rank, num_ranks,
                                                                         config, group, ours.barrier)  # fmt: skip
                    case = config.cases[index]
                    _progress(rank, f"kernel breakdown, T={case.num_tokens} {case.dtype} {case.routing}: "
                                    f"{rows[index]['kernel_breakdown']}")  # fmt: skip
            finally:
                ours.destroy()
    if reference is not None:
        reference.destroy()
    return dict(rows=rows, meta=meta)


# ------------------------------------------------------------------------------------------ run


def _spawned_rank(rank: int, num_ranks: int, fn: Callable[..., Any], config: BenchConfig) -> Any:
    return fn(rank, dist.group.WORLD, config)


def run_ranks(fn: Callable[..., Any], config: BenchConfig) -> list[Any]:
    """`fn(rank, group, config)` on every rank of `config`, the results in rank order: threads of this
    process for virtual ranks, else a process per rank (NCCL on GPUs, gloo on CPU). `fn` is a
    module-level function (a spawned process imports it)."""
    if config.virtual_ranks:
        from ..loopback import LoopbackWorld

        with LoopbackWorld(config.num_ranks, 0 if config.device == "cuda" else "cpu", timeout_s=1800) as world:
            return world.run(fn, config)
    backend = "nccl" if config.device == "cuda" else "gloo"
    return spawn_ranks(_spawned_rank, config.num_ranks, backend=backend, args=(fn, config), timeout_s=1800)


def check_config(config: BenchConfig) -> None:
    """Refuse what cannot run, before any kernel is compiled (raises `ValueError` naming the option)."""
    if config.virtual_ranks and config.breakdown:
        raise ValueError(
            "bench: `--breakdown` needs one process per rank (the torch profiler sees a whole process), but on "
            "one GPU the ranks are virtual, threads of one process; run it on a machine with 2 or more GPUs"
        )


def run(config: BenchConfig, json_path: str | None = None, plot_path: str | None = None,
        command: str | None = None) -> list[dict]:  # fmt: skip
    """Spawn the ranks, run every case, print the tables and checks, and write the JSON / PNG when asked."""
    check_config(config)
    hardware = report.hardware_name(config.device, config.num_ranks, config.virtual_ranks)
    print(f"deep-ep bench: {len(config.cases)} case(s) on {hardware}, seed {config.seed}", file=sys.stderr, flush=True)
    per_rank = run_ranks(bench_rank, config)
    meta = dict(per_rank[0]["meta"], provenance=report.provenance(command, hardware))
    rows = report.summarize([r["rows"] for r in per_rank], meta)
    checks = report.checks(rows, config.virtual_ranks)
    print(report.format_report(rows, checks, meta))
    if json_path:
        report.write_json(json_path, rows, checks, meta, config, command, hardware)
    if plot_path:
        report.plot(rows, plot_path, meta, meta["provenance"])
    return rows
