"""Events and streams: `EventHandle` (one recorded CUDA event), `EventOverlap` (V2's overlap helper),
`shared_comm_stream` (the process's communication stream) and `CommStreamScope` (the stream
choreography of one communication call).

On a machine or process group without CUDA, an `EventHandle` holds no event and behaves as an event
that has already completed, so the same calling code runs on CPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

_comm_streams: dict[int, torch.cuda.Stream] = {}
_comm_streams_lock = threading.Lock()


def shared_comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The communication stream of `device` for every buffer of this process: one high-priority
    stream, as DeepEP V2 has (buffers' operations are ordered on it, and run ahead of compute
    kernels queued at default priority)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _comm_streams_lock:
        stream = _comm_streams.get(index)
        if stream is None:
            # torch maps a priority past the device's range to its highest
            stream = _comm_streams[index] = torch.cuda.Stream(torch.device("cuda", index), priority=-100)
    return stream


def current_stream(device_index: int) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device_index)` without the device lookups that torch's own makes on
    every call (a few microseconds each on the path of every dispatch and combine)."""
    stream_id, index, device_type = torch._C._cuda_getCurrentStream(device_index)
    return torch.cuda.Stream(stream_id=stream_id, device_index=index, device_type=device_type)


def avoid_record_stream() -> bool:
    """`EP_AVOID_RECORD_STREAM=1` (DeepEP V2's switch): an asynchronous call does not `record_stream`
    its inputs on the communication stream; the caller keeps them alive until it waited for the event."""
    return os.environ.get("EP_AVOID_RECORD_STREAM", "0") not in ("", "0")


class EventHandle:
    """A CUDA event recorded on a stream (V2's `EventHandle`); a completed placeholder without CUDA.

    Attributes:
        event: the `torch.cuda.Event` (or an event with its interface, see `of`), or `None` when there
            is no CUDA.
    """

    def __init__(self, stream: torch.cuda.Stream | None = None, use_cuda: bool | None = None) -> None:
        """Record an event on `stream`, by default the current CUDA stream.

        Arguments:
            stream: the stream to record on (`None`: the current stream).
            use_cuda: force (`True`) or skip (`False`) CUDA; `None` uses CUDA when it is available.
        """
        if use_cuda is None:
            use_cuda = stream is not None or torch.cuda.is_available()
        self.event: Any = None  # a torch.cuda.Event, or a steady call's (see `of`)
        if use_cuda:
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    @classmethod
    def of(cls, event: Any) -> EventHandle:
        """Wrap an event recorded already: a `torch.cuda.Event`, or the steady path's own
        (`deep_ep.backends.kernels.steady`), which has the `wait`, `query`, `synchronize` and
        `cuda_event` of torch's."""
        handle = cls.__new__(cls)
        handle.event = event
        return handle

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event (no-op without CUDA)."""
        if self.event is not None:
            self.event.wait()

    def stream_wait(self, stream: torch.cuda.Stream | None) -> None:
        """Make `stream` wait for the event (no-op without CUDA or without a stream)."""
        if self.event is not None and stream is not None:
            self.event.wait(stream)

    def query(self) -> bool:
        """Return whether the work before the event has completed."""
        return True if self.event is None else self.event.query()

    def synchronize(self) -> None:
        """Block the host until the event has completed."""
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """Wraps the event a communication call returns, for overlapping it with compute.

    With `async_with_compute_stream=True` the compute stream does not wait for the communication:
    call `current_stream_wait()` (or leave a `with event_overlap:` block) before using the outputs.

    Attributes:
        event: the `EventHandle` (or `None` once released).
        extra_tensors: tensors kept alive until the event is released (V2 compatibility).
        hook_after_wait: a callable run once, right after the next `current_stream_wait()`.
    """

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple[torch.Tensor, ...] | None = None) -> None:
        """Wrap `event`.

        Arguments:
            event: the event to wait for.
            extra_tensors: tensors to keep alive as long as this object holds the event.
        """
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait: Callable[[], Any] | None = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event, then run the registered hook.

        Arguments:
            release_handle: drop the event (and the tensors it keeps alive) afterwards.
        """
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: the event was already released")
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None
            self.extra_tensors = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Register a callable to run right after the next `current_stream_wait()` (at most one)."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap.register_hook_after_wait: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """Configure `with event_overlap(release_handle=True):`; returns `self`."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        """Enter a block whose work overlaps the communication; the stream waits on exit."""
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """Make the current stream wait for the event."""
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class CommStreamScope:
    """The stream choreography around one backend call (V2's prologue/epilogue).

    Enter: the comm stream waits for `previous_event` (or the current compute stream) and becomes
    current, so the backend's work and allocations happen there. Exit (`finish`): with
    `async_with_compute_stream`, an event is recorded on the comm stream and every input/output tensor
    is `record_stream`ed on both streams; otherwise the compute stream waits for that event, and
    outputs are recorded on the compute stream unless `allocate_on_comm_stream` (they came from the
    comm stream's pool). Without CUDA every step is a no-op.

    The comm stream is on the current device (the facade checked it), so making it current is
    `set_stream`, not `torch.cuda.stream`'s context, which looks the devices up again.
    """

    def __init__(
        self,
        comm_stream: torch.cuda.Stream | None,
        previous_event: EventHandle | None,
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
    ) -> None:
        self.comm_stream = comm_stream
        self.async_with_compute_stream = async_with_compute_stream
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.compute_stream = None if comm_stream is None else current_stream(comm_stream.device_index)
        self._entered = False
        if comm_stream is not None:
            if previous_event is not None:
                previous_event.stream_wait(comm_stream)
            else:
                comm_stream.wait_stream(self.compute_stream)
            torch.cuda.set_stream(comm_stream)
            self._entered = True

    def finish(self, inputs: Iterable[Any], outputs: Iterable[Any]) -> EventHandle:
        """Leave the comm stream and return the event that marks the end of the call."""
        if self.comm_stream is None:
            return EventHandle(use_cuda=False)
        event = EventHandle(self.comm_stream)
        torch.cuda.set_stream(self.compute_stream)
        self._entered = False
        if self.async_with_compute_stream:
            # Outputs come from the comm stream's pool: freed on the compute stream, they must wait
            # for its work there whatever `EP_AVOID_RECORD_STREAM` says (V2 allocates them there)
            for t in outputs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self.compute_stream)
                    t.record_stream(self.comm_stream)
            if not avoid_record_stream():
                for t in inputs:
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(self.comm_stream)
        else:
            self.compute_stream.wait_event(event.event)  # what `wait_stream` would record, recorded already
            if not self.allocate_on_comm_stream:
                for t in outputs:
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(self.compute_stream)
        return event

    def abort(self) -> None:
        """Restore the compute stream after a failed call."""
        if self._entered:
            torch.cuda.set_stream(self.compute_stream)
            self._entered = False
