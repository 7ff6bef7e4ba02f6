"""Engram on the kernels backend (engram_fetch.cuh, docs/semantics.md).

`engram_write` keeps the table's region at the end of every rank's window (`tail.py`) and copies the
rank's shard there, each entry at a 32-byte stride, between two barriers: no peer still reads the
old table while it is overwritten, and every shard is in place before any fetch. A fetch is one
kernel that reads each requested entry from its owner's window, a warp per entry: with loads from
the owners of our scale-up domain (LSA), and with the transport's get from remote owners, into a
staging entry per warp kept after the table (GIN's RDMA read; the emulated NIC on virtual nodes).
No peer takes part, so a fetch needs no collective and no flag.
"""

from __future__ import annotations

import torch

from deep_ep.jit import Opaque
from deep_ep.utils.math import align

from . import specs
from .runtime import NvlinkRuntime, data_ptr

ENTRY_ALIGNMENT_BYTES = 32  # V2's: `LDG.256`
MAX_FETCH_CTAS = 132
FETCH_WARPS_PER_CTA = specs.ENGRAM_THREADS // 32


def engram_region_bytes(num_entries: int, entry_stride: int, has_remote_peers: bool) -> int:
    """The table's region in every rank's window: its entries, then with remote peers one staging
    entry per warp of the largest fetch grid."""
    num_staging = MAX_FETCH_CTAS * FETCH_WARPS_PER_CTA if has_remote_peers else 0
    return (num_entries + num_staging) * entry_stride


class NvlinkEngram:
    """Engram's table and fetches of one buffer (its peers reached by loads, or through its transport)."""

    def __init__(self, runtime: NvlinkRuntime) -> None:
        self.runtime = runtime
        self.table_offset = -1  # -1: no table written
        self.num_entries = 0
        self.row_bytes = 0
        self.entry_stride = 0

    def write(self, storage: torch.Tensor, stream: torch.cuda.Stream, op: str) -> None:
        """Make `storage` (`[num_entries, hidden]`, contiguous) this rank's shard (collective)."""
        runtime = self.runtime
        num_entries = storage.shape[0]
        row_bytes = storage.shape[1] * storage.element_size()
        stride = align(row_bytes, ENTRY_ALIGNMENT_BYTES)
        region_bytes = engram_region_bytes(num_entries, stride, runtime.scaleout is not None)
        offset = runtime.tail.keep("engram", region_bytes, op)
        transport = runtime.transport_kind
        runtime.share.load([specs.engram_fetch_spec(index, transport) for index in specs.ENGRAM_INDEX_TYPES])
        runtime.barrier(stream)
        with torch.cuda.stream(stream):
            table = runtime.windows.bytes[offset : offset + num_entries * stride].view(num_entries, stride)
            table[:, :row_bytes].copy_(storage.view(torch.uint8).view(num_entries, row_bytes))
        runtime.barrier(stream)
        runtime.wait(stream, f"{op}'s barrier")
        self.table_offset, self.num_entries, self.row_bytes, self.entry_stride = offset, num_entries, row_bytes, stride

    def fetch(self, flat_indices: torch.Tensor, out: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Queue the fetch of the entries `flat_indices` (`[num_rows]` int32 or int64, checked in range)
        into `out` (`[num_rows, hidden]`, contiguous) on `stream`."""
        runtime = self.runtime
        runtime.check_error()
        num_rows = flat_indices.numel()
        if num_rows == 0:
            return
        index = "int32" if flat_indices.dtype == torch.int32 else "int64"
        (kernel,) = runtime.share.load([specs.engram_fetch_spec(index, runtime.transport_kind)])
        args = specs.EngramFetchArgs(window_base=runtime.windows.ptr, error_block=data_ptr(runtime.error_block),
                                     timeout_ns=runtime.timeout_ns, indices=data_ptr(flat_indices), out=data_ptr(out),
                                     table_offset=self.table_offset,
                                     staging_offset=self.table_offset + self.num_entries * self.entry_stride,
                                     num_rows=num_rows, num_entries=self.num_entries, row_bytes=self.row_bytes,
                                     entry_stride=self.entry_stride, rank=runtime.rank)  # fmt: skip
        num_ctas = min(MAX_FETCH_CTAS, runtime.num_device_sms - runtime.nic_ctas, -(-num_rows // FETCH_WARPS_PER_CTA))
        kernel.launch(grid=(num_ctas + runtime.nic_ctas,), block=(specs.ENGRAM_THREADS,), stream=stream,
                      args=(Opaque(bytes(args)), Opaque(runtime.links.args("comm"))))  # fmt: skip
