"""Engram on CUDA virtual ranks of one GPU (issue 24). Kernels buffers keep the table sharded in the
windows and fetch by loads from the owners' windows (deep_ep.backends.kernels.engram), and on virtual
nodes by the emulated NIC's get from the owners of other nodes (eager, and strict: late and shuffled):
FP8 with scales and BF16, rows of whole 16-byte vectors and not, int32 and int64 indices, an empty
fetch, and tables written over each other; every fetch bit for bit against the gathered table."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from oracle import assert_bitwise, gather_to_all

import deep_ep
from deep_ep.backends.kernels import specs
from deep_ep.backends.kernels.engram import NvlinkEngram
from deep_ep.backends.kernels.links import NicOptions
from deep_ep.host_reads import wait_for_stream
from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _random_storage(gen: torch.Generator, num_entries: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (num_entries, hidden * dtype.itemsize), dtype=torch.uint8, generator=gen, device="cuda")
    return raw.view(dtype)


def _fetch_rank(rank: int, group: dist.ProcessGroup, seed: int) -> list[str]:
    n = group.size()
    buffer = deep_ep.ElasticBuffer(group, 8 << 20, backend="kernels", explicitly_destroy=True, allow_hybrid_mode=False)
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    shared = torch.Generator(device="cuda").manual_seed(seed)
    checked = []
    # (entries per rank, hidden, dtype, index dtype, tokens, entries per token): FP8 with scales and
    # whole vectors, BF16 rows of 16-byte vectors and of 6-byte rows, then an empty fetch of a
    # smaller table written over the others
    cases = [(32, 512, torch.float8_e4m3fn, torch.int32, 64, 4), (48, 1024, torch.bfloat16, torch.int64, 33, 3),
             (40, 3, torch.bfloat16, torch.int32, 17, 2), (16, 256, torch.bfloat16, torch.int64, 0, 2)]  # fmt: skip
    for num_entries, hidden, dtype, index_dtype, num_tokens, num_per_token in cases:
        storage = _random_storage(gen, num_entries, hidden, dtype)
        is_fp8 = dtype == torch.float8_e4m3fn
        sf = torch.rand((n * num_entries, 4), generator=shared, device="cuda") if is_fp8 else None
        buffer.engram_write(storage, sf)
        assert isinstance(buffer._engram.engine, NvlinkEngram)
        table = torch.cat(gather_to_all(storage, group))
        indices = torch.randint(0, n * num_entries, (num_tokens, num_per_token), generator=gen, device="cuda",
                                dtype=index_dtype)  # fmt: skip
        data, fetched_sf = buffer.engram_fetch(indices, use_tma_aligned_col_major_sf=is_fp8)()
        storage.view(torch.uint8).fill_(0)  # the table lives in the windows, not in `storage`
        assert wait_for_stream(timeout_s=60)
        flat = indices.reshape(-1).long().cpu()
        what = f"{dtype} hidden {hidden}, {index_dtype} indices, {num_tokens} x {num_per_token}"
        assert_bitwise(data.cpu(), table[flat], f"fetched entries ({what})")
        if is_fp8:
            assert_bitwise(fetched_sf.cpu(), sf.cpu()[flat].reshape(num_tokens, -1), f"fetched scales ({what})")
        checked.append(what)
    links = buffer.backend.runtime.links
    if hasattr(links, "traffic"):  # virtual nodes: the rows of other nodes came through the emulated NIC
        checked.append(f"NIC bytes {links.traffic()['bytes']}")
    buffer.barrier()
    buffer.destroy()
    return checked


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_entries_are_fetched_by_global_index_from_the_owners_windows(num_ranks: int) -> None:
    outcomes = LoopbackWorld(num_ranks).run(_fetch_rank, time.time_ns() % 1_000_000)
    assert all(len(checked) == 4 for checked in outcomes), outcomes


@pytest.mark.parametrize("num_nodes, per_node, strict", [(2, 2, True), (2, 4, False), (4, 2, True)])
def test_entries_of_other_nodes_are_fetched_by_the_transport_get(num_nodes: int, per_node: int, strict: bool) -> None:
    seed = time.time_ns() % 1_000_000
    world = LoopbackWorld(num_nodes * per_node, num_ranks_per_node=per_node, nic=NicOptions(strict=strict, seed=seed))
    outcomes = world.run(_fetch_rank, seed)
    assert all(len(checked) == 5 for checked in outcomes), (seed, outcomes)
    # Every rank fetched rows of other nodes (at random: 147 rows of 4 tables, from 1/2 to 3/4 remote)
    assert all(int(checked[-1].split()[-1]) > 0 for checked in outcomes), (seed, outcomes)


def _silent_writer_rank(rank: int, group: dist.ProcessGroup) -> str:
    buffer = deep_ep.ElasticBuffer(group, 4 << 20, backend="kernels", num_gpu_timeout_secs=2, explicitly_destroy=True)
    engine = buffer.backend.engram()
    # Kernels loaded by both ranks first (virtual ranks load together), then rank 1 sits out the write
    buffer.barrier()
    engine.runtime.share.load([specs.engram_fetch_spec(index) for index in specs.ENGRAM_INDEX_TYPES])
    outcome = "no error"
    if rank == 0:  # the engine alone (no agreement first): rank 1 never reaches the write's barrier
        try:
            engine.write(torch.ones((8, 64), dtype=torch.bfloat16, device="cuda"), torch.cuda.current_stream(), "w")
        except deep_ep.EPTimeoutError as error:
            outcome = str(error)
    dist.barrier(group=group)
    buffer.destroy()
    return outcome


def test_a_peer_that_never_writes_its_shard_makes_the_write_time_out() -> None:
    outcomes = LoopbackWorld(2).run(_silent_writer_rank)
    assert "barrier timed out on rank 0 waiting for rank 1" in outcomes[0], outcomes
