"""An NCCL communicator over a torch process group: borrowed from torch, or our own.

Borrowed communicators belong to torch's ProcessGroupNCCL and are never destroyed by us; own ones
(created with ncclGetUniqueId + ncclCommInitRank over the group) are destroyed by `destroy()`.
"""

from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from deep_ep.errors import NCCLError

from .library import NCCL_UNIQUE_ID_BYTES, UniqueId, get_nccl_library


def torch_comm_ptr(group: dist.ProcessGroup) -> int:
    """The `ncclComm_t` torch's process group holds for `group` (0 when it has none, or no longer)."""
    try:
        backend = group._get_backend(torch.device("cuda"))
        return int(backend._comm_ptr())
    except (RuntimeError, AttributeError, ValueError):
        return 0


class Communicator:
    """An `ncclComm_t` spanning `group`, with this process's rank in it.

    Arguments:
        group: an NCCL process group; every rank of it must call this collectively.
        force_own: create our own communicator even when torch's can be borrowed.
    """

    def __init__(self, group: dist.ProcessGroup, force_own: bool = False) -> None:
        self.group = group
        self.rank = group.rank()
        self.num_ranks = group.size()
        self.lib = get_nccl_library()
        self.is_own = False
        self.handle = 0 if force_own else self._borrow()
        if self.handle == 0:
            self.handle = self._create()
            self.is_own = True

    def _borrow(self) -> int:
        ptr = torch_comm_ptr(self.group)
        if ptr == 0:
            # torch creates its communicator lazily, on the first collective
            probe = torch.zeros(1, device="cuda")
            dist.all_reduce(probe, group=self.group)
            torch.cuda.synchronize()
            ptr = torch_comm_ptr(self.group)
        return ptr

    def _create(self) -> int:
        unique_id = UniqueId()
        if self.rank == 0:
            self.lib.call("ncclGetUniqueId", ctypes.byref(unique_id))
        # ctypes.string_at, not a c_char field: the id holds zero bytes
        raw = torch.frombuffer(
            bytearray(ctypes.string_at(ctypes.addressof(unique_id), NCCL_UNIQUE_ID_BYTES)), dtype=torch.uint8
        ).cuda()
        dist.broadcast(raw, src=dist.get_global_rank(self.group, 0), group=self.group)
        ctypes.memmove(ctypes.addressof(unique_id), bytes(raw.cpu().tolist()), NCCL_UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        self.lib.call("ncclCommInitRank", ctypes.byref(comm), self.num_ranks, unique_id, self.rank)
        if not comm.value:
            raise NCCLError("ncclCommInitRank returned a null communicator")
        return int(comm.value)

    def destroy(self) -> None:
        """Destroy an own communicator (idempotent); a borrowed one is only forgotten."""
        if self.handle and self.is_own:
            self.lib.call("ncclCommDestroy", ctypes.c_void_p(self.handle))
        self.handle = 0
