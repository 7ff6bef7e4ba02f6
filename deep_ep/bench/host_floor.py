"""The host floor of `deep-ep bench --host`: what this machine charges, in the same run, for the
pieces every call is made of, so that a call's host time is read against them.

- launch floor: one `cuLaunchKernelEx` of an empty kernel (`launch_floor.cuh`) on a drained stream,
  timed in C++ the way a replay launches (`steady_floor.cpp`); a dispatch or combine launches two
  kernels, so twice this is the part of its host time no host code can remove;
- allocation floor: one allocation from torch's CUDA caching allocator, a cached block reused (what
  each of a call's allocations costs at best);
- timer floor: the bench's own wall for a call that does nothing (the clocks and the call).

The launch and allocation floors need a GPU and the compiled steady module (`None` otherwise).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

FLOOR_FIELDS = ("launch_floor_us", "alloc_floor_us", "timer_floor_us")
NUM_FLOOR_SAMPLES = 200


def measure_floor(on_gpu: bool, num_bytes: int, time_empty_call: Callable[[], float]) -> dict[str, float | None]:
    """The floor fields in microseconds (medians over `NUM_FLOOR_SAMPLES`); `time_empty_call()`
    returns the bench's host wall for a call that does nothing, in microseconds."""
    floor: dict[str, float | None] = dict.fromkeys(FLOOR_FIELDS)
    floor["timer_floor_us"] = time_empty_call()
    if not on_gpu:
        return floor
    from ..backends.kernels import specs
    from ..backends.kernels.steady import steady_module

    module, _ = steady_module()
    if module is None:
        return floor
    kernel = specs.load(specs.launch_floor_spec())
    launch_ns, alloc_ns = module.host_floor(kernel.handle, torch.cuda.current_stream().cuda_stream,
                                            NUM_FLOOR_SAMPLES, num_bytes)  # fmt: skip
    floor["launch_floor_us"] = statistics.median(launch_ns) / 1e3
    floor["alloc_floor_us"] = statistics.median(alloc_ns) / 1e3
    return floor


def format_floor(case_label: str, row: dict) -> str:
    """One line: a case's floors (`row` holds `FLOOR_FIELDS`)."""
    parts = [f"{name} {'n/a' if row[field] is None else f'{row[field]:.1f} us'}"
             for name, field in zip(("launch", "allocation", "timers"), FLOOR_FIELDS, strict=True)]  # fmt: skip
    return f"floor of this run, {case_label}: " + ", ".join(parts)
