"""The windows of one NVLink (NCCL LSA) domain: an NCCL window on a communicator over the group.

Every rank reaches every other rank's window through NCCL's LSA pointers (read once, by the one
kernel built against NCCL's device headers) and its own window through the address `ncclMemAlloc`
gave it, so that every access to one window from one rank uses one virtual address.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deep_ep.jit import I32, U64

from .. import specs
from .communicator import Communicator, torch_comm_ptr
from .device_comm import DeviceCommunicator
from .window import SymmetricWindow


class NcclPeerWindows:
    """`deep_ep.backends.kernels.transport.PeerWindows` over NCCL: a communicator, a device communicator (which checks
    that the group is one LSA domain) and a symmetric window.

    Arguments:
        group: an NCCL process group whose ranks all share one NVLink (LSA) domain (collective).
        num_bytes: the window size per rank.
        force_own_comm: create an own NCCL communicator instead of borrowing torch's.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: int, force_own_comm: bool = False) -> None:
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        self.comm = Communicator(group, force_own=force_own_comm)
        self.dev_comm = DeviceCommunicator(self.comm)
        if self.dev_comm.lsa_size != self.num_ranks or self.dev_comm.lsa_rank != self.rank:
            lsa = (self.dev_comm.lsa_rank, self.dev_comm.lsa_size)
            self.dev_comm.destroy()
            self.comm.destroy()
            raise ValueError(
                f"the group is not one NVLink domain: LSA (rank, size) = {lsa}, group = ({self.rank}, {self.num_ranks})"
            )
        self.window = SymmetricWindow(self.comm, num_bytes)
        self.ptr, self.num_bytes, self.bytes = self.window.ptr, self.window.num_bytes, self.window.bytes
        self.peer_ptrs = self._lsa_pointers()

    def _lsa_pointers(self) -> list[int]:
        out = torch.zeros(self.num_ranks, dtype=torch.int64, device="cuda")
        specs.load(specs.nccl_peer_pointers_spec()).launch(
            grid=(1,), block=(32,), args=(U64(self.window.handle), I32(self.num_ranks), out)
        )
        pointers = out.tolist()
        pointers[self.rank] = self.ptr
        return pointers

    def _torch_comm_gone(self) -> bool:
        """A borrowed communicator dies with torch's process group (`destroy_process_group`, often
        just before interpreter exit): NCCL then released our window and device communicator with
        it, and calling NCCL on them would touch freed memory."""
        if self.comm.is_own:
            return False
        registered = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
        if registered is not None and self.group not in registered:
            return True
        return torch_comm_ptr(self.group) != self.comm.handle

    def destroy(self) -> None:
        """Release the device communicator, the window, its memory and an own communicator, in that
        order; idempotent. After torch destroyed a borrowed communicator only our memory is freed."""
        if self.comm.handle and self._torch_comm_gone():
            self.dev_comm.alive = False
            self.window.handle = 0
        for resource in (self.dev_comm, self.window, self.comm):
            resource.destroy()
