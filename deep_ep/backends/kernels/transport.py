"""Which peer windows a group's buffers use (the transport), and the part of the GPU a rank's
kernels may use.

The kernels reach the peers of their scale-up domain by loads and stores, and the others through a
transport's put and signal (docs/transport.md). The windows come from:

- `nccl_lsa`: the ranks of one NVLink domain, one GPU each: an NCCL symmetric window, whose peers'
  LSA pointers one small kernel reads (`nccl.peer_windows`).
- `nccl_gin`: the ranks of several nodes (NCCL >= 2.30.4): the node's ranks as for `nccl_lsa`, the
  others through NCCL GIN in direct mode (`nccl.gin_windows`, `nccl.gin_links.GinLinks`). Never
  run on a NIC, so `backend='auto'` does not take it (`TransportChoice.auto`).
- `loopback`: the virtual ranks of one GPU (`deep_ep.loopback`): every rank's window in one
  allocation of that GPU; with virtual nodes, the ranks of other nodes only through the emulated
  NIC (`links.EmulatedLinks`).

`choose_transport(group)` says which one a group would use and why (a local answer, no
communication); `open_transport(group)` gives a buffer's rank its share of the GPU, its kernels'
transport arguments and the collective call that opens the windows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from deep_ep.backends.base import loopback_world_of
from deep_ep.domains import get_physical_domain_size, group_device
from deep_ep.jit.nccl_headers import version_string
from deep_ep.planner import default_num_allocated_qps

from . import specs
from .layout import MAX_RANKS
from .links import EmulatedLinks, KernelLinks, LsaLinks
from .nccl.gin import scale_out_version_error
from .nccl.gin_links import GinLinks
from .nccl.gin_windows import GinPeerWindows
from .nccl.peer_windows import NcclPeerWindows


class PeerWindows(Protocol):
    """Every rank's window of one buffer, as this rank sees them.

    Attributes:
        rank: this rank.
        num_ranks: the number of ranks.
        ptr: this rank's window base, the address its kernels write it through.
        num_bytes: the window size (the same on every rank).
        bytes: `[num_bytes]` `torch.uint8`, this rank's window.
        peer_ptrs: every rank's window base as this rank's kernels reach it (`peer_ptrs[rank] == ptr`).
    """

    rank: int
    num_ranks: int
    ptr: int
    num_bytes: int
    bytes: torch.Tensor
    peer_ptrs: list[int]

    def destroy(self) -> None: ...


def _load_each(kernel_specs: Sequence[Any]) -> list[Any]:
    return [specs.load(spec) for spec in kernel_specs]


@dataclass(frozen=True)
class DeviceShare:
    """The part of the GPU one rank's kernels may use, and where they get kernels and memory.

    Attributes:
        num_sms: the SMs one rank's kernels may use (the device's, or a virtual rank's share).
        exclusive: the communication kernel and its epilogue must fit `num_sms` together (virtual
            ranks share the GPU: a grid waiting for a peer on SMs that the peer's kernels need would
            starve it); otherwise an epilogue may queue behind a running communication kernel.
        empty: allocates a tensor (`torch.empty`'s `(shape, dtype=..., device=...)`).
        load: loads the kernels of `specs` (one operation's, before its first launch).
        guarded: `empty` surrounds each output with guard bytes (`LoopbackWorld(guard_bytes=...)`),
            which the steady path's own allocations would not.
        shared: other ranks' kernels run on this GPU too (virtual ranks), so a driver call that waits
            for the device's kernels (building a CUDA graph) can wait for a peer that waits for us.
    """

    num_sms: int
    exclusive: bool = False
    empty: Callable[..., torch.Tensor] = torch.empty
    load: Callable[[Sequence[Any]], list[Any]] = _load_each
    guarded: bool = False
    shared: bool = False

    @classmethod
    def whole_device(cls) -> DeviceShare:
        """The whole current CUDA device, for a rank that has a GPU of its own."""
        return cls(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


@dataclass(frozen=True)
class TransportChoice:
    """Which transport a group would use, and why (`choose_transport`).

    Attributes:
        name: `'nccl_lsa'`, `'nccl_gin'` or `'loopback'`; `None` when the kernels cannot serve the group.
        reason: one sentence that says why this transport, or why none.
        auto: whether `backend='auto'` may take the kernels for it; `False` for `nccl_gin`, whose GIN
            path has never run on a NIC (`backend='kernels'` takes any supported transport).
    """

    name: str | None
    reason: str
    auto: bool = True

    @property
    def supported(self) -> bool:
        """Whether the kernels can serve the group (some transport reaches every peer's window)."""
        return self.name is not None


def choose_transport(group: dist.ProcessGroup) -> TransportChoice:
    """Which transport `group` would use, from here (local answer, no communication).

    The virtual ranks of one CUDA world use `loopback`; an NCCL group no larger than this host's
    GPU count, whose GPUs all reach each other, uses `nccl_lsa`. The hard check comes when a buffer
    opens its windows: NCCL's LSA team must span exactly the group.
    """
    num_ranks = group.size()
    world = loopback_world_of(group)
    if world is not None:
        if world.device.type != "cuda":
            return TransportChoice(None, f"the virtual ranks live on {world.device}, the kernels need a CUDA device")
        if num_ranks > MAX_RANKS:
            return TransportChoice(None, f"{num_ranks} virtual ranks, the kernels support at most {MAX_RANKS}")
        if world.num_ranks_per_node < num_ranks:
            nodes = f"{num_ranks // world.num_ranks_per_node} virtual nodes of {world.num_ranks_per_node}"
            return TransportChoice("loopback", f"{num_ranks} virtual ranks of {world.device} in {nodes}; across "
                                               f"nodes through the emulated NIC ({world.nic.kind})")  # fmt: skip
        return TransportChoice("loopback", f"{num_ranks} virtual ranks of {world.device}")
    if not torch.cuda.is_available():
        return TransportChoice(None, "CUDA is not available")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return TransportChoice(None, f"the group's backend is {backend!r}, not NCCL")
    return choose_nccl_transport(num_ranks)


def choose_nccl_transport(num_ranks: int) -> TransportChoice:
    """Which transport an NCCL group of `num_ranks` ranks of this host, one GPU each, would use, and
    why (`choose_transport` past its checks of the group; `deep-ep info` asks it without a group)."""
    if not torch.cuda.is_available():
        return TransportChoice(None, "CUDA is not available")
    num_devices = torch.cuda.device_count()
    if num_ranks > num_devices:
        return scale_out_choice(num_ranks, num_devices, loaded_nccl_version())
    if num_ranks > MAX_RANKS:
        return TransportChoice(None, f"{num_ranks} ranks, more than the kernels' {MAX_RANKS}")
    for a in range(num_devices):
        for b in range(num_devices):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return TransportChoice(None, f"GPU {a} cannot reach GPU {b}'s memory (no peer access)")
    ranks = "1 NCCL rank" if num_ranks == 1 else f"{num_ranks} NCCL ranks"
    gpus = "1 GPU" if num_devices == 1 else f"{num_devices} GPUs"
    peers = "no peers to reach" if num_ranks == 1 else "all peers reachable"
    return TransportChoice("nccl_lsa", f"{ranks} on this host's {gpus}, {peers}")


def loaded_nccl_version() -> int | None:
    """`ncclGetVersion()` of the libnccl this process uses, or `None` when there is none to load."""
    from deep_ep.jit import NCCLHeadersError, nccl_runtime_version

    try:
        return nccl_runtime_version()
    except (NCCLHeadersError, OSError):
        return None


def scale_out_choice(num_ranks: int, num_local_gpus: int, nccl_version: int | None) -> TransportChoice:
    """The answer for an NCCL group of `num_ranks` ranks, more than this host's `num_local_gpus`
    GPUs (so across hosts), with NCCL `nccl_version` loaded (`None`: none found): across hosts the
    kernels need GIN (NCCL >= 2.30.4); with it, `nccl_gin`, which `backend='auto'` does not take
    (never run on a NIC) and `backend='kernels'` does."""
    where = f"{num_ranks} ranks, more than this host's {num_local_gpus} GPUs, so the group spans hosts"
    if nccl_version is None:
        return TransportChoice(None, f"{where}, and no NCCL library could be loaded to carry it")
    error = scale_out_version_error(nccl_version)
    if error is not None:
        return TransportChoice(None, f"{where}: {error}")
    return TransportChoice("nccl_gin", f"{where}: the kernels reach the other hosts' ranks through NCCL GIN in "
                                       f"direct mode (NCCL {version_string(nccl_version)}); the GIN backend is read "
                                       "from ncclCommQueryProperties when a buffer is created. GIN has never run on "
                                       "a NIC in this project's tests, so backend='auto' takes the reference "
                                       "backend: pass backend='kernels' to use it", auto=False)  # fmt: skip


@dataclass(frozen=True)
class Transport:
    """How one rank of a buffer reaches its peers' windows (`open_transport`).

    Attributes:
        name: `'nccl_lsa'`, `'nccl_gin'` or `'loopback'`.
        share: the part of the GPU this rank's kernels may use.
        num_ranks: the ranks of the group.
        num_scaleup_ranks: the ranks of each scale-up domain (consecutive ranks): the peers of a
            rank's own it reaches by stores, the others through the transport (`num_ranks`: none).
        open_windows: opens every rank's window of the buffer, of the given bytes (collective; call
            it once this rank's own memory is allocated).
        make_links: its kernels' transport arguments (`links.KernelLinks`) for a deadline in
            nanoseconds, made before the windows open and told of them once they are.
    """

    name: str
    share: DeviceShare
    num_ranks: int
    num_scaleup_ranks: int
    open_windows: Callable[[int], PeerWindows]
    make_links: Callable[[int], KernelLinks]

    @property
    def has_remote_peers(self) -> bool:
        """Whether some peer is outside this rank's scale-up domain (a scale-out region is needed)."""
        return self.num_scaleup_ranks < self.num_ranks


def open_transport(group: dist.ProcessGroup, num_allocated_qps: int = 0,
                   physical_domain_size: tuple[int, int] | None = None) -> Transport:  # fmt: skip
    """The transport of a buffer on `group`.

    Virtual ranks take their world's share and windows, and with virtual nodes its emulated NIC (no
    communication). Otherwise the rank has the whole current device and an NCCL window, and the
    group's hosts count (`physical_domain_size`, else `deep_ep.domains.get_physical_domain_size`,
    collective): on one host
    the window is one NVLink domain's (`EP_NCCL_OWN_COMM=1`: on an NCCL communicator of our own
    instead of borrowing torch's), across hosts `nccl_gin` (`open_gin_transport`).

    Arguments:
        group: the buffer's group (every rank calls this).
        num_allocated_qps: the buffer's queue pairs: GIN contexts across hosts (`0`: V2's default
            for direct mode, `planner.default_num_allocated_qps(False)`).
        physical_domain_size: `(hosts, ranks per host)`, when the caller counted them already (the
            facade does, for every buffer); `None`: counted here.
    """
    world = loopback_world_of(group)
    rank, num_ranks = group.rank(), group.size()
    if world is not None:

        def make_links(timeout_ns: int) -> KernelLinks:
            if world.num_ranks_per_node == num_ranks:
                return LsaLinks()
            return EmulatedLinks(world.nic, num_ranks, world.device, timeout_ns)

        return Transport("loopback", world.device_share(rank), num_ranks, world.num_ranks_per_node,
                         lambda num_bytes: world.open_windows(rank, num_bytes), make_links)  # fmt: skip
    num_nodes, num_ranks_per_node = physical_domain_size or get_physical_domain_size(group)
    if num_nodes > 1:
        return open_gin_transport(group, num_ranks_per_node, num_allocated_qps)
    own_comm = os.environ.get("EP_NCCL_OWN_COMM", "0") == "1"
    return Transport("nccl_lsa", DeviceShare.whole_device(), num_ranks, num_ranks,
                     lambda num_bytes: NcclPeerWindows(group, num_bytes, own_comm), lambda _: LsaLinks())  # fmt: skip


def _all_ranks_agree(group: dist.ProcessGroup, fine: bool) -> bool:
    """Whether `fine` holds on every rank of `group` (collective: one all-reduce)."""
    flag = torch.tensor([int(fine)], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def open_gin_transport(group: dist.ProcessGroup, num_ranks_per_node: int, num_allocated_qps: int = 0) -> Transport:
    """The `nccl_gin` transport of a buffer on an NCCL `group` of several hosts with
    `num_ranks_per_node` ranks each (collective: every rank agrees first).

    Only a group for which every rank's `choose_nccl_transport` said `nccl_gin` gets it: that answer
    keeps `backend='auto'` off GIN, so a group it could not see spanning hosts (no more ranks than
    this host's GPUs) is refused here rather than run over a transport nobody asked for.

    Raises:
        ValueError: on every rank, when some rank's answer was not `nccl_gin`.
    """
    num_ranks = group.size()
    choice = choose_nccl_transport(num_ranks)
    if not _all_ranks_agree(group, choice.name == "nccl_gin"):
        num_nodes = num_ranks // num_ranks_per_node
        raise ValueError(
            f"the group spans {num_nodes} hosts of {num_ranks_per_node} ranks, but the kernels' GIN transport "
            f"(nccl_gin) was not every rank's answer (here: {choice.name or 'none'}: {choice.reason}); it is "
            "taken only for a group larger than each host's GPUs, with NCCL >= 2.30.4; backend='reference' "
            "serves the group"
        )
    num_qps = num_allocated_qps or default_num_allocated_qps(False)
    return Transport("nccl_gin", DeviceShare.whole_device(), num_ranks, num_ranks_per_node,
                     lambda num_bytes: GinPeerWindows(group, num_bytes, num_ranks_per_node, num_qps),
                     lambda _: GinLinks())  # fmt: skip
