"""Engram on `ElasticBuffer`: DeepEP V2's experimental fetch of rows of a table sharded over the ranks, by
global entry index.

`engram_write(storage, sf=None)` (collective) makes every rank's `[num_entries, hidden]` storage
(BF16, or FP8 e4m3 with `sf`, the per-entry scales of every rank's entries, replicated) the shard of
entries `[rank * num_entries, (rank + 1) * num_entries)`; `engram_fetch(indices)` (local, one-sided)
returns a hook that gives `(data, sf)`: `data[t * E + e]` = entry `indices[t, e]`, bit for bit, and
`sf[t]` the entries' scales side by side.

On the kernels backend the table stays sharded: each rank's shard sits at the end of its window
(`deep_ep.backends.kernels.engram`) and a fetch is one kernel that reads the owners' windows (loads
in our scale-up domain, the transport's get from other nodes), returned once queued on the current
stream; the scales are replicated. On the reference backend `engram_write` replicates the table (one
all-gather over the buffer's group) and a fetch is a local gather: the CPU path and the oracle. V2's
`num_qps` is accepted and unused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deep_ep.agrs import agree_on_call, wait_collective
from deep_ep.backends.base import TMA_ALIGNED_SF_TOKENS
from deep_ep.host_reads import host_list
from deep_ep.records import BUFFER_ALIGNMENT_BYTES
from deep_ep.utils.math import align

ENTRY_ALIGNMENT_BYTES = 32  # V2: `LDG.256`
STORAGE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@dataclass
class EngramTable:
    """The table `engram_write` made: replicated here (`table`), or sharded in the windows (`engine`)."""

    num_entries: int  # per rank
    hidden: int
    dtype: torch.dtype
    scales: torch.Tensor | None
    table: torch.Tensor | None = None
    engine: Any = None


class EngramMixin:
    """The Engram methods of `ElasticBuffer` (which provides `group`, `num_ranks`, `rank_idx`,
    `device`, `backend`, `_comm_stream`, `_engram`, `_check_window_free` and `_exclusive_call`, its
    guard of one call)."""

    group: dist.ProcessGroup
    num_ranks: int
    rank_idx: int
    device: torch.device
    backend: Any
    _comm_stream: torch.cuda.Stream | None
    _engram: EngramTable | None
    _check_window_free: Callable[[str], None]
    _exclusive_call: Callable[[str], contextlib.AbstractContextManager[float]]

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:  # fmt: skip
        """Return `(num_gpu_bytes, num_cpu_bytes)` (2 MiB aligned), V2's: the receive area of
        `num_max_tokens_per_rank` entries and the storage of `num_entries`, each entry 32-byte aligned."""
        entry_bytes = align(hidden * dtype.itemsize, ENTRY_ALIGNMENT_BYTES)
        return (align(entry_bytes * num_max_tokens_per_rank, BUFFER_ALIGNMENT_BYTES),
                align(entry_bytes * num_entries, BUFFER_ALIGNMENT_BYTES))  # fmt: skip

    def engram_write(self, storage: torch.Tensor, sf: torch.Tensor | None = None) -> None:
        """Make `storage` this rank's shard of the table (collective).

        Arguments:
            storage: `[num_entries, hidden]` `torch.bfloat16` or `torch.float8_e4m3fn`, contiguous, on the
                buffer's device; every rank the same shape and dtype.
            sf: FP8 only: `[num_ranks * num_entries, num_sf_packs]` `torch.float32` or `torch.int32`
                (packed UE8M0), the scales of every rank's entries, the same on every rank.
        """
        op = "engram_write"
        with self._exclusive_call(op) as timeout_s:
            error = None
            try:
                self._check_storage(op, storage, sf)
            except (TypeError, ValueError) as rejected:
                error = rejected
            what = f"{getattr(storage, 'dtype', None)}{tuple(getattr(storage, 'shape', ()))}"
            what += "" if sf is None or error is not None else f" sf {sf.dtype}{tuple(sf.shape)}"
            if error is None:
                self._check_window_free(op)
            agree_on_call(self, op, what, timeout_s, error)
            written = EngramTable(storage.shape[0], storage.shape[1], storage.dtype, None if sf is None else sf.clone())
            engine = self.backend.engram()
            if engine is not None:
                stream = torch.cuda.current_stream(self.device)
                if self._comm_stream is not None:
                    stream.wait_stream(self._comm_stream)  # no shard lands where a dispatch may still read
                self._engram = None  # the old table is gone from here on, whatever happens
                engine.write(storage, stream, op)
                written.engine = engine
            else:
                shards = [torch.empty_like(storage) for _ in range(self.num_ranks)]
                work = dist.all_gather([s.view(torch.uint8) for s in shards], storage.view(torch.uint8),
                                       group=self.group, async_op=True)  # fmt: skip
                wait_collective(work, timeout_s, "engram_write's storage", self)
                written.table = torch.cat(shards)
            self._engram = written

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0,
                     use_tma_aligned_col_major_sf: bool = False) -> Callable[[], tuple[torch.Tensor, Any]]:  # fmt: skip
        """Fetch entries of the table by global index (local: no peer takes part).

        Arguments:
            indices: `[num_tokens, E]` `torch.int32` or `torch.int64`, global entry indices in
                `[0, num_ranks * num_entries)`.
            num_qps: V2's; unused.
            use_tma_aligned_col_major_sf: FP8: give the scales with strides `(1, align(num_tokens, 4))`.

        Returns:
            A hook; calling it gives `(data, sf)`: `data` `[num_tokens * E, hidden]` in the storage's
            dtype, and for FP8 `sf` `[num_tokens, E * num_sf_packs]` (entry `e`'s packs at columns
            `e * num_sf_packs ...`), else `None`.
        """
        op = "engram_fetch"
        with self._exclusive_call(op):
            if self._engram is None:
                raise ValueError(f"{op}: needs a table, got none (call engram_write first)")
            written = self._engram
            num_table_entries = self.num_ranks * written.num_entries
            if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{op}: `indices` must be a torch.int32 or torch.int64 tensor, got {indices!r:.80}")
            if indices.dim() != 2 or indices.device != self.device:
                raise ValueError(
                    f"{op}: `indices` must be [num_tokens, E] on {self.device}, got {list(indices.shape)} on "
                    f"{indices.device}"
                )
            flat = indices.reshape(-1).long()
            if flat.numel():
                low, high = host_list(torch.stack([flat.min(), flat.max()]))
                if low < 0 or high >= num_table_entries:
                    raise ValueError(
                        f"{op}: `indices` values must be in [0, {num_table_entries}) (num_ranks x num_entries), got "
                        f"[{low}, {high}]"
                    )
            if written.engine is not None:
                data = torch.empty((flat.numel(), written.hidden), dtype=written.dtype, device=self.device)
                # reshape copies only a non-contiguous `indices`: the kernel reads a flat array
                written.engine.fetch(indices.reshape(-1), data, torch.cuda.current_stream(self.device))
            else:
                data = written.table.index_select(0, flat)
            scales = written.scales
            fetched_sf = None
            if scales is not None:
                num_tokens = indices.shape[0]
                packed = scales.index_select(0, flat).reshape(num_tokens, -1)
                if use_tma_aligned_col_major_sf:
                    storage = torch.zeros((packed.shape[1], align(num_tokens, TMA_ALIGNED_SF_TOKENS)),
                                          dtype=packed.dtype, device=self.device)  # fmt: skip
                    fetched_sf = storage[:, :num_tokens].t()
                    fetched_sf.copy_(packed)
                else:
                    fetched_sf = packed
        return lambda: (data, fetched_sf)

    def _check_storage(self, op: str, storage: Any, sf: Any) -> None:
        if not isinstance(storage, torch.Tensor) or storage.dtype not in STORAGE_DTYPES:
            raise TypeError(
                f"{op}: `storage` must be a torch.bfloat16 or torch.float8_e4m3fn tensor, got {storage!r:.80}"
            )
        if storage.dim() != 2 or storage.device != self.device or not storage.is_contiguous():
            raise ValueError(
                f"{op}: `storage` must be [num_entries, hidden], contiguous, on {self.device}, got "
                f"{list(storage.shape)} on {storage.device}"
            )
        is_fp8 = storage.dtype == torch.float8_e4m3fn
        if is_fp8 != (sf is not None):
            raise ValueError(
                f"{op}: `sf` must be given exactly for FP8 storage, got {storage.dtype} with sf={sf is not None}"
            )
        if sf is not None:
            if not isinstance(sf, torch.Tensor) or sf.dtype not in (torch.float32, torch.int32):
                raise TypeError(f"{op}: `sf` must be a torch.float32 or torch.int32 tensor, got {sf!r:.80}")
            total = self.num_ranks * storage.shape[0]
            if sf.dim() != 2 or sf.shape[0] != total or sf.device != self.device:
                raise ValueError(
                    f"{op}: `sf` must be [num_ranks x num_entries = {total}, num_sf_packs] on {self.device}, got "
                    f"{list(sf.shape)} on {sf.device}"
                )
