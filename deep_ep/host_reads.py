"""Host waits and host reads of device values that never block inside the CUDA driver.

A copy from the device into pageable host memory (`.tolist()`, `.item()`, `.cpu()` of a CUDA tensor)
waits inside the driver for the work queued before it on its stream, and while it waits, CUDA calls of
the process's other threads (an event record, a kernel launch) wait too. Virtual ranks
(`deep_ep.loopback`) are threads of one process: a rank whose queued kernel waits for a peer's next
launch, and that then reads a value, holds that launch back until the kernel's deadline (seen on one
H200 as a reproducible stall of the virtual-rank sweep). So a read first polls an event until the
stream's queued work is done; the copy then finds nothing to wait for.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

# Busy-poll this long before backing off to short sleeps (a sleep costs a scheduler tick)
_SPIN_S = 2e-3


def poll_pause(spinning: bool) -> None:
    """The pause between two polls of a host wait: while `spinning`, a yield of the interpreter and of
    the CPU (other threads, e.g. virtual ranks, launch meanwhile), else a short sleep. Not
    `time.sleep(0)`: Linux's timer slack (50 us by default) makes even a zero sleep take 50-90 us
    (measured on the H200 machine and in CI's), which every wait would add to the time it notices the
    device; `os.sched_yield` releases the interpreter too and takes under a microsecond."""
    if spinning:
        os.sched_yield()
    else:
        time.sleep(1e-4)


def wait_for_event(event: torch.cuda.Event, timeout_s: float | None = None, spin_s: float = _SPIN_S) -> bool:
    """`event.synchronize()` by polling: busy (yielding the interpreter) for `spin_s`, then in short
    sleeps. Returns False once `timeout_s` has passed; without one it waits for good (device waits
    have deadlines, so the event completes)."""
    started = time.monotonic()
    while not event.query():
        elapsed = time.monotonic() - started
        if timeout_s is not None and elapsed > timeout_s:
            return False
        poll_pause(elapsed < spin_s)
    return True


def wait_for_stream(
    stream: torch.cuda.Stream | None = None, timeout_s: float | None = None, spin_s: float = _SPIN_S
) -> bool:
    """Wait until everything queued so far on `stream` (default: the current stream) has run; the
    polling and the result as in `wait_for_event`."""
    event = torch.cuda.Event()
    event.record(stream if stream is not None else torch.cuda.current_stream())
    return wait_for_event(event, timeout_s, spin_s)


def host_list(tensor: torch.Tensor) -> list:
    """`tensor.tolist()`, for a CUDA tensor after its stream has drained (any dtype and shape)."""
    if tensor.is_cuda:
        wait_for_stream()
    return tensor.tolist()


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `tensor` (any dtype and shape), taken after the current stream has drained."""
    if tensor.is_cuda:
        wait_for_stream()
    return tensor.cpu()


def wait_for_work(work: Any, timeout_s: float) -> bool:
    """Wait for a `torch.distributed` `Work` by polling `is_completed` (busy at first, then short
    sleeps); False once `timeout_s` has passed (the work is left pending), else True after `wait()`."""
    deadline = time.monotonic() + timeout_s
    num_polls = 0
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        num_polls += 1
        poll_pause(num_polls < 100)
    work.wait()
    return True
