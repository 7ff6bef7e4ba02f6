"""A symmetric memory window: `ncclMemAlloc` memory registered on a communicator.

Every rank's window has the same size; peers reach it with LSA loads/stores over NVLink. The first
`workspace_bytes` hold counters and flags: they start zeroed and the kernels leave them zeroed.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from .communicator import Communicator
from .library import NCCL_WIN_COLL_SYMMETRIC

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


class SymmetricWindow:
    """`num_bytes` of symmetric device memory on every rank of `comm`, registered as one window.

    Arguments:
        comm: the communicator; registration is collective over its ranks.
        num_bytes: the window size, identical on every rank (checked before registering, since a
            registration that fails on one rank only would hang the others).
    """

    def __init__(self, comm: Communicator, num_bytes: int) -> None:
        self.comm = comm
        self.num_bytes = (num_bytes + WINDOW_ALIGNMENT - 1) // WINDOW_ALIGNMENT * WINDOW_ALIGNMENT
        sizes = [None] * comm.num_ranks
        dist.all_gather_object(sizes, self.num_bytes, group=comm.group)
        if len(set(sizes)) != 1:
            raise ValueError(f"window size differs between ranks: {sizes}; every rank must ask for the same size")

        lib = comm.lib
        ptr = ctypes.c_void_p()
        lib.call("ncclMemAlloc", ctypes.byref(ptr), ctypes.c_size_t(self.num_bytes))
        self.ptr = int(ptr.value)
        self.bytes = torch.as_tensor(_DeviceArray(self.ptr, self.num_bytes), device="cuda")
        self.bytes.zero_()
        torch.cuda.synchronize()
        window = ctypes.c_void_p()
        lib.call(
            "ncclCommWindowRegister",
            ctypes.c_void_p(comm.handle),
            ctypes.c_void_p(self.ptr),
            ctypes.c_size_t(self.num_bytes),
            ctypes.byref(window),
            NCCL_WIN_COLL_SYMMETRIC,
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
