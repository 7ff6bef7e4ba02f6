"""deep_ep.utils.spawn: results per rank, a failing rank's traceback in the parent, no hangs."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep.utils.spawn import CHILD_ENV, RankError, spawn_ranks


def report(rank: int, num_ranks: int, offset: int) -> dict:
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "sum": int(value),
        "env": {k: os.environ.get(k) for k in CHILD_ENV},
    }


def fail_on_rank_1(rank: int, num_ranks: int) -> None:
    if rank == 1:
        raise KeyError("the marker 8c1f")
    dist.barrier()  # rank 0 waits for a peer that is gone


def sleep_forever(rank: int, num_ranks: int) -> None:
    time.sleep(3600)


def test_results_by_rank() -> None:
    results = spawn_ranks(report, 3, args=(10,), timeout_s=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 33 for r in results)
    assert all(r["env"] == CHILD_ENV for r in results)


def test_failure_carries_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn_ranks(fail_on_rank_1, 2, timeout_s=120)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message and "KeyError" in message and "the marker 8c1f" in message
    assert "fail_on_rank_1" in message
    assert time.monotonic() - start < 60
    assert not multiprocessing.active_children()


def test_timeout_kills_everything() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"sleep_forever did not finish within 8 s on ranks \[0, 1\]"):
        spawn_ranks(sleep_forever, 2, timeout_s=8)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="backend"):
        spawn_ranks(report, 2, backend="mpi")
    with pytest.raises(ValueError, match="num_ranks"):
        spawn_ranks(report, 0)
