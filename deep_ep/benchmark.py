"""`deep-ep bench`: dispatch/combine timed against the torch all-to-all path and the NVLink speed of light.

Runs on whatever is present: all local GPUs with the NVLink kernels, or 2 CPU ranks (gloo) with the
reference backend. Every case is checked against `deep_ep.reference` before it is timed. Times are
medians over many iterations after warm-up, each iteration aligned across ranks by a barrier, with
inputs rotated between iterations; on GPUs they come from CUDA events.

Bandwidth convention (design section 6): logical bytes are all (token, destination rank) records,
the rank's own included; wire bytes leave out the records a rank keeps for itself.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .utils.spawn import spawn_ranks


@dataclass(frozen=True)
class BenchCase:
    """One benchmarked MoE shape."""

    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    fp8_dispatch: bool
    num_sms: int = 0  # 0: the planner's choice


@dataclass
class BenchConfig:
    """What `deep-ep bench` runs."""

    cases: list[BenchCase]
    num_ranks: int
    device: str  # "cuda" or "cpu"
    num_warmups: int = 5
    num_iters: int = 30
    num_rotations: int = 3
    speed_of_light: bool = True
    seed: int = field(default_factory=lambda: time.time_ns() % 1_000_000)


def default_config(sms: list[int] | None = None, tokens: list[int] | None = None) -> BenchConfig:
    """DeepSeek-V3 shape on GPUs (T=8192/4096/128, H=7168, top-8, 256 experts, FP8 dispatch); a small
    shape on 2 CPU ranks."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        tokens = tokens or [8192, 4096, 128]
        sm_list = sms or [0]
        cases = [BenchCase(t, 7168, 8, 256, True, s) for t in tokens for s in sm_list]
        return BenchConfig(cases, torch.cuda.device_count(), "cuda")
    tokens = tokens or [512, 128]
    cases = [BenchCase(t, 1024, 4, 32, True, s) for t in tokens for s in (sms or [0])]
    return BenchConfig(cases, 2, "cpu", num_warmups=2, num_iters=5, num_rotations=2, speed_of_light=False)


# ------------------------------------------------------------------------------------------ timing


def _time_op(fn: Callable[[Any], Any], inputs: list[Any], config: BenchConfig, align: Callable[[], None]) -> float:
    """Median seconds of `fn(input)`, inputs rotated, every iteration barrier-aligned across ranks."""
    samples = []
    for i in range(config.num_warmups + config.num_iters):
        align()
        if config.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inputs[i % len(inputs)])
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            fn(inputs[i % len(inputs)])
            elapsed = time.perf_counter() - started
        if i >= config.num_warmups:
            samples.append(elapsed)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------ torch path


def _torch_dispatch(x: Any, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup):
    """What a user writes without this library: index, exchange counts, then all_to_all_single."""
    num_ranks = group.size()
    owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), -1)
    hits = torch.stack([(owner == d).any(dim=1) for d in range(num_ranks)])  # [N, T]
    send_idx = torch.cat([hits[d].nonzero().squeeze(1) for d in range(num_ranks)])
    send_counts = hits.sum(dim=1).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    tensors = x if isinstance(x, tuple) else (x,)
    received = []
    for tensor in tensors:
        payload = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
        out = payload.new_empty((sum(recv_splits), *payload.shape[1:]))
        dist.all_to_all_single(out, payload[send_idx].contiguous(), recv_splits, send_splits, group=group)
        received.append(out)
    return received, send_idx, send_splits, recv_splits


def _torch_combine(y: torch.Tensor, send_idx: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                   num_tokens: int, group: dist.ProcessGroup) -> torch.Tensor:  # fmt: skip
    """The reverse: all_to_all_single the rows back, then sum them per token in FP32."""
    back = y.new_empty((sum(send_splits), y.shape[1]))
    dist.all_to_all_single(back, y, send_splits, recv_splits, group=group)
    combined = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    combined.index_add_(0, send_idx, back.float())
    return combined.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ per rank


def _inputs(case: BenchCase, rank: int, num_ranks: int, device: str, seed: int):
    from .utils.fp8 import per_token_cast_to_fp8
    from .utils.routing import uniform_routing

    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    topk_idx, weights = uniform_routing(case.num_tokens, case.num_experts, case.num_topk, generator=gen, device=device)
    x = torch.randn((case.num_tokens, case.hidden), generator=gen).to(torch.bfloat16).to(device)
    return (per_token_cast_to_fp8(x) if case.fp8_dispatch else x), topk_idx, weights


