"""How one rank's kernels reach their peers: the `Transport::Args` each kernel gets
(include/deep_ep/transport/), and the resources behind them.

Every communication kernel and epilogue takes its transport's arguments as its last parameter. Over
LSA they only name the peers' window table; the emulated NIC of virtual nodes (strict mode) has a
descriptor queue per kernel class, because a communication kernel and its epilogue run at once and
each runs its own NIC CTA (`nic_ctas` more CTAs per launch); GIN's are NCCL's device communicator
(`deep_ep.backends.kernels.nccl.gin_links`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from deep_ep.host_reads import host_list

from . import specs
from .layout import PEER_WINDOWS_OFFSET

if TYPE_CHECKING:
    from .transport import PeerWindows

# The kernel classes that may run at once on one rank, each with its own NIC queue: a communication
# kernel (dispatch, combine, barrier), its epilogue, and the post of a host's fault (its own stream)
KERNEL_CLASSES = ("comm", "epilogue", "fault")
# Descriptors per NIC context: a bound on what is in flight, not on what a kernel posts
NIC_CAPACITY = 4096


class KernelLinks(Protocol):
    """The transport arguments of one rank's kernels. Made before the rank's windows open (its
    memory with the rest of the rank's), told of them by `attach` once they are.

    Attributes:
        kind: the transport (`specs.TRANSPORTS`), which the kernels are specialised for.
        nic_ctas: the CTAs each launch adds for an emulated NIC (0 or 1).
    """

    kind: str
    nic_ctas: int

    def attach(self, windows: PeerWindows) -> None:
        """Every rank's window of the buffer is open (`windows`)."""
        ...

    def args(self, kernel_class: str, num_qps: int = 0) -> bytes:
        """`Transport::Args` of a kernel of `kernel_class` (`KERNEL_CLASSES`), using `num_qps` QPs
        (GIN; 0: all the buffer's)."""
        ...


class LsaLinks:
    """Every peer in the scale-up domain: the kernels store into the peers' windows themselves."""

    kind = "lsa"
    nic_ctas = 0

    def __init__(self) -> None:
        self._args = b""

    def attach(self, windows: PeerWindows) -> None:
        self._args = bytes(specs.LsaTransportArgs(peer_windows=windows.ptr + PEER_WINDOWS_OFFSET, rank=windows.rank))

    def args(self, kernel_class: str, num_qps: int = 0) -> bytes:
        return self._args


@dataclass(frozen=True)
class NicOptions:
    """How the emulated NIC of virtual nodes behaves (transport/emulated.cuh).

    Attributes:
        strict: run puts late, shuffled, by a NIC CTA (else the calling warp copies at once).
        delay_us: strict: the least time a put waits in the NIC.
        seed: strict: the seed of the order in which the NIC runs ready puts.
        mistake: break the protocol on purpose (`specs.NIC_MISTAKES`: tests only).
        ring_entries_per_warp: the staging ring's entries per warp (default: enough for the buffer's
            top-k; 1 makes every second record of a warp reuse an entry, which a missing flush exposes).
    """

    strict: bool = True
    delay_us: float = 10.0
    seed: int = 0
    mistake: str | None = None
    ring_entries_per_warp: int | None = None

    @property
    def kind(self) -> str:
        return "emulated-strict" if self.strict else "emulated-eager"


class EmulatedLinks:
    """The emulated NIC of one virtual rank: the table of every rank's window (the NIC reaches them
    all, the kernels only their node's), and in strict mode a descriptor queue per kernel class.

    Arguments:
        options: the NIC's behaviour.
        num_ranks: the ranks of the buffer.
        device: the GPU of the windows.
        timeout_ns: the NIC's deadline (longer than any kernel's waits: it drains after them).
    """

    def __init__(self, options: NicOptions, num_ranks: int, device: torch.device, timeout_ns: int) -> None:
        if options.mistake not in specs.NIC_MISTAKES:
            raise ValueError(
                f"NicOptions: `mistake` must be one of {list(specs.NIC_MISTAKES)}, got {options.mistake!r}"
            )
        self.options = options
        self.kind = options.kind
        self.nic_ctas = int(options.strict)
        self.rank = 0
        self._timeout_ns = timeout_ns
        self._table = torch.zeros(num_ranks, dtype=torch.int64, device=device)
        # What this rank handed to its NIC, every kernel class together (`specs.NIC_TRAFFIC_WORDS`)
        self._traffic = torch.zeros(len(specs.NIC_TRAFFIC_WORDS), dtype=torch.int64, device=device)
        self._queues: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if options.strict:
            # A free descriptor's head holds the slot that takes it next: entry e, slot e (one lap)
            heads = torch.arange(NIC_CAPACITY, dtype=torch.int64).repeat(specs.NIC_CONTEXTS) << 32
            for kernel_class in KERNEL_CLASSES:
                queue = torch.zeros(specs.NIC_CONTEXTS * NIC_CAPACITY, 4, dtype=torch.int64)
                queue[:, 0] = heads
                words = torch.zeros(specs.NIC_WORDS, dtype=torch.int32)
                self._queues[kernel_class] = (queue.to(device), words.to(device))
        self._args: dict[str, bytes] = {}

    def attach(self, windows: PeerWindows) -> None:
        self.rank = windows.rank
        self._table.copy_(torch.tensor(windows.peer_ptrs, dtype=torch.int64))
        self._args = {kernel_class: self._pack(kernel_class) for kernel_class in KERNEL_CLASSES}

    def _pack(self, kernel_class: str) -> bytes:
        queue, words = self._queues.get(kernel_class, (None, None))
        return bytes(specs.EmulatedTransportArgs(
            peer_windows=self._table.data_ptr(), queue=0 if queue is None else queue.data_ptr(),
            words=0 if words is None else words.data_ptr(), capacity=NIC_CAPACITY, rank=self.rank, context=0,
            mistake=specs.NIC_MISTAKES[self.options.mistake], seed=(self.options.seed * 7919 + self.rank) & 0xFFFFFFFF,
            delay_ns=int(self.options.delay_us * 1e3), timeout_ns=self._timeout_ns,
            traffic=self._traffic.data_ptr()))  # fmt: skip

    def args(self, kernel_class: str, num_qps: int = 0) -> bytes:
        return self._args[kernel_class]

    def traffic(self) -> dict[str, int]:
        """What this rank's kernels handed to the NIC since the buffer was made: `bytes` put, `puts`
        and `signals` (counted when posted). Call it once the rank's kernels are done (its
        communication stream drained): it reads the device after the current stream drains."""
        return dict(zip(specs.NIC_TRAFFIC_WORDS, host_list(self._traffic), strict=True))

    def nic_status(self, kernel_class: str) -> int:
        """The strict NIC's status word of `kernel_class`'s queue (0: fine, -1: past its deadline,
        -2: a post found no free entry in time); 0 in eager mode. Reads the device (a host wait)."""
        if kernel_class not in self._queues:
            return 0
        return int(self._queues[kernel_class][1][-1].item())
