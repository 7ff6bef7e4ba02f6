"""Which peer windows a group's buffers use (the transport), and the part of the GPU a rank's
kernels may use.

The kernels reach every peer's window by loads and stores. Two transports provide the windows:

- `nccl_lsa`: the ranks of one NVLink domain, one GPU each: an NCCL symmetric window, whose peers'
  LSA pointers one small kernel reads (`nccl.peer_windows`).
- `loopback`: the virtual ranks of one GPU (`deep_ep.loopback`): every rank's window in one
  allocation of that GPU.

`choose_transport(group)` says which one a group would use and why (a local answer, no
communication); `open_transport(group, num_bytes)` gives a buffer's rank its share of the GPU and
the collective call that opens the windows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from deep_ep.backends.base import loopback_world_of
from deep_ep.jit.nccl_headers import version_string

from . import specs
from .layout import MAX_RANKS
from .nccl.gin import scale_out_version_error
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
    """

    num_sms: int
    exclusive: bool = False
    empty: Callable[..., torch.Tensor] = torch.empty
    load: Callable[[Sequence[Any]], list[Any]] = _load_each

    @classmethod
    def whole_device(cls) -> DeviceShare:
        """The whole current CUDA device, for a rank that has a GPU of its own."""
        return cls(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


@dataclass(frozen=True)
class TransportChoice:
    """Which transport a group would use, and why (`choose_transport`).

    Attributes:
        name: `'nccl_lsa'` or `'loopback'`; `None` when the kernels cannot serve the group.
        reason: one sentence that says why this transport, or why none.
    """

    name: str | None
    reason: str

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
            return TransportChoice(None, f"{num_ranks // world.num_ranks_per_node} virtual nodes: the kernels' "
                                         "transport across nodes (GIN) is not built yet")  # fmt: skip
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
    kernels need GIN (NCCL >= 2.30.4), and their GIN direct mode is not built yet."""
    where = f"{num_ranks} ranks, more than this host's {num_local_gpus} GPUs, so the group spans hosts"
    if nccl_version is None:
        return TransportChoice(None, f"{where}, and no NCCL library could be loaded to carry it")
    error = scale_out_version_error(nccl_version)
    if error is not None:
        return TransportChoice(None, f"{where}: {error}")
    return TransportChoice(None, f"{where}: across hosts the kernels need their GIN direct mode, which is not "
                                 f"built yet (NCCL {version_string(nccl_version)} would carry it); "
                                 "backend='reference' serves the group")  # fmt: skip


@dataclass(frozen=True)
class Transport:
    """How one rank of a buffer reaches its peers' windows (`open_transport`).

    Attributes:
        name: `'nccl_lsa'` or `'loopback'`.
        share: the part of the GPU this rank's kernels may use.
        open_windows: opens every rank's window of the buffer (collective; call it once this rank's
            own memory is allocated).
    """

    name: str
    share: DeviceShare
    open_windows: Callable[[], PeerWindows]


def open_transport(group: dist.ProcessGroup, num_bytes: int) -> Transport:
    """The transport of a buffer of `num_bytes` per rank on `group` (no communication yet).

    Virtual ranks take their world's share and windows; otherwise the rank has the whole current
    device and an NCCL window (`EP_NCCL_OWN_COMM=1`: on an NCCL communicator of our own instead of
    borrowing torch's).
    """
    world = loopback_world_of(group)
    rank = group.rank()
    if world is not None:
        return Transport("loopback", world.device_share(rank), lambda: world.open_windows(rank, num_bytes))
    own_comm = os.environ.get("EP_NCCL_OWN_COMM", "0") == "1"
    return Transport("nccl_lsa", DeviceShare.whole_device(), lambda: NcclPeerWindows(group, num_bytes, own_comm))
