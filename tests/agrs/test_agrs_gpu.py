"""AGRS on CUDA virtual ranks of one GPU (issue 24): the same checks as on CPU with kernels buffers, whose
calls move the data with the copy engines into the peers' windows (deep_ep.backends.kernels.agrs); the
gathered tensors are views of the window; a peer that never copies makes the device wait expire; with
no host agreement per call, ranks that call with other shapes fail on the device, and a rank that
rejects its arguments stops its peers at once."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from agrs_checks import agrs_rank, random_schedule_rank

import deep_ep
from deep_ep.backends.kernels.agrs import NvlinkAgrs
from deep_ep.loopback import LoopbackRankError, LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_all_gather_and_reduce_scatter_on_virtual_ranks(num_ranks: int) -> None:
    seed = time.time_ns() % 1_000_000
    outcomes = LoopbackWorld(num_ranks).run(agrs_rank, seed, "kernels")
    assert num_ranks < 3 or sum(o["order_differs"] for o in outcomes) > 0, (seed, outcomes)
    assert all(o["window_views"] for o in outcomes), outcomes


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_random_session_schedules_with_calls_ahead_are_bitwise(num_ranks: int) -> None:
    seed = time.time_ns() % 1_000_000
    calls = LoopbackWorld(num_ranks).run(random_schedule_rank, seed, "kernels")
    assert calls[0] >= 2 and len(set(calls)) == 1, (seed, calls)


def _silent_peer_rank(rank: int, group: dist.ProcessGroup) -> str:
    buffer = deep_ep.ElasticBuffer(group, 4 << 20, backend="kernels", num_gpu_timeout_secs=2, explicitly_destroy=True)
    engine = buffer.backend.agrs()
    assert isinstance(engine, NvlinkAgrs)
    stream = torch.cuda.current_stream()
    outcome = "no error"
    engine.begin_session(stream)
    if rank == 0:  # the engine alone (no agreement first): rank 1 never copies nor sets its flag
        engine.all_gather(torch.ones(1024, device="cuda"), 0, stream, signature=1)
        try:
            buffer.backend.runtime.wait(stream, "the all-gather")
        except deep_ep.EPTimeoutError as error:
            outcome = str(error)
    dist.barrier(group=group)
    buffer.destroy()
    return outcome


def test_a_peer_that_never_copies_makes_the_device_wait_expire() -> None:
    try:
        outcomes = LoopbackWorld(2).run(_silent_peer_rank)
    except LoopbackRankError as error:  # pragma: no cover - the message says which rank failed how
        raise AssertionError(str(error)) from error
    assert "AGRS arrivals" in outcomes[0] and "waiting for rank 1" in outcomes[0], outcomes


def _dispatch_in_session_rank(rank: int, group: dist.ProcessGroup) -> str:
    buffer = deep_ep.ElasticBuffer(group, 4 << 20, backend="kernels", explicitly_destroy=True)
    buffer.create_agrs_session()
    buffer.all_gather(torch.full((64,), float(rank), device="cuda"))[1]()
    try:
        buffer.dispatch(torch.zeros((1, 256), dtype=torch.bfloat16, device="cuda"),
                        topk_idx=torch.zeros((1, 1), dtype=torch.int64, device="cuda"), num_experts=2)  # fmt: skip
    except ValueError as error:
        outcome = str(error)
    else:
        outcome = "dispatched"
    # The rejection stopped the buffer on every rank (as any rejected dispatch input does on the kernels backend)
    buffer.destroy()
    return outcome


def test_a_dispatch_inside_a_session_with_data_in_the_window_is_refused() -> None:
    outcomes = LoopbackWorld(2).run(_dispatch_in_session_rank)
    assert all("holds the open AGRS session's data" in o for o in outcomes), outcomes


def _disagreeing_rank(rank: int, group: dist.ProcessGroup, how: str) -> str:
    buffer = deep_ep.ElasticBuffer(group, 4 << 20, backend="kernels", num_gpu_timeout_secs=20, explicitly_destroy=True)
    outcome = "no error"
    started = time.monotonic()
    try:
        with buffer.agrs_new_session():
            buffer.all_gather(torch.ones(64, device="cuda"))[1]()  # one call that agrees
            if how == "shape":  # rank 1 gathers more elements: another signature
                x = torch.ones(64 * (1 + rank), device="cuda")
            else:  # rank 1 passes a strided tensor: it rejects its arguments
                x = torch.ones((64, 2), device="cuda")[:, 0] if rank == 1 else torch.ones(64, device="cuda")
            buffer.all_gather(x)[1]()
    except deep_ep.EPError as error:
        outcome = f"{type(error).__name__}: {error}"
    except ValueError as error:
        outcome = f"ValueError: {error}"
    outcome += f" | after {time.monotonic() - started:.1f} s"
    dist.barrier(group=group)
    buffer.destroy()
    return outcome


def test_ranks_that_call_with_other_shapes_fail_on_the_device_and_a_rejection_stops_every_rank() -> None:
    shape = LoopbackWorld(2).run(_disagreeing_rank, "shape")
    assert all(o.startswith("EPOperationMismatchError") and "ran a different operation" in o for o in shape), shape
    rejected = LoopbackWorld(2).run(_disagreeing_rank, "strided")
    assert rejected[1].startswith("ValueError: all_gather: `t` must be contiguous"), rejected
    assert rejected[0].startswith("EPPeerError") and "must be contiguous" in rejected[0], rejected
    # Both within far less than the 20 s device deadline: nobody waited for it
    assert all(float(o.rsplit("after ", 1)[1].split()[0]) < 10 for o in shape + rejected), (shape, rejected)
