"""`deep-ep calibrate`: measure the rates of the planner's model on this machine and store them.

On every local GPU (one rank each, NCCL, the NVLink kernels), through the public API:

1. the link: our peer-store probe (`deep_ep.backends.kernels.runtime.peer_store`) on m SMs, every rank writing at
   once; the NVLink rate of the model is the probe on all SMs (or, should our kernels move wire
   bytes faster than that over a whole call, their rate);
2. graph times (CUDA-graph replay, back to back, per call; `deep_ep.bench.timing`) of a fresh
   dispatch without CPU sync, a cached dispatch and a combine at T in {8192, 4096, 1024, 128} tokens
   per rank and m in {2, 4, ..., all} SMs (DeepSeek-V3 shape, FP8 dispatch, uniform routing).

Then, per direction (`fit_op`), with `t_link` = wire bytes / NVLink rate:

- the per-SM rate `r` and the knee exponent `k` minimize the squared relative error of
  `smooth_max_k(t_link, SM bytes / (m r)) + c_T` over the points with T >= 1024 and m >= 8 (where
  the SMs or the link are the limit and where a pick can land), with one free offset `c_T` per
  token count. Below 8 SMs our kernels are plainly SM-bound; fitting those points too forces a
  sharp knee (k = 8 or a plain max) that misses how slowly the time approaches the link's near the
  pick (the link rate itself still grows with SMs: our probe moves 329 GB/s on 8 SMs, 348 on 132),
  and the pick then lands on too few SMs (10 instead of 16-20 on the 2x H200 of 2026-11-30);
- `c_T` (the time that does not depend on m) at every T, then `c_T = logical bytes / e + t_fixed` by
  least squares: the epilogue rate `e` and the fixed cost `t_fixed`.

The document (`deep_ep/data/hopper.json` by default) holds the rates with their provenance (date,
machine, command, commit), the raw measurements, the fits and predicted-vs-measured checks;
`deep_ep.planner.HOPPER` loads it. `--refit FILE` redoes the fit from a document's measurements on
any machine.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import planner
from ..planner import HARDWARE_FORMAT, smooth_max

TOKENS = (8192, 4096, 1024, 128)
SMS = (2, 4, 8, 12, 16, 20, 24, 32, 48, 64, 96)  # and all of the device's
KNEE_KS: tuple[float | None, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, None)
BANDWIDTH_MIN_TOKENS = 1024
BANDWIDTH_MIN_SMS = 8
NOMINAL_RDMA_GBS = 50.0  # one 400 Gb/s NIC per GPU; no NIC on our machine to measure
_GRID = 400


@dataclass
class CalibrationSettings:
    """What `deep-ep calibrate` measures (the DeepSeek-V3 shape by default)."""

    tokens: list[int] = field(default_factory=lambda: list(TOKENS))
    sms: list[int] = field(default_factory=lambda: list(SMS))
    hidden: int = 7168
    num_topk: int = 8
    num_experts: int = 256
    num_rotations: int = 2
    num_samples: int = 5
    seed: int = 1234


# ------------------------------------------------------------------------------------------ measuring


def measure_rank(rank: int, num_ranks: int, settings: CalibrationSettings) -> dict:
    """The probe and graph-time measurements of this rank (collective over the NCCL world)."""
    import torch
    import torch.distributed as dist

    import deep_ep

    from ..backends.kernels.runtime import peer_store
    from .cases import BenchCase, make_inputs, payload_bytes, random_rows, records_per_rank
    from .runner import calls_per_graph, capture_moe_ops
    from .timing import agree_on_replays, time_eager, time_graphs

    group = dist.group.WORLD
    # Sized for BF16 records, which also hold the FP8 ones
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=max(settings.tokens), hidden=settings.hidden,
                                   num_topk=settings.num_topk, use_fp8_dispatch=False, explicitly_destroy=True)  # fmt: skip
    if type(buffer.backend).__name__ != "NvlinkBackend":
        buffer.destroy()
        raise RuntimeError("calibrate: needs the NVLink kernels (all ranks in one NVLink domain)")
    runtime = buffer.backend.runtime
    num_device_sms = runtime.num_device_sms
    sms = sorted({min(m, num_device_sms) for m in settings.sms} | {num_device_sms})
    align = buffer.barrier

    def say(text: str) -> None:
        if rank == 0:
            print(f"calibrate: {text}", file=sys.stderr, flush=True)

    # The link: the peer-store probe on m SMs, every rank writing at once
    num_bytes = min(256 << 20, (runtime.data_bytes - (1 << 20)) // 16 * 16)
    sources = [torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    probe = []
    for m in sms:
        seconds = time_eager(lambda src, m=m: peer_store(runtime, torch.cuda.current_stream(), src, m), sources, 2,
                             settings.num_samples, align, "cuda")  # fmt: skip
        probe.append(dict(num_sms=m, gbs=num_bytes * (num_ranks - 1) / seconds / 1e9))
    say("probe GB/s by SMs: " + ", ".join(f"{p['num_sms']}: {p['gbs']:.0f}" for p in probe))
    del sources

    # Graph times of fresh dispatch, cached dispatch and combine
    points = []
    for num_tokens in settings.tokens:
        case = BenchCase(num_tokens, settings.hidden, settings.num_topk, settings.num_experts, True)
        rotations = [make_inputs(case, rank, num_ranks, "cuda", settings.seed + r, 0.5)
                     for r in range(settings.num_rotations)]  # fmt: skip
        rows = [random_rows(num_ranks * num_tokens, settings.hidden, "cuda", settings.seed * 7 + r)
                for r in range(settings.num_rotations)]  # fmt: skip
        hits = records_per_rank(rotations[0][1], settings.num_experts, num_ranks)
        record_bytes = dict(dispatch=payload_bytes(rotations[0][0], settings.num_topk),
                            cached_dispatch=payload_bytes(rotations[0][0], settings.num_topk),
                            combine=2 * settings.hidden)  # fmt: skip
        base = dict(num_experts=settings.num_experts, num_max_tokens_per_rank=num_tokens)
        handles = [buffer.dispatch(x, topk_idx=t, topk_weights=w, do_cpu_sync=False, num_sms=num_device_sms, **base)[3]
                   for x, t, w in rotations]  # fmt: skip
        calls = calls_per_graph(num_tokens)
        for m in sms:
            ops = capture_moe_ops(buffer, rotations, rows, handles, dict(base, num_sms=m), calls, group)
            try:
                for op, captured in ops.items():
                    num_replays = agree_on_replays(captured, align, group)
                    us = time_graphs(captured, num_replays, settings.num_samples, align) * 1e6
                    logical = sum(hits) * record_bytes[op]
                    points.append(dict(op=op, num_tokens=num_tokens, num_sms=m, us=us, logical_bytes=logical,
                                       sm_bytes=logical, wire_bytes=(sum(hits) - hits[rank]) * record_bytes[op]))  # fmt: skip
            finally:
                for captured in ops.values():
                    captured.release()
            last = points[-3:]
            say(f"T={num_tokens} SMs={m}: " + ", ".join(f"{p['op']} {p['us']:.1f} us" for p in last))
        torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_properties(torch.cuda.current_device()).name
    buffer.destroy()
    return dict(probe=probe, points=points, num_device_sms=num_device_sms, device_name=device_name)


def merge_ranks(per_rank: list[dict]) -> dict:
    """One set of measurements: the slowest rank's time per point, bytes and probe rates averaged."""
    points = []
    for rank_points in zip(*(r["points"] for r in per_rank), strict=True):
        point = dict(rank_points[0])
        point["us"] = max(p["us"] for p in rank_points)
        for key in ("logical_bytes", "sm_bytes", "wire_bytes"):
            point[key] = statistics.mean(p[key] for p in rank_points)
        points.append(point)
    probe = [dict(num_sms=ps[0]["num_sms"], gbs=statistics.mean(p["gbs"] for p in ps))
             for ps in zip(*(r["probe"] for r in per_rank), strict=True)]  # fmt: skip
    return dict(probe=probe, points=points)