def _payload_bytes(x: Any, num_topk: int) -> int:
    """Bytes one dispatched token carries: data, scales, top-k ids and weights (int32 + float)."""
    tensors = x if isinstance(x, tuple) else (x,)
    return sum(t[0].numel() * t.element_size() for t in tensors) + num_topk * 8


def _check(out_ours, out_ref, combined_ours, combined_ref) -> None:
    recv, recv_ref = out_ours[0], out_ref[0]
    num_recv = int(out_ref[3].psum_num_recv_tokens_per_scaleup_rank[-1])
    for a, b in zip(recv if isinstance(recv, tuple) else (recv,), recv_ref if isinstance(recv_ref, tuple) else (recv_ref,),
                    strict=True):  # fmt: skip
        a, b = a[:num_recv], b[:num_recv]
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        if not torch.equal(a, b):
            raise AssertionError("dispatch differs from deep_ep.reference")
    if not torch.equal(combined_ours, combined_ref):
        raise AssertionError("combine differs from deep_ep.reference")


def _bench_case(case: BenchCase, ours: Any, reference: Any, rank: int, num_ranks: int, config: BenchConfig,
                align: Callable[[], None]) -> dict:  # fmt: skip
    """Check one case against the reference, then time ours and the torch path on this rank."""
    group = dist.group.WORLD
    device = config.device
    backend_name = type(ours.backend).__name__
    num_sms = case.num_sms or ours.get_theoretical_num_sms(case.num_experts, case.num_topk)
    rotations = [_inputs(case, rank, num_ranks, device, config.seed + r) for r in range(config.num_rotations)]

    # Correctness first: our path against the reference, on the first rotation
    x, topk_idx, weights = rotations[0]
    kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=case.num_experts, num_sms=num_sms)
    out_ours = ours.dispatch(x, **kwargs)
    out_ref = reference.dispatch(x, **kwargs)
    y = torch.randn((out_ours[3].num_recv_tokens, case.hidden), device=device).to(torch.bfloat16)
    combined_ours = ours.combine(y, out_ours[3])[0]
    combined_ref = reference.combine(y, out_ref[3])[0]
    _check(out_ours, out_ref, combined_ours, combined_ref)

    # Traffic of this rank
    owner = torch.where(topk_idx >= 0, topk_idx // (case.num_experts // num_ranks), -1)
    hits = torch.stack([(owner == d).any(dim=1) for d in range(num_ranks)]).sum(dim=1).tolist()
    num_records, num_wire_records = sum(hits), sum(hits) - hits[rank]
    dispatch_bytes = _payload_bytes(x, case.num_topk)
    combine_bytes = case.hidden * 2

    # Ours: dispatch (CPU sync, exact shapes), then combine of its handle
    def run_dispatch(inputs):
        ours.dispatch(inputs[0], topk_idx=inputs[1], topk_weights=inputs[2], num_experts=case.num_experts,
                      num_sms=num_sms)  # fmt: skip

    t_dispatch = _time_op(run_dispatch, rotations, config, align)
    combine_inputs = []
    for inputs in rotations:
        handle = ours.dispatch(inputs[0], topk_idx=inputs[1], num_experts=case.num_experts, num_sms=num_sms)[3]
        combine_inputs.append(
            (torch.randn((handle.num_recv_tokens, case.hidden), device=device).to(torch.bfloat16), handle)
        )
    t_combine = _time_op(lambda a: ours.combine(a[0], a[1], num_sms=num_sms), combine_inputs, config, align)

    # The torch all-to-all path a user would write
    t_torch_dispatch = _time_op(lambda a: _torch_dispatch(a[0], a[1], case.num_experts, group), rotations,
                                config, align)  # fmt: skip
    torch_state = [_torch_dispatch(a[0], a[1], case.num_experts, group) for a in rotations]
    torch_inputs = [(torch.randn((sum(s[3]), case.hidden), device=device).to(torch.bfloat16), s) for s in torch_state]
    t_torch_combine = _time_op(
        lambda a: _torch_combine(a[0], a[1][1], a[1][2], a[1][3], case.num_tokens, group), torch_inputs, config,
        align)  # fmt: skip

    return dict(
        case=asdict(case), num_sms=num_sms, backend=backend_name, rank=rank,
        dispatch_us=t_dispatch * 1e6, combine_us=t_combine * 1e6,
        torch_dispatch_us=t_torch_dispatch * 1e6, torch_combine_us=t_torch_combine * 1e6,
        dispatch_logical_gbs=num_records * dispatch_bytes / t_dispatch / 1e9,
        dispatch_wire_gbs=num_wire_records * dispatch_bytes / t_dispatch / 1e9,
        combine_logical_gbs=num_records * combine_bytes / t_combine / 1e9,
        combine_wire_gbs=num_wire_records * combine_bytes / t_combine / 1e9,
        num_records=num_records, num_wire_records=num_wire_records,
    )  # fmt: skip


def _bench_rank(rank: int, num_ranks: int, config: BenchConfig) -> list[dict]:
    import deep_ep

    group = dist.group.WORLD
    device = config.device
    max_tokens = max(c.num_tokens for c in config.cases)
    hidden = max(c.hidden for c in config.cases)
    num_topk = max(c.num_topk for c in config.cases)
    make = lambda backend: deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max_tokens, hidden=hidden,  # noqa: E731
                                                 num_topk=num_topk, use_fp8_dispatch=True, backend=backend,
                                                 explicitly_destroy=True)  # fmt: skip
    ours = make("auto")
    reference = make("reference") if device == "cuda" else ours
    backend_name = type(ours.backend).__name__

    def align() -> None:
        if device == "cuda":
            ours.barrier()
        else:
            dist.barrier(group=group)

    results = [_bench_case(case, ours, reference, rank, num_ranks, config, align) for case in config.cases]

    sol = None
    if device == "cuda" and config.speed_of_light and backend_name == "NvlinkBackend":
        sol = _speed_of_light(ours, config, align)
    ours.destroy()
    if reference is not ours:
        reference.destroy()
    return [dict(r, speed_of_light_gbs=sol) for r in results]


