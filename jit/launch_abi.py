"""`cuLaunchKernelEx` called straight through ctypes, with launch configs built once.

`cuda.bindings`' wrapper of `cuLaunchKernelEx` converts its config, function and parameter objects
on every call; measured on the H200 machine, one launch through it cost about 9 us of host time,
most of it in that conversion. Here the config is a ctypes mirror of `CUlaunchConfig` (its
attribute array included), made once per (kernel, grid, block, shared memory, flags, stream), and
the call goes to the driver's own entry point in `libcuda` with four raw pointers.

The mirrors follow `cuda.h` (CUDA 12 and 13 have the same layout); `tests/test_jit_launch_abi.py`
compiles the offsets and sizes of the C structs and compares them with these.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

_ATTRIBUTE_VALUE_BYTES = 64  # CUlaunchAttributeValue is a union padded to 64 bytes


class LaunchAttribute(ctypes.Structure):
    """`CUlaunchAttribute`: an id (an enum, padded to 8 bytes), then the value union."""

    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_ubyte * _ATTRIBUTE_VALUE_BYTES),
    ]


class LaunchConfig(ctypes.Structure):
    """`CUlaunchConfig`."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


class PreparedConfig:
    """A `CUlaunchConfig` and its attribute array, kept alive together.

    Arguments:
        grid, block: three dims each.
        shared_mem: dynamic shared memory per block in bytes.
        stream: the raw `CUstream` handle.
        attributes: `(id, values)` per attribute: the attribute's `CUlaunchAttributeID` and the
            32-bit words that start its value (`cooperative`, `programmaticStreamSerializationAllowed`:
            one word; `clusterDim`: x, y, z).
    """

    __slots__ = ("address", "attributes", "config")

    def __init__(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream: int,
                 attributes: list[tuple[int, tuple[int, ...]]]) -> None:  # fmt: skip
        self.attributes = (LaunchAttribute * max(len(attributes), 1))()
        for slot, (attribute_id, values) in zip(self.attributes, attributes, strict=False):
            slot.id = attribute_id
            words = (ctypes.c_uint * len(values))(*values)
            ctypes.memmove(slot.value, words, ctypes.sizeof(words))
        self.config = LaunchConfig(*grid, *block, shared_mem, stream or None,
                                   ctypes.cast(self.attributes, ctypes.POINTER(LaunchAttribute)), len(attributes))  # fmt: skip
        self.address = ctypes.addressof(self.config)


@functools.cache
def entry_point() -> Any:
    """`cuLaunchKernelEx` of the driver library this process uses (torch and cuda.bindings load the
    same one), called as `(config.address, CUfunction handle, void*[] address or None, None)`; it
    returns the `CUresult` (0 on success)."""
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return function
