"""Transport self-test (`transport_ping.cuh`): every rank puts a block of its window into each peer's
window and signals that peer; each rank waits for every peer's signal and checks the bytes. Runs over
LSA, the transport of the kernels' windows today (NVLink, or the virtual ranks of one GPU), or through
the emulated NIC of virtual nodes (eager, or strict: puts late and shuffled, signals per context), which
also breaks the protocol on request to show that the strict NIC catches it. The GIN instantiation is
compiled against NCCL 2.30.4 and newer but cannot run on a machine without an RDMA NIC.
"""

from __future__ import annotations

import torch

from deep_ep.host_reads import host_list
from deep_ep.jit import Opaque
from deep_ep.records import WORKSPACE_BYTES

from . import specs
from .links import EmulatedLinks, LsaLinks, NicOptions
from .runtime import NvlinkRuntime, data_ptr


def ping_pattern(rank: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """`[num_bytes]` `torch.uint8`: the block rank `rank` sends, different for every rank."""
    return ((torch.arange(num_bytes, device=device) * 131 + rank * 7 + 1) % 251).to(torch.uint8)


# The protocol mistakes the emulated NIC makes on request (transport/emulated.cuh)
PING_MISTAKES = specs.NIC_MISTAKES


def transport_ping(runtime: NvlinkRuntime, num_bytes: int = 64 << 10, timeout_s: float = 5.0, transport: str = "lsa",
                   mistake: str | None = None, delay_us: float = 20.0, seed: int = 0) -> list[int]:  # fmt: skip
    """Ping every peer of `runtime`'s buffer once over its windows (collective, between operations).

    Arguments:
        runtime: the buffer's runtime; the ping overwrites its record region (not its workspace).
        num_bytes: the block each rank sends each peer (a positive multiple of 16).
        timeout_s: the device-side deadline of the wait for each peer's signal (and of the NIC).
        transport: `'lsa'`, or the emulated NIC: `'emulated-eager'` or `'emulated-strict'`.
        mistake: break the protocol on purpose (emulated NIC only): `'no_flush'` (the source is
            reused without a flush), `'signal_first'` (the signal before its put), `'split_contexts'`
            (the put and its signal on different contexts); `None` follows it.
        delay_us: strict NIC: how long a put waits at least before it runs.
        seed: strict NIC: the seed of the order in which it runs ready puts.

    Returns:
        Per rank `p`: `1` when what `p` sent, read right after its signal, is its block bit for bit;
        `0` when its signal came but the bytes differ; `-1` when no signal came by the deadline (or the
        flush of our put to `p` failed); `1` for this rank itself.

    Raises:
        RuntimeError: the strict NIC passed its deadline or ran out of queue slots.
    """
    if num_bytes < 16 or num_bytes % 16 != 0:
        raise ValueError(f"transport_ping: `num_bytes` must be a positive multiple of 16, got {num_bytes}")
    if transport not in ("lsa", *specs.EMULATED_TRANSPORTS):
        raise ValueError(f"transport_ping: `transport` must be 'lsa' or one of {specs.EMULATED_TRANSPORTS}, "
                         f"got {transport!r}")  # fmt: skip
    if mistake not in PING_MISTAKES or (mistake is not None and transport == "lsa"):
        raise ValueError(f"transport_ping: `mistake` must be one of {list(PING_MISTAKES)} (not None only with "
                         f"the emulated NIC), got {mistake!r} with {transport!r}")  # fmt: skip
    if transport == "lsa" and runtime.scaleout is not None:
        raise ValueError("transport_ping: `transport`='lsa' reaches one scale-up domain, and this buffer has remote "
                         "peers; ping them through the emulated NIC")  # fmt: skip
    num_ranks, rank = runtime.num_ranks, runtime.rank
    src_offset = WORKSPACE_BYTES
    dst_offset = src_offset + num_bytes
    signal_offset = dst_offset + num_ranks * num_bytes
    snapshot_offset = signal_offset + -(-8 * num_ranks // 16) * 16
    if snapshot_offset + num_ranks * num_bytes > runtime.data_bytes:
        raise ValueError(f"transport_ping: {num_bytes} bytes per peer do not fit the window of "
                         f"{runtime.data_bytes} bytes")  # fmt: skip
    stream = torch.cuda.current_stream()
    window = runtime.windows.bytes
    window[src_offset:dst_offset].copy_(ping_pattern(rank, num_bytes, window.device))
    window[dst_offset : snapshot_offset + num_ranks * num_bytes].zero_()
    status = torch.zeros(num_ranks, dtype=torch.int32, device=window.device)
    strict = transport == "emulated-strict"
    links = LsaLinks() if transport == "lsa" else EmulatedLinks(
        NicOptions(strict=strict, delay_us=delay_us, seed=seed, mistake=mistake), num_ranks, window.device,
        int(timeout_s * 1e9))  # fmt: skip
    links.attach(runtime.windows)
    # Every rank's signal words and blocks are zero and its source written before any peer puts or signals
    runtime.barrier(stream)
    (kernel,) = runtime.share.load([specs.transport_ping_spec(transport)])
    ping_args = specs.TransportPingArgs(
        src_offset=src_offset, dst_offset=dst_offset, num_bytes=num_bytes, signal_offset=signal_offset,
        snapshot_offset=snapshot_offset, round=1, timeout_ns=int(timeout_s * 1e9), own_window=runtime.windows.ptr,
        rank=rank, num_ranks=num_ranks, status=data_ptr(status))  # fmt: skip
    kernel.launch(grid=(1 + links.nic_ctas,), block=(256,), stream=stream,
                  args=(Opaque(links.args("comm")), Opaque(bytes(ping_args))))  # fmt: skip
    runtime.wait(stream, "the transport ping")
    if strict and (nic_status := links.nic_status("comm")) != 0:
        what = "passed its deadline" if nic_status == -1 else "ran out of queue slots"
        raise RuntimeError(f"transport_ping: the emulated NIC of rank {rank} {what}")
    results = host_list(status)
    for peer in range(num_ranks):
        if peer == rank:
            results[peer] = 1
        elif results[peer] == 1:
            seen = window[snapshot_offset + peer * num_bytes : snapshot_offset + (peer + 1) * num_bytes]
            results[peer] = int(torch.equal(seen, ping_pattern(peer, num_bytes, window.device)))
    # No rank reuses the region for an operation while a peer may still read its signal words
    runtime.barrier(stream)
    runtime.wait(stream, "the transport ping")
    return results
