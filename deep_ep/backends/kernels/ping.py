"""Transport self-test (`transport_ping.cuh`): every rank puts a block of its window into each peer's
window and signals that peer; each rank waits for every peer's signal and checks the bytes. Runs over
LSA, the transport of the kernels' windows today (NVLink, or the virtual ranks of one GPU); the GIN
instantiation is compiled against NCCL 2.30.4 and newer but cannot run on a machine without an RDMA
NIC.
"""

from __future__ import annotations

import torch

from deep_ep.jit import Opaque
from deep_ep.records import WORKSPACE_BYTES

from . import specs
from .layout import PEER_WINDOWS_OFFSET
from .runtime import NvlinkRuntime, data_ptr


def ping_pattern(rank: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """`[num_bytes]` `torch.uint8`: the block rank `rank` sends, different for every rank."""
    return ((torch.arange(num_bytes, device=device) * 131 + rank * 7 + 1) % 251).to(torch.uint8)


def transport_ping(runtime: NvlinkRuntime, num_bytes: int = 64 << 10, timeout_s: float = 5.0) -> list[int]:
    """Ping every peer of `runtime`'s buffer once over its windows (collective, between operations).

    Arguments:
        runtime: the buffer's runtime; the ping overwrites its record region (not its workspace).
        num_bytes: the block each rank sends each peer (a positive multiple of 16).
        timeout_s: the device-side deadline of the wait for each peer's signal.

    Returns:
        Per rank `p`: `1` when `p`'s block arrived bit for bit, `0` when its signal came but the bytes
        differ, `-1` when no signal came by the deadline (`1` for this rank itself).
    """
    if num_bytes < 16 or num_bytes % 16 != 0:
        raise ValueError(f"transport_ping: `num_bytes` must be a positive multiple of 16, got {num_bytes}")
    num_ranks, rank = runtime.num_ranks, runtime.rank
    src_offset = WORKSPACE_BYTES
    dst_offset = src_offset + num_bytes
    signal_offset = dst_offset + num_ranks * num_bytes
    if signal_offset + 8 * num_ranks > runtime.windows.num_bytes:
        raise ValueError(f"transport_ping: {num_bytes} bytes per peer do not fit the window of "
                         f"{runtime.windows.num_bytes} bytes")  # fmt: skip
    stream = torch.cuda.current_stream()
    window = runtime.windows.bytes
    window[src_offset:dst_offset].copy_(ping_pattern(rank, num_bytes, window.device))
    window[signal_offset : signal_offset + 8 * num_ranks].zero_()
    status = torch.zeros(num_ranks, dtype=torch.int32, device=window.device)
    # Every rank's signal words are zero and its source written before any peer puts or signals
    runtime.barrier(stream)
    (kernel,) = runtime.share.load([specs.transport_ping_spec("lsa")])
    transport_args = specs.LsaTransportArgs(peer_windows=runtime.windows.ptr + PEER_WINDOWS_OFFSET, rank=rank)
    ping_args = specs.TransportPingArgs(
        src_offset=src_offset, dst_offset=dst_offset, num_bytes=num_bytes, signal_offset=signal_offset, round=1,
        timeout_ns=int(timeout_s * 1e9), rank=rank, num_ranks=num_ranks, status=data_ptr(status))  # fmt: skip
    kernel.launch(grid=(1,), block=(256,), stream=stream,
                  args=(Opaque(bytes(transport_args)), Opaque(bytes(ping_args))))  # fmt: skip
    runtime.wait(stream, "the transport ping")
    results = status.tolist()
    for peer in range(num_ranks):
        if peer == rank:
            results[peer] = 1
        elif results[peer] == 1:
            block = window[dst_offset + peer * num_bytes : dst_offset + (peer + 1) * num_bytes]
            results[peer] = int(torch.equal(block, ping_pattern(peer, num_bytes, window.device)))
    # No rank reuses the region for an operation while a peer may still read its signal words
    runtime.barrier(stream)
    runtime.wait(stream, "the transport ping")
    return results
