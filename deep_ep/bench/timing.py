"""Timing: eager calls (CUDA events or the host clock), CUDA-graph replays, and a kernel breakdown.

Eager timing is the median over iterations, each aligned across ranks by a barrier, inputs rotated.
Graph timing is the device time of a whole call: one graph per input set (rotated), each holding
`calls_per_graph` back-to-back calls, replayed many times between two CUDA events after a barrier;
the per-call time is the elapsed time over the number of calls, median over samples.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..host_reads import host_list, wait_for_event, wait_for_stream

# A graph timing sample lasts about this long (the replay count adapts to the call's duration)
GRAPH_SAMPLE_S = 0.02
MIN_REPLAYS, MAX_REPLAYS = 3, 400


def time_eager(
    fn: Callable[[Any], Any],
    inputs: Sequence[Any],
    num_warmups: int,
    num_iters: int,
    align: Callable[[], None],
    device: str,
) -> float:
    """Median seconds of `fn(input)`, inputs rotated, every iteration barrier-aligned across ranks."""
    samples = []
    for i in range(num_warmups + num_iters):
        align()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inputs[i % len(inputs)])
            end.record()
            wait_for_event(end)
            elapsed = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            fn(inputs[i % len(inputs)])
            elapsed = time.perf_counter() - started
        if i >= num_warmups:
            samples.append(elapsed)
    return statistics.median(samples)


@dataclass
class CapturedOp:
    """CUDA graphs of one operation: one per input set, each with `calls_per_graph` calls.

    Attributes:
        graphs: the graphs, one per input set.
        outputs: `outputs[r][i]` is what call `i` of graph `r` returned at capture (the tensors
            every replay writes).
        calls_per_graph: calls captured back to back in each graph.
    """

    graphs: list[Any]
    outputs: list[list[Any]]
    calls_per_graph: int
    replays_used: int = field(default=0)

    def replay_first(self) -> Any:
        """Replay graph 0 once, wait for it, and return the outputs of its first call."""
        self.graphs[0].replay()
        wait_for_stream()
        return self.outputs[0][0]

    def release(self) -> None:
        """Drop the graphs and their outputs (their memory pools go back to the allocator)."""
        self.graphs.clear()
        self.outputs.clear()


def release_captured(ops: Sequence[CapturedOp], host_barrier: Callable[[], None]) -> None:
    """Release `ops` on every rank at once (collective), between two `host_barrier()` calls after
    this rank's stream has drained: destroying a graph and its memory pool can wait for the device,
    so, as in `capture`, no rank may then have a kernel running that waits for a rank still
    releasing (with virtual ranks that wait would last until the kernel's deadline).

    The graphs' memory pools then go back to the device (`empty_cache`, while no rank has device
    work): a freed pool stays reserved by the allocator, which frees cached memory only outside a
    capture, so a later capture that needs it runs out of memory instead (`deep-ep bench` with 48
    cases on 4 virtual ranks of one H200 did, at the 14th case)."""
    on_gpu = torch.cuda.is_initialized()  # else no stream has work to drain, and no pool is cached
    if on_gpu:
        wait_for_stream()
    host_barrier()
    for op in ops:
        op.release()
    host_barrier()
    if on_gpu:
        torch.cuda.empty_cache()  # may synchronize the device: every rank is between barriers, drained
        host_barrier()


def _capture_stream() -> torch.cuda.Stream:
    """The current stream, unless it is the default stream (which cannot capture): then a new one.
    Virtual ranks (`deep_ep.loopback`) run on streams of their own, and one from torch's pool could
    be another rank's."""
    current = torch.cuda.current_stream()
    return torch.cuda.Stream() if current == torch.cuda.default_stream() else current


