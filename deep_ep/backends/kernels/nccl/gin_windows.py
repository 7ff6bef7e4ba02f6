"""The windows of a group across nodes: an NCCL window that the ranks of this rank's node reach by
stores (NCCL's LSA pointers, as `peer_windows`) and the ranks of other nodes through GIN.

GIN is asked for only on an NCCL communicator of our own (never torch's: a failed GIN setup leaves a
communicator unusable), and only once `ncclCommQueryProperties` said it is usable there: a query,
never a try (docs/transport.md, section 4). Every check that one rank could fail alone is agreed on
by all ranks first, so that a refusal raises on every rank instead of leaving the others waiting in
a collective NCCL call. Nothing here has run on a NIC: no machine of this project has one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deep_ep.jit import I32, U64

from .. import specs
from .communicator import Communicator
from .device_comm import DeviceCommunicator
from .gin import GinProperties, query_gin, scale_out_version_error
from .gin_links import gin_transport_kind
from .library import NCCL_WIN_COLL_SYMMETRIC, NCCL_WIN_STRICT_ORDERING
from .window import SymmetricWindow

# GIN's VA signals must be ordered after the puts before them (docs/transport.md, section 4)
GIN_WINDOW_FLAGS = NCCL_WIN_COLL_SYMMETRIC | NCCL_WIN_STRICT_ORDERING


def agree(group: dist.ProcessGroup, reason: str | None) -> None:
    """Every rank's verdict of one check (`None`: fine), exchanged (collective); raise the first
    failing rank's reason on every rank.

    Raises:
        ValueError: when some rank's `reason` is not `None`.
    """
    reasons: list[str | None] = [None] * group.size()
    dist.all_gather_object(reasons, reason, group=group)
    for rank, text in enumerate(reasons):
        if text is not None:
            where = "" if rank == group.rank() else f" (found by rank {rank})"
            raise ValueError(f"{text}{where}")


def lsa_team_error(rank: int, num_ranks: int, num_ranks_per_node: int, lsa_rank: int, lsa_size: int) -> str | None:
    """Why NCCL's LSA team of `rank` is not its node, or `None` when it is: the kernels take a node
    to be `num_ranks_per_node` consecutive ranks, reached by stores, and NCCL's team must be exactly
    that (`lsa_size == num_ranks_per_node`, `lsa_rank == rank % lsa_size`)."""
    if num_ranks_per_node < 1 or num_ranks % num_ranks_per_node != 0:
        return f"GIN windows: {num_ranks} ranks do not split into nodes of {num_ranks_per_node}"
    if lsa_size != num_ranks_per_node or lsa_rank != rank % num_ranks_per_node:
        return (
            f"GIN windows: NCCL's LSA team of rank {rank} is not its node: LSA (rank, size) = ({lsa_rank}, "
            f"{lsa_size}), expected ({rank % num_ranks_per_node}, {num_ranks_per_node}) for nodes of "
            f"{num_ranks_per_node} consecutive ranks (every GPU of a node must reach the others by NVLink)"
        )
    return None


def node_peer_pointers(rank: int, num_ranks: int, lsa_pointers: list[int]) -> list[int]:
    """Every rank's window base as this rank reaches it (`[num_ranks]`): the LSA pointers of this
    rank's node (`lsa_pointers`, by LSA rank) at the node's ranks, 0 for every rank of another node
    (reached through GIN only)."""
    lsa_size = len(lsa_pointers)
    first = rank - rank % lsa_size
    pointers = [0] * num_ranks
    pointers[first : first + lsa_size] = lsa_pointers
    return pointers


class GinPeerWindows:
    """`deep_ep.backends.kernels.transport.PeerWindows` of a group across nodes, over NCCL GIN in
    direct mode: an own communicator, what NCCL says of GIN on it, a device communicator with
    `num_qps` GIN contexts, and a window registered for VA signals.

    Arguments:
        group: an NCCL process group of whole nodes of `num_ranks_per_node` consecutive ranks each
            (collective).
        num_bytes: the window size per rank.
        num_ranks_per_node: the ranks of each node (`deep_ep.domains.get_physical_domain_size`).
        num_qps: the GIN contexts to allocate (one per QP: the buffer's `num_allocated_qps`).

    Attributes:
        rank, num_ranks, ptr, num_bytes, bytes, peer_ptrs: as `PeerWindows`.
        properties: what NCCL said of GIN on the communicator (`ncclCommQueryProperties`).
        dev_comm: the device communicator (GIN contexts; its LSA team is this rank's node).
        window: the registered window (`window.handle`: the `ncclWindow_t` the kernels take).
        num_qps: the GIN contexts allocated.

    Raises:
        ValueError: on every rank, when some rank's NCCL is older than 2.30.4, GIN is not usable
            there (NCCL's reason), or NCCL's LSA team is not the node; what was made is destroyed.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: int, num_ranks_per_node: int, num_qps: int) -> None:
        if isinstance(num_qps, bool) or not isinstance(num_qps, int) or num_qps < 1:
            raise ValueError(f"GinPeerWindows: `num_qps` must be an int >= 1 (one GIN context per QP), got {num_qps!r}")
        self.group = group
        self.rank, self.num_ranks = group.rank(), group.size()
        self.num_ranks_per_node = num_ranks_per_node
        self.num_qps = num_qps
        self.dev_comm: DeviceCommunicator | None = None
        self.window: SymmetricWindow | None = None
        self.comm = Communicator(group, force_own=True)
        try:
            self.properties = self._query()
            self.dev_comm = DeviceCommunicator(self.comm, gin_contexts=num_qps, gin_mode="direct")
            agree(group, lsa_team_error(self.rank, self.num_ranks, num_ranks_per_node, self.dev_comm.lsa_rank,
                                        self.dev_comm.lsa_size))  # fmt: skip
            self.window = SymmetricWindow(self.comm, num_bytes, flags=GIN_WINDOW_FLAGS)
            self.ptr, self.num_bytes, self.bytes = self.window.ptr, self.window.num_bytes, self.window.bytes
            self.peer_ptrs = node_peer_pointers(self.rank, self.num_ranks, self._lsa_pointers())
        except BaseException:
            self.destroy()
            raise

    def _query(self) -> GinProperties:
        """The NCCL release, then what NCCL says of GIN on our communicator, before any GIN request."""
        version_error = scale_out_version_error(self.comm.lib.version())
        agree(self.group, None if version_error is None else f"GIN windows: {version_error}")
        properties = query_gin(self.comm)
        reason = None
        try:
            gin_transport_kind(properties)
        except ValueError as error:
            reason = f"GIN windows: NCCL cannot carry this group across nodes: {error}; backend='reference' serves it"
        agree(self.group, reason)
        return properties

    def _lsa_pointers(self) -> list[int]:
        """This node's window bases by LSA rank, read by the one kernel built against NCCL's device
        headers; our own is the address `ncclMemAlloc` gave (one address per window and rank)."""
        assert self.window is not None and self.dev_comm is not None
        lsa_size = self.dev_comm.lsa_size
        out = torch.zeros(lsa_size, dtype=torch.int64, device="cuda")
        specs.load(specs.nccl_peer_pointers_spec()).launch(
            grid=(1,), block=(32,), args=(U64(self.window.handle), I32(lsa_size), out)
        )
        pointers = out.tolist()
        pointers[self.dev_comm.lsa_rank] = self.ptr
        return pointers

    def destroy(self) -> None:
        """Release the device communicator, the window and its memory, and the communicator (ours),
        in that order; idempotent, and safe on a half-built object."""
        for resource in (self.dev_comm, self.window, self.comm):
            if resource is not None:
                resource.destroy()
