"""`deep-ep bench --op engram`: Engram's fetch against a fetch built from NCCL collectives in the same run.

Each rank holds a shard of `NUM_ENTRIES` entries per rank of `hidden` BF16 values and fetches
`num_tokens x TOPK` random entries by global index. The collective fetch is what a framework writes
without one-sided reads: the indices to their owners (`all_to_all_single`, after an exchange of the
counts and a host read of them), a local gather there, and the rows back (`all_to_all_single`). Both
are checked bit for bit against the gathered table first, then timed per fetch from entry to the
data in place, median over the iterations; a row reports the slowest rank's median. On one GPU the
ranks are virtual (`deep_ep.loopback`): the loads from the owners' windows read the GPU's own memory.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..host_reads import host_list
from ..records import BUFFER_ALIGNMENT_BYTES
from ..utils.math import align
from .side_ops import run_side_op, wall_us

NUM_ENTRIES = 4096
HIDDEN = 1024
TOPK = 4
# Tokens per fetch (the "sizes" of this bench)
DEFAULT_TOKENS = (128, 1024, 8192)


def engram_bench_rank(rank: int, group: dist.ProcessGroup, sizes: tuple[int, ...], num_iters: int,
                      seed: int) -> list[dict]:  # fmt: skip
    """One rank's rows: per token count, ours and the collective fetch, checked then timed."""
    import deep_ep

    num_gpu_bytes, _ = deep_ep.ElasticBuffer.get_engram_storage_size_hint(NUM_ENTRIES, HIDDEN, max(sizes))
    table_bytes = NUM_ENTRIES * HIDDEN * 2
    num_bytes = align(num_gpu_bytes + table_bytes + (2 << 20), BUFFER_ALIGNMENT_BYTES)
    buffer = deep_ep.ElasticBuffer(group, num_bytes, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    storage = torch.randn((NUM_ENTRIES, HIDDEN), generator=gen).to(torch.bfloat16).to(buffer.device)
    buffer.engram_write(storage)
    rows = [_size_row(buffer, group, rank, storage, num_tokens, gen, num_iters) for num_tokens in sizes]
    buffer.destroy()
    return rows


def _collective_fetch(group: dist.ProcessGroup, storage: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The entries `flat` (int64) by two all-to-alls: indices to their owners, rows back."""
    num_ranks = group.size()
    owners = flat // storage.shape[0]
    order = torch.argsort(owners, stable=True)
    send_counts = torch.bincount(owners, minlength=num_ranks)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sent, received = host_list(send_counts), host_list(recv_counts)
    wanted = torch.empty(sum(received), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(wanted, flat[order], received, sent, group=group)
    rows = storage.index_select(0, wanted % storage.shape[0])
    back = torch.empty((flat.numel(), storage.shape[1]), dtype=storage.dtype, device=storage.device)
    dist.all_to_all_single(back, rows, sent, received, group=group)
    out = torch.empty_like(back)
    out[order] = back
    return out


def _size_row(buffer: Any, group: dist.ProcessGroup, rank: int, storage: torch.Tensor, num_tokens: int,
              gen: torch.Generator, num_iters: int) -> dict:  # fmt: skip
    device, num_ranks = buffer.device, buffer.num_ranks
    indices = torch.randint(0, num_ranks * NUM_ENTRIES, (num_tokens, TOPK), generator=gen).to(device)
    flat = indices.reshape(-1)

    def ours() -> torch.Tensor:
        return buffer.engram_fetch(indices)()[0]

    def theirs() -> torch.Tensor:
        return _collective_fetch(group, storage, flat)

    if not torch.equal(ours().view(torch.int16), theirs().view(torch.int16)):
        raise AssertionError(f"engram bench, rank {rank}: fetch of {num_tokens} x {TOPK} differs from the collective's")
    engine = buffer._engram.engine
    num_bytes = flat.numel() * HIDDEN * 2
    return dict(op="fetch", num_tokens=num_tokens, bytes_per_rank=num_bytes, ours_us=wall_us(ours, device, num_iters),
                torch_us=wall_us(theirs, device, num_iters),
                path="LSA loads from the owners' windows" if engine is not None else "replicated table")  # fmt: skip


def format_table(rows: list[dict], hardware: str) -> str:
    lines = [f"Engram on {hardware} (BF16 hidden {HIDDEN}, top-{TOPK}; per fetch, slowest rank's median)",
             f"{'tokens':>7} {'bytes':>10} {'ours us':>10} {'a2a us':>10} {'ours/a2a':>9}  path"]  # fmt: skip
    for row in rows:
        lines.append(f"{row['num_tokens']:>7} {row['bytes_per_rank']:>10} {row['ours_us']:>10.1f} "
                     f"{row['torch_us']:>10.1f} {row['ours_over_torch']:>9.2f}  {row['path']}")  # fmt: skip
    return "\n".join(lines)


def run_engram(num_ranks: int, device: str, sizes: tuple[int, ...] = DEFAULT_TOKENS, num_iters: int = 20,
               seed: int = 0, json_path: str | None = None, command: str | None = None) -> list[dict]:  # fmt: skip
    """Run the Engram bench on `num_ranks` virtual ranks of `device` (see `side_ops.run_side_op`)."""
    return run_side_op("engram", engram_bench_rank, format_table,
                       "a fetch by two all_to_all_single (bitwise)", num_ranks, device, sizes, num_iters, seed,
                       json_path, command)  # fmt: skip