def capture(call: Callable[[int], Any], num_inputs: int, calls_per_graph: int,
            host_barrier: Callable[[], None] = lambda: None) -> CapturedOp:  # fmt: skip
    """Capture `call(r)` for every input set `r` (collective: every rank captures the same calls).

    One warm-up call runs first, outside capture: kernels load and the allocator settles. Each graph
    is captured on a stream other than the default one. Host waits poll (`deep_ep.host_reads`), and
    capture does not synchronize the device nor empty the allocator's cache as `torch.cuda.graph`
    does: with virtual ranks either would wait for, or take memory from, another rank's work. For
    the same reason the ranks capture between two `host_barrier()` calls (a barrier without device
    work, e.g. `dist.barrier`): a capture allocates its graph's memory (`cudaMalloc`, which can wait
    for the device), so no rank may have a kernel running that waits for a rank still capturing.
    """
    side = _capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(0)
    wait_for_stream(side)
    host_barrier()
    graphs, outputs = [], []
    for r in range(num_inputs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            # thread_local: API calls of other threads (the NCCL watchdog's event queries) cannot invalidate it
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs.append([call(r) for _ in range(calls_per_graph)])
            finally:
                graph.capture_end()
        graphs.append(graph)
    torch.cuda.current_stream().wait_stream(side)
    wait_for_stream(side)
    host_barrier()
    return CapturedOp(graphs, outputs, calls_per_graph)


def _replay(op: CapturedOp, num_replays: int) -> float:
    """Seconds for `num_replays` back-to-back replays (graphs rotated), between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(num_replays):
        op.graphs[i % len(op.graphs)].replay()
    end.record()
    wait_for_event(end)
    return start.elapsed_time(end) / 1e3


def agree_on_replays(op: CapturedOp, align: Callable[[], None], group: Any) -> int:
    """Warm `op` up and return the replay count every rank uses for one sample (about
    `GRAPH_SAMPLE_S`, a power of two): rank 0's estimate, broadcast, since the calls are collective
    and every rank must replay them equally often."""
    import torch.distributed as dist

    align()
    warm = _replay(op, MIN_REPLAYS) / MIN_REPLAYS
    wanted = max(MIN_REPLAYS, min(MAX_REPLAYS, GRAPH_SAMPLE_S / max(warm, 1e-7)))
    count = torch.tensor([2 ** round(math.log2(wanted))], dtype=torch.int64, device="cuda")
    dist.broadcast(count, group_src=0, group=group)
    return int(host_list(count)[0])


def time_graphs(op: CapturedOp, num_replays: int, num_samples: int, align: Callable[[], None]) -> float:
    """Median seconds per call over `num_samples` barrier-aligned samples of `num_replays`
    back-to-back replays (the same count on every rank: see `agree_on_replays`)."""
    op.replays_used = num_replays
    samples = []
    for _ in range(num_samples):
        align()
        samples.append(_replay(op, num_replays) / (num_replays * op.calls_per_graph))
    return statistics.median(samples)


_KERNEL_NAME = re.compile(r"deep_ep::(\w+?)_impl")


def short_kernel_name(name: str) -> str:
    """`void deep_ep::dispatch_epilogue_impl<...>(...)` -> `dispatch_epilogue`; others shortened."""
    found = _KERNEL_NAME.search(name)
    if found:
        return found.group(1)
    return name.split("(")[0].replace("void ", "")[:48]


def per_call_kernel_times(instances: Sequence[tuple[str, float]], num_calls: int) -> dict[str, float]:
    """Device microseconds per call of each kernel from `(short name, us)` pairs, one per launch.

    A kernel's figure is its median launch times its launches per call: a single launch that waited
    (for a peer that entered the profiled window late, or for the profiler itself) would otherwise
    dominate a mean. Sorted by time, longest first.
    """
    durations: dict[str, list[float]] = {}
    for name, us in instances:
        durations.setdefault(name, []).append(us)
    per_call = {name: statistics.median(values) * len(values) / num_calls for name, values in durations.items()}
    return dict(sorted(per_call.items(), key=lambda item: -item[1]))


def kernel_breakdown(op: CapturedOp, num_replays: int, align: Callable[[], None]) -> dict[str, float]:
    """Device microseconds per call of every kernel in `op`'s graphs, from the torch profiler.

    A kernel and the epilogue that waits for it overlap on the device, so the figures of one
    operation do not add up to its time. Returns `{short kernel name: us per call}`, or
    `{"error": message}` when the profiler fails (the benchmark never fails for the breakdown's sake).
    """
    try:
        from torch.profiler import ProfilerActivity, profile

        align()  # outside the window: its own kernels are not the operation's
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(num_replays):
                op.graphs[i % len(op.graphs)].replay()
            wait_for_stream()
        instances = []
        for event in prof.events():
            if getattr(event.device_type, "name", "") != "CUDA":
                continue
            instances.append((short_kernel_name(event.key), event.time_range.elapsed_us()))
        return per_call_kernel_times(instances, num_replays * op.calls_per_graph)
    except Exception as error:  # the profiler is optional
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
