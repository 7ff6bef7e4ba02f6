"""Engram on CPU ranks (issue 24, the reference part): rows of a table sharded over 2-4 virtual ranks,
fetched by global index bit for bit against brute force, BF16 and FP8 with replicated scales (row-major
and TMA-aligned column-major), V2's size hint, and the argument checks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from oracle import assert_bitwise, gather_to_all

import deep_ep
from deep_ep.errors import EPPeerError
from deep_ep.loopback import LoopbackWorld

NUM_ENTRIES, HIDDEN, NUM_PACKS = 10, 64, 2


def _storage(rank: int, fp8: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    raw = torch.randint(0, 256, (NUM_ENTRIES, HIDDEN * (1 if fp8 else 2)), dtype=torch.uint8, generator=gen)
    return raw.view(torch.float8_e4m3fn if fp8 else torch.bfloat16), None


def _fetch_rank(rank: int, group: dist.ProcessGroup, fp8: bool, col_major: bool, seed: int) -> int:
    num_ranks = group.size()
    buffer = deep_ep.ElasticBuffer(group, 2 << 20, backend="reference", explicitly_destroy=True)
    storage, _ = _storage(rank, fp8, seed)
    sf = None
    if fp8:  # replicated: every rank passes the scales of every rank's entries
        sf = torch.rand((num_ranks * NUM_ENTRIES, NUM_PACKS), generator=torch.Generator().manual_seed(seed))
    buffer.engram_write(storage, sf)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    indices = torch.randint(0, num_ranks * NUM_ENTRIES, (5, 3), generator=gen, dtype=torch.int32)
    data, fetched_sf = buffer.engram_fetch(indices, use_tma_aligned_col_major_sf=col_major)()
    table = torch.cat([s for s in gather_to_all(storage, group)])
    assert_bitwise(data, table[indices.reshape(-1).long()], "fetched entries")
    if fp8:
        expected = sf[indices.reshape(-1).long()].reshape(5, 3 * NUM_PACKS)
        assert_bitwise(fetched_sf, expected, "fetched scales")
        assert fetched_sf.stride() == ((1, 8) if col_major else (3 * NUM_PACKS, 1)), fetched_sf.stride()
    else:
        assert fetched_sf is None
    buffer.destroy()
    return data.shape[0]


@pytest.mark.parametrize("fp8, col_major", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_entries_are_fetched_by_global_index_bit_for_bit(num_ranks: int, fp8: bool, col_major: bool) -> None:
    seed = time.time_ns() % 1_000_000
    assert LoopbackWorld(num_ranks, device="cpu").run(_fetch_rank, fp8, col_major, seed) == [15] * num_ranks


def test_the_storage_size_hint_is_v2s() -> None:
    gpu, cpu = deep_ep.ElasticBuffer.get_engram_storage_size_hint(1 << 20, 7168, 4096)
    assert (gpu, cpu) == (-(-14336 * 4096 // (2 << 20)) * (2 << 20), -(-14336 * (1 << 20) // (2 << 20)) * (2 << 20))
    assert deep_ep.ElasticBuffer.get_engram_storage_size_hint(3, 100, 5, torch.float8_e4m3fn) == (2 << 20, 2 << 20)


def _checks_rank(rank: int, group: dist.ProcessGroup) -> list[str]:
    buffer = deep_ep.ElasticBuffer(group, 2 << 20, backend="reference", explicitly_destroy=True)
    errors = []
    with pytest.raises(ValueError) as info:
        buffer.engram_fetch(torch.zeros((2, 2), dtype=torch.int32))
    errors.append(str(info.value))
    bad = torch.zeros((4, 8), dtype=torch.float16) if rank == 1 else torch.zeros((4, 8), dtype=torch.bfloat16)
    with pytest.raises((TypeError, EPPeerError)) as info:
        buffer.engram_write(bad)
    errors.append(f"{type(info.value).__name__}: {info.value}")
    buffer.engram_write(torch.zeros((4, 8), dtype=torch.bfloat16))
    with pytest.raises(ValueError) as info:
        buffer.engram_fetch(torch.tensor([[0, 2 * 4]], dtype=torch.int64))
    errors.append(str(info.value))
    buffer.destroy()
    return errors


def test_bad_arguments_are_refused_on_every_rank() -> None:
    first, second = LoopbackWorld(2, device="cpu").run(_checks_rank)
    assert "needs a table, got none" in first[0] and "needs a table, got none" in second[0]
    assert first[1].startswith("EPPeerError") and "rank(s) [1] rejected" in first[1], first
    assert second[1].startswith("TypeError") and "torch.bfloat16 or torch.float8_e4m3fn" in second[1], second
    assert "values must be in [0, 8)" in first[2] and "got [0, 8]" in first[2], first