def _speed_of_light(buffer: Any, config: BenchConfig, align: Callable[[], None]) -> float:
    """GB/s per direction of our peer-store kernel on all SMs, every rank writing at once."""
    from .nvlink import peer_store

    runtime = buffer.backend.runtime
    num_bytes = min(256 << 20, (runtime.window.num_bytes - (1 << 20)) // 16 * 16)
    sources = [torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    stream = torch.cuda.current_stream()
    seconds = _time_op(lambda src: peer_store(runtime, stream, src, runtime.num_device_sms), sources, config, align)
    return num_bytes * (runtime.num_ranks - 1) / seconds / 1e9


# ------------------------------------------------------------------------------------------ report


def _git_commit() -> str:
    # A copy of the tree without .git (e.g. on a lent GPU machine) names its commit in EP_BENCH_COMMIT
    if os.environ.get("EP_BENCH_COMMIT"):
        return os.environ["EP_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _hardware(device: str, num_ranks: int) -> str:
    if device == "cuda":
        return f"{num_ranks}x {torch.cuda.get_device_name(0)}"
    return f"{num_ranks} CPU ranks (gloo) on {platform.processor() or platform.machine()}"


def summarize(per_rank: list[list[dict]], config: BenchConfig) -> list[dict]:
    """One row per case: the slowest rank's times, the mean bandwidth over ranks, and the ratios."""
    rows = []
    for case_rows in zip(*per_rank, strict=True):
        row = dict(case_rows[0])
        row.pop("rank")
        for key in ("dispatch_us", "combine_us", "torch_dispatch_us", "torch_combine_us"):
            row[key] = max(r[key] for r in case_rows)
        for key in ("dispatch_logical_gbs", "dispatch_wire_gbs", "combine_logical_gbs", "combine_wire_gbs"):
            row[key] = statistics.mean(r[key] for r in case_rows)
        row["dispatch_speedup_vs_torch"] = row["torch_dispatch_us"] / row["dispatch_us"]
        row["combine_speedup_vs_torch"] = row["torch_combine_us"] / row["combine_us"]
        sol = row.get("speed_of_light_gbs")
        row["dispatch_wire_vs_sol"] = row["dispatch_wire_gbs"] / sol if sol else None
        row["combine_wire_vs_sol"] = row["combine_wire_gbs"] / sol if sol else None
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    header = (f"{'T':>6} {'H':>5} {'fp8':>4} {'SMs':>4} | {'dispatch us':>11} {'log GB/s':>8} {'wire GB/s':>9} | "
              f"{'combine us':>10} {'log GB/s':>8} {'wire GB/s':>9} | {'torch d/c us':>17} {'x torch d/c':>11} | "
              f"{'SoL GB/s':>8} {'%SoL d/c':>9}")  # fmt: skip
    lines = [header, "-" * len(header)]
    for r in rows:
        c = r["case"]
        sol = r.get("speed_of_light_gbs")
        sol_text = f"{sol:8.1f}" if sol else f"{'n/a':>8}"
        pct = f"{100 * r['dispatch_wire_vs_sol']:4.0f}/{100 * r['combine_wire_vs_sol']:<4.0f}" if sol else f"{'n/a':>9}"
        lines.append(
            f"{c['num_tokens']:>6} {c['hidden']:>5} {'yes' if c['fp8_dispatch'] else 'no':>4} {r['num_sms']:>4} | "
            f"{r['dispatch_us']:>11.1f} {r['dispatch_logical_gbs']:>8.1f} {r['dispatch_wire_gbs']:>9.1f} | "
            f"{r['combine_us']:>10.1f} {r['combine_logical_gbs']:>8.1f} {r['combine_wire_gbs']:>9.1f} | "
            f"{r['torch_dispatch_us']:>8.1f}/{r['torch_combine_us']:<8.1f} "
            f"{r['dispatch_speedup_vs_torch']:>5.2f}/{r['combine_speedup_vs_torch']:<5.2f} | {sol_text} {pct}"
        )  # fmt: skip
    return "\n".join(lines)


def run(config: BenchConfig, json_path: str | None = None, plot_path: str | None = None,
        command: str | None = None) -> list[dict]:  # fmt: skip
    """Spawn the ranks, run every case, print the table, and write the JSON / PNG when asked."""
    backend = "nccl" if config.device == "cuda" else "gloo"
    print(f"deep-ep bench: {len(config.cases)} case(s) on {_hardware(config.device, config.num_ranks)}, "
          f"seed {config.seed}", file=sys.stderr)  # fmt: skip
    per_rank = spawn_ranks(_bench_rank, config.num_ranks, backend=backend, args=(config,), timeout_s=1800)
    rows = summarize(per_rank, config)
    print(format_table(rows))
    if json_path:
        document = dict(
            commit=_git_commit(), command=command or " ".join(sys.argv), hardware=_hardware(config.device, config.num_ranks),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch=torch.__version__, seed=config.seed, num_iters=config.num_iters, results=rows,
        )  # fmt: skip
        Path(json_path).write_text(json.dumps(document, indent=2) + "\n")
    if plot_path:
        plot(rows, plot_path)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """Bandwidth vs tokens, and bandwidth vs SM count (the planner's pick marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_sms) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("dispatch_logical_gbs", "dispatch"), ("combine_logical_gbs", "combine")):
        points = sorted((r["case"]["num_tokens"], r[key]) for r in rows if r["case"]["num_sms"] == 0)
        if points:
            by_tokens.plot(*zip(*points, strict=True), marker="o", label=label)
        swept = sorted((r["num_sms"], r[key]) for r in rows if r["case"]["num_sms"] != 0)
        if swept:
            by_sms.plot(*zip(*swept, strict=True), marker="o", label=label)
        picked = [(r["num_sms"], r[key]) for r in rows if r["case"]["num_sms"] == 0]
        if picked:
            by_sms.scatter(*zip(*picked, strict=True), marker="*", s=160, label=f"{label}, planner's pick")
    sol = next((r["speed_of_light_gbs"] for r in rows if r.get("speed_of_light_gbs")), None)
    for axis in (by_tokens, by_sms):
        if sol:
            axis.axhline(sol * 2, linestyle="--", color="gray", label="NVLink SoL (both directions)")
        axis.set_ylabel("logical GB/s")
        axis.legend()
        axis.grid(alpha=0.3)
    by_tokens.set_xlabel("tokens per rank")
    by_tokens.set_xscale("log", base=2)
    by_sms.set_xlabel("SMs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