# ------------------------------------------------------------------------------------------ fitting


def _comm_us(point: dict, nvlink_gbs: float, sm_gbs: float, knee_k: float | None) -> float:
    t_link = point["wire_bytes"] / (nvlink_gbs * 1e3)
    t_sm = point["sm_bytes"] / (point["num_sms"] * sm_gbs * 1e3)
    return smooth_max(t_link, t_sm, knee_k)


def _offsets(points: list[dict], nvlink_gbs: float, sm_gbs: float, knee_k: float | None) -> dict[int, float]:
    """Per token count, the offset `c_T` minimizing the squared relative error (weights 1 / us^2)."""
    sums: dict[int, list[float]] = {}
    for p in points:
        weight = 1.0 / p["us"] ** 2
        entry = sums.setdefault(p["num_tokens"], [0.0, 0.0])
        entry[0] += weight * (p["us"] - _comm_us(p, nvlink_gbs, sm_gbs, knee_k))
        entry[1] += weight
    return {tokens: total / weights for tokens, (total, weights) in sums.items()}


def _squared_error(points: list[dict], nvlink_gbs: float, sm_gbs: float, knee_k: float | None,
                   offsets: dict[int, float]) -> float:  # fmt: skip
    return sum(((_comm_us(p, nvlink_gbs, sm_gbs, knee_k) + offsets[p["num_tokens"]] - p["us"]) / p["us"]) ** 2
               for p in points)  # fmt: skip


