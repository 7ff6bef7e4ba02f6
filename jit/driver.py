"""Checked calls into the CUDA driver (cuda.bindings.driver), contexts and streams.

Every driver call returns a `CUresult` first; `check` turns a failure into a `CUDADriverError`
with the driver's own error name and string, so no call's result is ever dropped.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from cuda.bindings import driver as cuda

from .errors import CUDADriverError


def error_from(result: Any, call: str, context: str = "") -> CUDADriverError:
    """Build the exception for a failed driver call, asking the driver for the error's name and text."""
    code = int(result)
    try:
        status, name = cuda.cuGetErrorName(result)
        name = name.decode() if status == cuda.CUresult.CUDA_SUCCESS and name else f"CUresult {code}"
        status, text = cuda.cuGetErrorString(result)
        text = text.decode() if status == cuda.CUresult.CUDA_SUCCESS and text else "unknown error"
    except Exception:  # the driver cannot even name the error: keep the number
        name, text = f"CUresult {code}", "unknown error"
    return CUDADriverError(call, code, name, text, context)


def check(returned: tuple[Any, ...], call: str, context: str = "") -> Any:
    """Raise on a failed driver call; return its single output, a tuple of outputs, or `None`."""
    if returned[0]:  # CUDA_SUCCESS is 0, every error is non-zero
        raise error_from(returned[0], call, context)
    if len(returned) == 1:
        return None
    return returned[1] if len(returned) == 2 else returned[1:]


_init_lock = threading.Lock()
_initialized = False
_primary: dict[int, Any] = {}


def init() -> None:
    """`cuInit(0)` once per process (a no-op when torch already initialised CUDA)."""
    global _initialized
    with _init_lock:
        if not _initialized:
            check(cuda.cuInit(0), "cuInit")
            _initialized = True


def driver_version() -> int:
    """The CUDA driver version as an integer, e.g. 13000 for 13.0."""
    return int(check(cuda.cuDriverGetVersion(), "cuDriverGetVersion"))


def device(ordinal: int) -> Any:
    """The `CUdevice` of a device ordinal (the same numbering as torch)."""
    init()
    return check(cuda.cuDeviceGet(ordinal), "cuDeviceGet", f"device {ordinal}")


def primary_context(ordinal: int) -> Any:
    """Retain (once per process) and return the primary context of a device: the one torch uses.

    NOTES: it is never released; a process that launched kernels keeps its context until exit.
    """
    with _init_lock:
        context = _primary.get(ordinal)
    if context is None:
        context = check(cuda.cuDevicePrimaryCtxRetain(device(ordinal)), "cuDevicePrimaryCtxRetain", f"device {ordinal}")
        with _init_lock:
            context = _primary.setdefault(ordinal, context)
    return context


@contextlib.contextmanager
def current_context(ordinal: int) -> Iterator[None]:
    """Make the device's primary context current for the duration of the block."""
    check(cuda.cuCtxPushCurrent(primary_context(ordinal)), "cuCtxPushCurrent", f"device {ordinal}")
    try:
        yield
    finally:
        check(cuda.cuCtxPopCurrent(), "cuCtxPopCurrent", f"device {ordinal}")


def stream_handle(stream: object) -> int:
    """The raw `CUstream` address of `stream`.

    Arguments:
        stream: an int (a raw handle; 0 is the legacy default stream), a torch stream (its
            `cuda_stream`), a `cuda.bindings` `CUstream`, or any object with `__cuda_stream__()`
            (e.g. a `cuda.core` stream).
    """
    if isinstance(stream, int):
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    if isinstance(stream, cuda.CUstream):
        return int(stream)
    protocol = getattr(stream, "__cuda_stream__", None)
    if callable(protocol):
        return int(protocol()[1])
    raise TypeError(f"cannot get a CUDA stream handle from {type(stream).__name__}")
