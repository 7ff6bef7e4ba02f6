"""A symmetric memory window: `ncclMemAlloc` memory registered on a communicator.

Every rank's window has the same size; peers reach it with LSA loads/stores over NVLink. The first
`workspace_bytes` hold counters and flags: they start zeroed and the kernels leave them zeroed.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from deep_ep.jit.nccl_headers import version_string

from .communicator import Communicator
from .library import NCCL_WIN_COLL_SYMMETRIC, NCCL_WIN_STRICT_ORDERING, NCCL_WIN_STRICT_ORDERING_SINCE

WINDOW_ALIGNMENT = 4096


class _DeviceArray:
    """A raw device byte range exposed through `__cuda_array_interface__` for `torch.as_tensor`."""

    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _device_bytes(ptr: int, num_bytes: int) -> torch.Tensor:
    """`[num_bytes]` `torch.uint8` over device memory at `ptr` (not owned by torch)."""
    return torch.as_tensor(_DeviceArray(ptr, num_bytes), device="cuda")


def check_window_flags(flags: int, nccl_version: int) -> None:
    """Refuse `ncclCommWindowRegister` flags that NCCL `nccl_version` (its `NCCL_VERSION_CODE`) lacks:
    `NCCL_WIN_STRICT_ORDERING` exists from 2.30.4 on, and an older NCCL must never see it.

    Raises:
        ValueError: for a flag outside symmetric | strict ordering, or strict ordering below 2.30.4.
    """
    known = NCCL_WIN_COLL_SYMMETRIC | NCCL_WIN_STRICT_ORDERING
    if flags & ~known:
        raise ValueError(
            f"SymmetricWindow: `flags` {flags:#x} has bits outside {known:#x} (symmetric, strict ordering)"
        )
    if flags & NCCL_WIN_STRICT_ORDERING and nccl_version < NCCL_WIN_STRICT_ORDERING_SINCE:
        raise ValueError(
            f"SymmetricWindow: NCCL_WIN_STRICT_ORDERING needs NCCL >= {version_string(NCCL_WIN_STRICT_ORDERING_SINCE)}, "
            f"this process runs NCCL {version_string(nccl_version)}"
        )


class SymmetricWindow:
    """`num_bytes` of symmetric device memory on every rank of `comm`, registered as one window.

    Arguments:
        comm: the communicator; registration is collective over its ranks.
        num_bytes: the window size, identical on every rank (checked before registering, since a
            registration that fails on one rank only would hang the others).
        flags: `ncclCommWindowRegister`'s flags: `NCCL_WIN_COLL_SYMMETRIC`, with
            `NCCL_WIN_STRICT_ORDERING` for a window that GIN's VA signals go to (NCCL >= 2.30.4 only;
            one node's windows never ask for it).

    Raises:
        ValueError: for flags the loaded NCCL lacks (`check_window_flags`), before any NCCL call.
    """

    def __init__(self, comm: Communicator, num_bytes: int, flags: int = NCCL_WIN_COLL_SYMMETRIC) -> None:
        if flags != NCCL_WIN_COLL_SYMMETRIC:
            check_window_flags(flags, comm.lib.version())
        self.comm = comm
        self.flags = flags
        self.num_bytes = (num_bytes + WINDOW_ALIGNMENT - 1) // WINDOW_ALIGNMENT * WINDOW_ALIGNMENT
        sizes = [None] * comm.num_ranks
        dist.all_gather_object(sizes, self.num_bytes, group=comm.group)
        if len(set(sizes)) != 1:
            raise ValueError(f"window size differs between ranks: {sizes}; every rank must ask for the same size")

        lib = comm.lib
        ptr = ctypes.c_void_p()
        lib.call("ncclMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(self.num_bytes))
        self.ptr = int(ptr.value)
        self.bytes = _device_bytes(self.ptr, self.num_bytes)
        self.bytes.zero_()
        torch.cuda.synchronize()
        window = ctypes.c_void_p()
        lib.call(
            "ncclCommWindowRegister",
            ctypes.c_void_p(comm.handle),
            ctypes.c_void_p(self.ptr),
            ctypes.c_size_t(self.num_bytes),
            ctypes.byref(window),
            flags,
            comm=comm.handle,
        )
        self.handle = int(window.value)

    def view(self, offset: int, num_bytes: int) -> torch.Tensor:
        """A uint8 tensor over `[offset, offset + num_bytes)` of this rank's window."""
        return self.bytes[offset : offset + num_bytes]

    def destroy(self) -> None:
        """Deregister (collective) and free; idempotent."""
        if self.handle:
            torch.cuda.synchronize()
            self.comm.lib.call(
                "ncclCommWindowDeregister", ctypes.c_void_p(self.comm.handle), ctypes.c_void_p(self.handle)
            )
            self.handle = 0
        if self.ptr:
            self.bytes = None
            self.comm.lib.call("ncclMemFree", ctypes.c_void_p(self.ptr))
            self.ptr = 0