def fit_epilogue(offsets: dict[int, tuple[float, float]]) -> tuple[float | None, float]:
    """Fit `c_T = logical bytes / e + t_fixed` by least squares; `offsets` maps T to `(bytes, c_T)`.

    Returns `(e in GB/s or None, t_fixed in us)`, with `e > 0` (else no epilogue term) and `t_fixed >= 0`.
    """
    xs = [x for x, _ in offsets.values()]
    ys = [y for _, y in offsets.values()]
    slope, intercept = 0.0, statistics.mean(ys)
    if len(xs) >= 2 and max(xs) > min(xs):
        mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mean_x) ** 2 for x in xs
        )
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # through the origin
            slope, intercept = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs), 0.0
    if slope <= 0:
        return None, max(0.0, statistics.mean(ys))
    return 1.0 / (slope * 1e3), intercept


def fit_op(points: list[dict], nvlink_gbs: float) -> dict:
    """Fit one direction's rates (see the module docstring) from its graph-time points."""
    bandwidth = [
        p for p in points if p["num_tokens"] >= BANDWIDTH_MIN_TOKENS and p["num_sms"] >= BANDWIDTH_MIN_SMS
    ] or points
    if len({p["num_sms"] for p in bandwidth}) < 2:
        raise ValueError("calibrate: the fit needs points at two or more SM counts")
    guess = max(p["sm_bytes"] / (p["num_sms"] * p["us"] * 1e3) for p in bandwidth)

    def error(sm_gbs: float, knee_k: float | None) -> float:
        return _squared_error(bandwidth, nvlink_gbs, sm_gbs, knee_k, _offsets(bandwidth, nvlink_gbs, sm_gbs, knee_k))

    # A coarse log grid over r (guess / 4 .. guess * 8) for every k, then a fine one around the best
    best = min(((error(r, k), r, k) for k in KNEE_KS
                for r in (guess * 0.25 * 32 ** (i / (_GRID - 1)) for i in range(_GRID))),
               key=lambda item: item[0])  # fmt: skip
    _, sm_gbs, knee_k = min(((error(r, best[2]), r, best[2]) for r in (best[1] * (0.99 + 0.02 * i / 200)
                             for i in range(201))), key=lambda item: item[0])  # fmt: skip

    # The m-independent time at every T, then its epilogue and fixed parts
    offsets = _offsets(points, nvlink_gbs, sm_gbs, knee_k)
    logical = {t: statistics.mean(p["logical_bytes"] for p in points if p["num_tokens"] == t) for t in offsets}
    epilogue_gbs, fixed_us = fit_epilogue({t: (logical[t], c) for t, c in offsets.items()})
    return dict(sm_gbs=sm_gbs, knee_k=knee_k, epilogue_gbs=epilogue_gbs, fixed_us=fixed_us,
                offsets_us={str(t): c for t, c in sorted(offsets.items())},
                rms_rel_error_bandwidth=math.sqrt(error(sm_gbs, knee_k) / len(bandwidth)))  # fmt: skip


