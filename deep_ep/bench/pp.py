"""`deep-ep bench --op pp`: pipeline send/recv against the group's point-to-point calls in the same run.

Every rank sends a tensor to the next rank of the ring and receives one from the previous one, per
iteration; each path is checked bit for bit first, then timed per exchange from entry to the data in
place (the calls and a stream synchronisation), median over the iterations, on every rank; a row
reports the slowest rank's median. Ours goes through the ring in the windows (copy engines, one-warp
flag kernels) where the kernels backend serves, else over the group's calls as well. On one GPU the
ranks are virtual (`deep_ep.loopback`): their windows share the GPU's memory, so the copies show
the copy engines' and the host's cost, not NVLink's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..records import BUFFER_ALIGNMENT_BYTES
from ..utils.math import align
from .side_ops import run_side_op, wall_us

DEFAULT_SIZES = (64 << 10, 1 << 20, 16 << 20)
NUM_SLOTS = 2


def pp_bench_rank(rank: int, group: dist.ProcessGroup, sizes: tuple[int, ...], num_iters: int,
                  seed: int) -> list[dict]:  # fmt: skip
    """One rank's rows: per size, ours and the group's point-to-point calls, checked then timed."""
    import deep_ep

    num_ranks = group.size()
    ring = max(sizes) * NUM_SLOTS * (num_ranks - 1) + (1 << 20)
    num_bytes = max(deep_ep.ElasticBuffer.get_pp_buffer_size_hint(max(sizes), NUM_SLOTS),
                    align(ring + (1 << 20), BUFFER_ALIGNMENT_BYTES))  # fmt: skip
    buffer = deep_ep.ElasticBuffer(group, num_bytes, explicitly_destroy=True)
    buffer.pp_set_config(max(sizes), NUM_SLOTS)
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    rows = [_size_row(buffer, group, rank, size, gen, num_iters) for size in sizes]
    buffer.destroy()
    return rows


def _size_row(buffer: Any, group: dist.ProcessGroup, rank: int, size: int, gen: torch.Generator,
              num_iters: int) -> dict:  # fmt: skip
    device, num_ranks = buffer.device, buffer.num_ranks
    nxt, prev = (rank + 1) % num_ranks, (rank - 1) % num_ranks
    mine = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(device)
    got_ours, got_torch = torch.empty_like(mine), torch.empty_like(mine)

    def ours() -> None:
        buffer.pp_send(mine, nxt)
        buffer.pp_recv(got_ours, prev)

    def theirs() -> None:
        works = [group.send([mine], nxt, 0), group.recv([got_torch], prev, 0)]
        for work in works:
            work.wait()

    ours()
    theirs()
    if device.type == "cuda":
        from ..host_reads import wait_for_stream

        wait_for_stream(timeout_s=60)  # poll: a peer's flag kernel may still wait on our stream's order
    if not torch.equal(got_ours, got_torch):
        raise AssertionError(f"pp bench, rank {rank}: {size} bytes through PP differ from point-to-point's")
    engine = buffer._pp.engine
    return dict(op="send+recv (ring)", bytes_per_rank=size, ours_us=wall_us(ours, device, num_iters),
                torch_us=wall_us(theirs, device, num_iters), ours_ctas=None if engine is None else 0,
                path="copy engines + window ring" if engine is not None else "point-to-point calls")  # fmt: skip


def format_table(rows: list[dict], hardware: str) -> str:
    lines = [f"PP on {hardware} (per exchange, slowest rank's median; CTAs: SMs moving data)",
             f"{'op':<17} {'bytes':>10} {'ours us':>10} {'p2p us':>10} {'ours/p2p':>9}  path"]  # fmt: skip
    for row in rows:
        lines.append(f"{row['op']:<17} {row['bytes_per_rank']:>10} {row['ours_us']:>10.1f} {row['torch_us']:>10.1f} "
                     f"{row['ours_over_torch']:>9.2f}  {row['path']}")  # fmt: skip
    return "\n".join(lines)


def run_pp(num_ranks: int, device: str, sizes: tuple[int, ...] = DEFAULT_SIZES, num_iters: int = 20, seed: int = 0,
           json_path: str | None = None, command: str | None = None) -> list[dict]:  # fmt: skip
    """Run the PP bench on `num_ranks` virtual ranks of `device` (see `side_ops.run_side_op`)."""
    return run_side_op("pp", pp_bench_rank, format_table, "the group's send/recv (bitwise)", num_ranks, device,
                       sizes, num_iters, seed, json_path, command)  # fmt: skip
