"""Samples of what a leak grows in a process (device memory, host RSS, open descriptors, threads,
live tensors, CUDA events and graphs, deep_ep handles), and the comparison of a first and a last
sample against tolerances. Used by `soak.py`; the comparison is pure, so tests can feed it series."""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
# Growth allowed from the warm-up's end to the end. Device memory: a tensor kept per iteration shows
# after a few hundred iterations. Outside torch: kernels loaded after the warm-up take a few MiB of
# driver memory each time. RSS: the allocator's arenas and the interpreter move by tens of MiB
# without a leak. Counts: a handle or descriptor kept per iteration grows without bound, so none.
TOLERANCES: dict[str, int] = {
    "device_allocated_bytes": 2 * MIB,
    "device_outside_torch_bytes": 64 * MIB,
    "host_rss_bytes": 64 * MIB,
    "open_fds": 0,
    "threads": 0,
    "live_tensors": 16,
    "live_cuda_events": 0,
    "live_cuda_graphs": 0,
    "live_event_handles": 0,
    "live_ep_handles": 0,
}


def _proc_status() -> dict[str, int]:
    """VmRSS (KiB) and Threads of /proc/self/status (empty where there is no /proc)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "Threads") if key in fields}


def _live_objects() -> dict[str, int]:
    from deep_ep.event import EventHandle
    from deep_ep.handle import EPHandle

    kinds = {"live_tensors": torch.Tensor, "live_cuda_events": torch.cuda.Event,
             "live_cuda_graphs": torch.cuda.CUDAGraph, "live_event_handles": EventHandle,
             "live_ep_handles": EPHandle}  # fmt: skip
    counts = dict.fromkeys(kinds, 0)
    with warnings.catch_warnings():
        # isinstance asks some objects for their class, and deprecated torch aliases warn when asked
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            for name, kind in kinds.items():
                if isinstance(obj, kind):
                    counts[name] += 1
    return counts


def sample_process(device: torch.device) -> dict[str, int]:
    """What a leak would grow, for the whole process (call it while no rank runs anything)."""
    gc.collect()  # garbage that a collection frees is not a leak
    values: dict[str, int] = {}
    if device.type == "cuda":
        # Tensors freed while `record_stream`ed stay allocated until the allocator next looks at its
        # events, which it does on an allocation (one from the rank's reserve: no cudaMalloc)
        torch.empty(1, device=device)
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        values.update(device_allocated_bytes=torch.cuda.memory_allocated(device), device_reserved_bytes=reserved,
                      device_free_bytes=free, device_outside_torch_bytes=total - free - reserved,
                      device_mallocs=torch.cuda.memory_stats(device).get("num_device_alloc", 0))  # fmt: skip
    status = _proc_status()
    if "VmRSS" in status:
        values["host_rss_bytes"] = status["VmRSS"] * 1024
    if "Threads" in status:
        values["threads"] = status["Threads"]
    if os.path.isdir("/proc/self/fd"):
        values["open_fds"] = len(os.listdir("/proc/self/fd"))
    values.update(_live_objects())
    return values


def find_growth(samples: list[dict[str, Any]], tolerances: dict[str, int] = TOLERANCES) -> list[str]:
    """One line per metric that grew by more than its tolerance from the first sample to the last
    (metrics missing from either are skipped); empty when nothing did."""
    if len(samples) < 2:
        return []
    first, last = samples[0], samples[-1]
    problems = []
    for key, tolerance in tolerances.items():
        if key not in first or key not in last:
            continue
        growth = last[key] - first[key]
        if growth > tolerance:
            unit = (lambda v: f"{v / MIB:.1f} MiB") if key.endswith("_bytes") else str
            problems.append(f"{key} grew by {unit(growth)} from iteration {first['iteration']} to "
                            f"{last['iteration']} ({unit(first[key])} -> {unit(last[key])}; "
                            f"tolerance {unit(tolerance)})")  # fmt: skip
    return problems