def fit(measurements: dict, num_device_sms: int) -> tuple[dict, dict]:
    """The `hardware` values and the per-direction fits of a set of measurements."""
    probe = max(measurements["probe"], key=lambda p: p["num_sms"])["gbs"]
    # A graph time bounds the link from below (wire bytes over the whole call): a probe slower than our
    # own kernels cannot be the link's rate
    fastest = max(
        p["wire_bytes"] / (p["us"] * 1e3) for p in measurements["points"] if p["op"] in ("dispatch", "combine")
    )
    nvlink_gbs = max(probe, fastest)
    fits = {op: fit_op([p for p in measurements["points"] if p["op"] == op], nvlink_gbs)
            for op in ("dispatch", "combine")}  # fmt: skip
    fits["nvlink"] = dict(
        probe_gbs=probe, fastest_graph_wire_gbs=fastest, source="probe" if probe >= fastest else "graph"
    )
    hardware = dict(nvlink_gbs=nvlink_gbs, rdma_gbs=NOMINAL_RDMA_GBS, num_device_sms=num_device_sms)
    for op in ("dispatch", "combine"):
        found = fits[op]
        hardware.update({f"{op}_sm_gbs": found["sm_gbs"], f"{op}_knee_k": found["knee_k"],
                         f"{op}_epilogue_gbs": found["epilogue_gbs"], f"{op}_fixed_us": found["fixed_us"]})  # fmt: skip
    return hardware, fits


def prediction_checks(document: dict, num_ranks: int, settings: dict) -> tuple[list[dict], dict[str, int]]:
    """Predicted vs measured graph time at every measured (T >= 4096, m) point, and the planner's picks."""
    hardware = planner.hardware_from_document(document)
    checks = []
    for p in document["measurements"]["points"]:
        if p["op"] not in ("dispatch", "combine") or p["num_tokens"] < 4096:
            continue
        shape = planner.MoEShape(p["num_tokens"], settings["hidden"], settings["num_topk"], settings["num_experts"])
        predicted = getattr(planner.plan(shape, num_ranks, num_ranks, hardware=hardware, num_sms=p["num_sms"]),
                            f"predicted_{p['op']}_us")  # fmt: skip
        checks.append(dict(op=p["op"], num_tokens=p["num_tokens"], num_sms=p["num_sms"], measured_us=p["us"],
                           predicted_us=predicted, error=predicted / p["us"] - 1))  # fmt: skip
    picks = {}
    for tokens in settings["tokens"]:
        shape = planner.MoEShape(tokens, settings["hidden"], settings["num_topk"], settings["num_experts"])
        picks[str(tokens)] = planner.plan(shape, num_ranks, num_ranks, hardware=hardware).num_sms
    return checks, picks


def build_document(measurements: dict, settings: dict, provenance: dict, num_ranks: int, num_device_sms: int,
                   status: str = "calibrated") -> dict:  # fmt: skip
    """The calibration document: rates, provenance, measurements, fits, checks and picks."""
    hardware, fits = fit(measurements, num_device_sms)
    document = dict(format=HARDWARE_FORMAT, status=status, provenance=provenance, hardware=hardware,
                    model="t(m) = smooth_max_k(wire / nvlink_gbs, sm_bytes / (m sm_gbs)) + logical / epilogue_gbs "
                          "+ fixed_us (docs/planner.md)",
                    notes=f"rdma_gbs is nominal ({NOMINAL_RDMA_GBS:g} GB/s, one 400 Gb/s NIC): no NIC was measured",
                    settings=dict(settings, num_ranks=num_ranks), measurements=measurements, fits=fits)  # fmt: skip
    document["checks"], document["picks"] = prediction_checks(document, num_ranks, settings)
    return document


