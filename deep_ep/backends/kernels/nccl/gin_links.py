"""The kernels' transport arguments over NCCL GIN (`deep_ep::transport::Gin::Args`, transport/gin.cuh).

`Gin::Args` is `{ ncclDevComm comm; ncclWindow_t window; int context; int num_contexts; }`, passed by
value. `ncclDevComm` changes size between NCCL releases (200 bytes in 2.28.9, 240 in 2.30.4, 248 in
2.31.2 and 2.32.3; 8-byte aligned in all), so the offsets are computed in one place from its size
(`gin_args_layout`), and gin.cuh checks the same formula against the real struct with `static_assert`s:
CI compiles gin.cuh against every NCCL release it supports, so host and device agree or the build
fails. Nothing here has run on a NIC: no machine of this project has one.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .. import specs
from .gin import GinProperties

if TYPE_CHECKING:
    from ..transport import PeerWindows

# `ncclWindow_t` is a pointer
_WINDOW_BYTES = 8
# `ncclDevComm` is 8-byte aligned in every release (checked by gin.cuh's static_asserts), so `Args` is too
_ARGS_ALIGNMENT = 8


@dataclass(frozen=True)
class GinArgsLayout:
    """Byte offsets of `Gin::Args`'s fields, and its size.

    Attributes:
        comm: `ncclDevComm comm` (always 0).
        window: `ncclWindow_t window`.
        context: `int context`.
        num_contexts: `int num_contexts`.
        size: `sizeof(Gin::Args)`, tail padding included (the driver checks a parameter's size).
    """

    comm: int
    window: int
    context: int
    num_contexts: int
    size: int


def gin_args_layout(dev_comm_bytes: int) -> GinArgsLayout:
    """The layout of `Gin::Args` for an `ncclDevComm` of `dev_comm_bytes` bytes (`sizeof`, the shim's
    `ep_dev_comm_bytes()`): the window at the next multiple of 8, the two ints after it, the whole a
    multiple of 8. gin.cuh `static_assert`s the same numbers against the compiled struct.

    Raises:
        ValueError: for a size that is not a positive int.
    """
    if isinstance(dev_comm_bytes, bool) or not isinstance(dev_comm_bytes, int) or dev_comm_bytes <= 0:
        raise ValueError(f"gin_args_layout: `dev_comm_bytes` must be an int > 0, got {dev_comm_bytes!r}")
    window = -(-dev_comm_bytes // _ARGS_ALIGNMENT) * _ARGS_ALIGNMENT
    context = window + _WINDOW_BYTES
    num_contexts = context + 4
    size = -(-(num_contexts + 4) // _ARGS_ALIGNMENT) * _ARGS_ALIGNMENT
    return GinArgsLayout(0, window, context, num_contexts, size)


def pack_gin_args(dev_comm: bytes, window: int, context: int, num_contexts: int) -> bytes:
    """`Gin::Args` as the bytes a kernel takes by value.

    Arguments:
        dev_comm: the `ncclDevComm` struct's raw bytes (`DeviceCommunicator.raw`).
        window: the `ncclWindow_t` handle.
        context: the first GIN context of the call.
        num_contexts: the contexts its warps take in turn (`Gin::for_warp`).
    """
    layout = gin_args_layout(len(dev_comm))
    out = bytearray(layout.size)
    out[layout.comm : layout.comm + len(dev_comm)] = dev_comm
    struct.pack_into("<Q", out, layout.window, window)  # little-endian, as the GPU and its host
    struct.pack_into("<i", out, layout.context, context)
    struct.pack_into("<i", out, layout.num_contexts, num_contexts)
    return bytes(out)


def gin_transport_kind(properties: GinProperties) -> str:
    """The kernels' transport (`specs.TRANSPORTS`) for the GIN backend NCCL says it uses: `'gin-proxy'`,
    `'gin-gdaki'`, ... (each backend is compiled alone, see `specs.GIN_BACKENDS`).

    Raises:
        ValueError: when NCCL has no usable GIN there, or a GIN type the kernels are not built for.
    """
    if not properties.usable:
        raise ValueError(f"NCCL GIN is not usable: {properties.reason()}")
    backends = tuple(b.lower() for b in specs.GIN_BACKENDS)
    if properties.gin_type not in backends:
        raise ValueError(
            f"NCCL reports GIN type {properties.gin_type!r}; the kernels are built for {backends} only "
            "(specs.GIN_BACKENDS)"
        )
    return f"gin-{properties.gin_type}"


@runtime_checkable
class GinWindows(Protocol):
    """What `GinLinks` reads of a buffer's GIN windows (`gin_windows.GinPeerWindows`).

    Attributes:
        properties: what NCCL said of GIN on the windows' communicator.
        dev_comm: the device communicator (`raw`: the `ncclDevComm` bytes).
        window: the registered window (`handle`: the `ncclWindow_t`).
        num_qps: the GIN contexts allocated (`ginContextCount`: one per QP).
    """

    properties: GinProperties
    dev_comm: object
    window: object
    num_qps: int


class GinLinks:
    """`links.KernelLinks` over NCCL GIN: the kernels reach the ranks of other nodes through
    `ncclGin` on the device communicator of the buffer's windows (`gin_windows.GinPeerWindows`), and
    their own node's by stores. The kind (`'gin-' + NCCL's GIN type`) is known once the windows are
    attached, when NCCL has said which backend it uses. No NIC CTA: the NIC is real.
    """

    nic_ctas = 0

    def __init__(self) -> None:
        self._kind: str | None = None
        self._dev_comm = b""
        self._window = 0
        self._num_contexts = 0
        self._args: dict[int, bytes] = {}

    @property
    def kind(self) -> str:
        """`'gin-proxy'`, `'gin-gdaki'`, ...: the GIN backend the kernels are compiled for."""
        if self._kind is None:
            raise RuntimeError("GinLinks: the kind is known once the windows are attached (NCCL names the backend)")
        return self._kind

    @property
    def num_contexts(self) -> int:
        """The GIN contexts the device communicator holds (the buffer's QPs)."""
        return self._num_contexts

    def attach(self, windows: PeerWindows) -> None:
        """The buffer's GIN windows are open: take the device communicator, the window handle and
        the context count, and the GIN backend NCCL uses.

        Raises:
            TypeError: for windows that are not GIN windows.
            ValueError: for a GIN type the kernels are not built for (`gin_transport_kind`).
        """
        if not isinstance(windows, GinWindows):
            raise TypeError(f"GinLinks.attach: needs GIN windows (gin_windows.GinPeerWindows), got {type(windows)}")
        kind = gin_transport_kind(windows.properties)
        if windows.num_qps < 1:
            raise ValueError(f"GinLinks.attach: the windows hold {windows.num_qps} GIN contexts, at least 1 is needed")
        self._dev_comm = bytes(windows.dev_comm.raw)
        self._window = int(windows.window.handle)
        self._num_contexts = int(windows.num_qps)
        self._args = {}
        self._kind = kind

    def args(self, kernel_class: str, num_qps: int = 0) -> bytes:
        """`Gin::Args` of a kernel of `kernel_class` using `num_qps` QPs: context 0 and `num_qps`
        contexts that its warps take in turn, or all the allocated ones for `num_qps` outside
        `[1, allocated]` (0: the default). Packed once per QP count."""
        if self._kind is None:
            raise RuntimeError("GinLinks.args: attach the windows first")
        num_contexts = num_qps if 0 < num_qps <= self._num_contexts else self._num_contexts
        packed = self._args.get(num_contexts)
        if packed is None:
            packed = self._args[num_contexts] = pack_gin_args(self._dev_comm, self._window, 0, num_contexts)
        return packed
