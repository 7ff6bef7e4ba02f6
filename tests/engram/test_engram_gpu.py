"""Engram on CUDA virtual ranks of one GPU (issue 24): the CPU test's fetches on kernels buffers (whose
Engram replicates the table over torch collectives until the LSA/GIN fetch is built)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from oracle import assert_bitwise, gather_to_all

import deep_ep
from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _fetch_rank(rank: int, group: dist.ProcessGroup, seed: int) -> bool:
    buffer = deep_ep.ElasticBuffer(group, 2 << 20, backend="kernels", explicitly_destroy=True)
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    storage = torch.randint(0, 256, (32, 512), dtype=torch.uint8, generator=gen, device="cuda").view(
        torch.float8_e4m3fn
    )
    sf = torch.rand((group.size() * 32, 4), generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda")
    buffer.engram_write(storage, sf)
    indices = torch.randint(0, group.size() * 32, (64, 4), generator=gen, device="cuda", dtype=torch.int32)
    data, fetched_sf = buffer.engram_fetch(indices, use_tma_aligned_col_major_sf=True)()
    table = torch.cat(gather_to_all(storage, group))
    assert_bitwise(data, table[indices.reshape(-1).long().cpu()], "fetched entries")
    assert_bitwise(fetched_sf, sf.cpu()[indices.reshape(-1).long().cpu()].reshape(64, 16), "fetched scales")
    buffer.destroy()
    return True


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_entries_are_fetched_by_global_index_on_virtual_ranks(num_ranks: int) -> None:
    assert LoopbackWorld(num_ranks).run(_fetch_rank, time.time_ns() % 1_000_000) == [True] * num_ranks
