"""`deep-ep bench --op agrs`: AGRS sessions' all-gather and reduce-scatter against the group's torch
collectives in the same run (`all_gather`, and `all_to_all_single` then a sum in FP32 in rank order:
what `deep_ep.agrs` does on torch collectives, and what virtual ranks' groups provide).

Every size is checked first: the all-gather bit for bit against the torch collective's, the
reduce-scatter against a fixed-order FP32 sum of every rank's rows (`deep_ep.agrs`'s contract). Then
each path is timed per call from entry to its data in place (the wall time of the call and the wait
for the device), median over the iterations, on every rank; a row reports the slowest rank's median.
An AGRS call is timed with its session's barriers, one session per call, and as one of
`CALLS_PER_SESSION` all-gathers of a session (the session's time over its calls). On one
GPU the ranks are virtual (`deep_ep.loopback`): their windows share the GPU's memory, so the copies
show the copy engines' and the host's cost, not NVLink's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..backends.kernels.agrs import reduce_ctas
from .side_ops import run_side_op, wall_us

# Bytes of one rank's tensor (all-gather input, reduce-scatter output)
DEFAULT_SIZES = (64 << 10, 1 << 20, 16 << 20)
DTYPE = torch.bfloat16
CALLS_PER_SESSION = 8


def agrs_bench_rank(rank: int, group: dist.ProcessGroup, sizes: tuple[int, ...], num_iters: int,
                    seed: int) -> list[dict]:  # fmt: skip
    """One rank's rows: per size, both operations, ours and torch's, checked then timed."""
    import deep_ep

    num_bytes = deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(group, CALLS_PER_SESSION * group.size() * max(sizes))
    buffer = deep_ep.ElasticBuffer(group, num_bytes, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    rows = [row for size in sizes for row in _size_rows(buffer, group, rank, size, gen, num_iters)]
    buffer.destroy()
    return rows


def _size_rows(buffer: Any, group: dist.ProcessGroup, rank: int, size: int, gen: torch.Generator,
               num_iters: int) -> list[dict]:  # fmt: skip
    """Both operations for tensors of `size` bytes per rank: ours and torch's, checked, then timed."""
    device, num_ranks = buffer.device, buffer.num_ranks
    engine = buffer.backend.agrs()
    num_elements = size // DTYPE.itemsize
    mine = torch.randn(num_elements, generator=gen).to(DTYPE).to(device)
    contributions = torch.randn((num_ranks, num_elements), generator=gen).to(DTYPE).to(device)
    gathered_torch = torch.empty((num_ranks, num_elements), dtype=DTYPE, device=device)
    received = torch.empty_like(contributions)

    def gather_ours() -> torch.Tensor:
        with buffer.agrs_new_session():
            gathered, wait = buffer.all_gather(mine)
            wait()
            return gathered.clone()

    def reduce_ours() -> torch.Tensor:
        with buffer.agrs_new_session():
            reduced, wait = buffer.reduce_scatter(contributions)
            wait()
            return reduced

    def gather_ours_in_session() -> torch.Tensor:
        with buffer.agrs_new_session():
            calls = [buffer.all_gather(mine) for _ in range(CALLS_PER_SESSION)]
            calls[-1][1]()
            return calls[-1][0]

    def gather_torch() -> None:
        dist.all_gather(list(gathered_torch.unbind(0)), mine, group=group)

    def reduce_torch() -> torch.Tensor:
        dist.all_to_all_single(received, contributions, group=group)
        acc = torch.zeros(num_elements, dtype=torch.float32, device=device)
        for source in range(num_ranks):
            acc = acc + received[source].float()
        return acc.to(DTYPE)

    # Checked before timed: the gather bit for bit against torch's, the reduction against the FP32 sum
    # in rank order of the rows every rank sent us
    gather_torch()
    if not torch.equal(gather_ours().view(torch.int16), gathered_torch.view(torch.int16)):
        raise AssertionError(f"agrs bench, rank {rank}: all_gather of {size} bytes differs from torch's")
    if not torch.equal(reduce_ours().view(torch.int16), reduce_torch().view(torch.int16)):
        raise AssertionError(f"agrs bench, rank {rank}: reduce_scatter of {size} bytes differs from the FP32 sum")
    rows = []
    for op, ours, theirs in (("all_gather", gather_ours, gather_torch), ("reduce_scatter", reduce_ours, reduce_torch)):
        ours()  # warm-up (kernels loaded, allocations made)
        theirs()
        ctas = None if engine is None else 1 if op == "all_gather" else reduce_ctas(num_elements)
        rows.append(dict(op=op, bytes_per_rank=size, ours_us=wall_us(ours, device, num_iters),
                         torch_us=wall_us(theirs, device, num_iters), ours_ctas=ctas,
                         path="copy engines + window" if engine is not None else "torch collectives"))  # fmt: skip
    if not torch.equal(gather_ours_in_session().view(torch.int16), gathered_torch.view(torch.int16)):
        raise AssertionError(f"agrs bench, rank {rank}: all_gather of {size} bytes in a session differs from torch's")
    rows.append(dict(op=f"all_gather x{CALLS_PER_SESSION}", bytes_per_rank=size,
                     ours_us=wall_us(gather_ours_in_session, device, num_iters) / CALLS_PER_SESSION,
                     torch_us=rows[0]["torch_us"], ours_ctas=None if engine is None else 1,
                     path=rows[0]["path"] + f", {CALLS_PER_SESSION} calls per session"))  # fmt: skip
    return rows


def format_table(rows: list[dict], hardware: str) -> str:
    lines = [f"AGRS on {hardware} (BF16; per call, slowest rank's median)",
             f"{'op':<15} {'bytes/rank':>11} {'ours us':>10} {'torch us':>10} {'ours/torch':>10}  path (CTAs)"]  # fmt: skip
    for row in rows:
        ctas = "" if row["ours_ctas"] is None else f" ({row['ours_ctas']} CTA{'s' if row['ours_ctas'] > 1 else ''})"
        lines.append(f"{row['op']:<15} {row['bytes_per_rank']:>11} {row['ours_us']:>10.1f} {row['torch_us']:>10.1f} "
                     f"{row['ours_over_torch']:>10.2f}  {row['path']}{ctas}")  # fmt: skip
    return "\n".join(lines)


def run_agrs(num_ranks: int, device: str, sizes: tuple[int, ...] = DEFAULT_SIZES, num_iters: int = 20,
             seed: int = 0, json_path: str | None = None, command: str | None = None) -> list[dict]:  # fmt: skip
    """Run the AGRS bench on `num_ranks` virtual ranks of `device` (see `side_ops.run_side_op`)."""
    return run_side_op("agrs", agrs_bench_rank, format_table,
                       "torch all_gather_into_tensor (bitwise); fixed-order FP32 sum (bitwise)", num_ranks, device,
                       sizes, num_iters, seed, json_path, command)  # fmt: skip