# ------------------------------------------------------------------------------------------ entry points


def default_path() -> Path:
    """The package's calibration file (`deep_ep/data/hopper.json`)."""
    return Path(__file__).resolve().parent.parent / planner.HARDWARE_FILE


def calibrate(settings: CalibrationSettings, command: str) -> dict:
    """Measure on all local GPUs and return the calibration document."""
    import torch

    from ..utils.spawn import spawn_ranks
    from .report import git_commit, utc_now

    num_ranks = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_ranks < 2:
        raise ValueError(f"calibrate: needs at least 2 CUDA GPUs in one NVLink domain, found {num_ranks}")
    print(f"deep-ep calibrate: {num_ranks} GPUs, T={settings.tokens}, SMs={settings.sms} (+ all)", file=sys.stderr,
          flush=True)  # fmt: skip
    per_rank = spawn_ranks(measure_rank, num_ranks, backend="nccl", args=(settings,), timeout_s=900)
    first = per_rank[0]
    provenance = dict(date=utc_now(), machine=f"{num_ranks}x {first['device_name']} ({first['num_device_sms']} SMs)",
                      command=command, commit=git_commit(), torch=torch.__version__)  # fmt: skip
    return build_document(merge_ranks(per_rank), asdict(settings), provenance, num_ranks, first["num_device_sms"])


def refit(path: str | Path, command: str) -> dict:
    """Redo the fit of a calibration document from its measurements (no GPU needed)."""
    from .report import git_commit, utc_now

    source = json.loads(Path(path).read_text())
    provenance = dict(source["provenance"], refit=dict(date=utc_now(), command=command, commit=git_commit()))
    settings = {k: v for k, v in source["settings"].items() if k != "num_ranks"}
    return build_document(source["measurements"], settings, provenance, source["settings"]["num_ranks"],
                          source["hardware"]["num_device_sms"], status=source["status"])  # fmt: skip


def format_summary(document: dict) -> str:
    """The fitted rates, the picks and the predicted-vs-measured errors, for the terminal."""
    hw = document["hardware"]
    lines = [f"{document['status']}: {document['provenance']['machine']}, {document['provenance']['date']}",
             f"  NVLink (probe, all SMs): {hw['nvlink_gbs']:.1f} GB/s per direction"]  # fmt: skip
    for op in ("dispatch", "combine"):
        fit_ = document["fits"][op]
        epilogue = "none" if hw[f"{op}_epilogue_gbs"] is None else f"{hw[f'{op}_epilogue_gbs']:.0f} GB/s"
        lines.append(f"  {op}: {hw[f'{op}_sm_gbs']:.2f} GB/s per SM, knee k={hw[f'{op}_knee_k']}, epilogue {epilogue}, "
                     f"fixed {hw[f'{op}_fixed_us']:.1f} us (rms error {100 * fit_['rms_rel_error_bandwidth']:.1f}%)")  # fmt: skip
    lines.append("  planner's picks (SMs by tokens): " + ", ".join(f"T={t}: {m}" for t, m in document["picks"].items()))
    for what, least in (("every SM count", 0), (">= 16 SMs", 16)):
        worst = max(
            (c for c in document["checks"] if c["num_sms"] >= least), key=lambda c: abs(c["error"]), default=None
        )
        if worst:
            lines.append(f"  predicted vs measured graph time (T >= 4096, {what}): worst {100 * worst['error']:+.1f}% "
                         f"({worst['op']}, T={worst['num_tokens']}, {worst['num_sms']} SMs)")  # fmt: skip
    return "\n".join(lines)


def write(document: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def run(command: str, out: str | Path | None = None, refit_path: str | Path | None = None,
        settings: CalibrationSettings | None = None) -> dict:  # fmt: skip
    """`deep-ep calibrate`: measure (or refit), write the document, print the summary."""
    document = refit(refit_path, command) if refit_path else calibrate(settings or CalibrationSettings(), command)
    path = Path(out) if out else default_path()
    write(document, path)
    print(format_summary(document))
    print(f"wrote {path}")
    return document
