"""AGRS on CPU ranks (issue 24, the reference part): all-gather and reduce-scatter bit for bit against
brute force on 2 and 4 virtual ranks, random session schedules, the session rules, disagreeing ranks, and a stalled peer
(`EPTimeoutError`, on 2 gloo processes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from agrs_checks import agrs_rank, random_schedule_rank

import deep_ep
from deep_ep.errors import EPPeerError, EPTimeoutError
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.spawn import spawn_ranks

TWO_MIB = 2 << 20


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_random_session_schedules_are_bitwise(num_ranks: int) -> None:
    seed = time.time_ns() % 1_000_000
    calls = LoopbackWorld(num_ranks, device="cpu").run(random_schedule_rank, seed, "reference")
    assert calls[0] >= 2 and len(set(calls)) == 1, (seed, calls)


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_all_gather_and_reduce_scatter_are_bitwise_brute_force(num_ranks: int) -> None:
    seed = time.time_ns() % 1_000_000
    outcomes = LoopbackWorld(num_ranks, device="cpu").run(agrs_rank, seed, "reference")
    # From 3 ranks the values tell summation orders apart: a backwards sum gives other bits somewhere
    if num_ranks >= 3:
        assert sum(o["order_differs"] for o in outcomes) > 0, (seed, outcomes)
    assert outcomes[0]["sizes"] == (-(-num_ranks * 5 * 24 * 2 // 32) * 32, TWO_MIB)


def _buffer(group: dist.ProcessGroup, **kwargs: object) -> deep_ep.ElasticBuffer:
    return deep_ep.ElasticBuffer(group, TWO_MIB, backend="reference", explicitly_destroy=True, **kwargs)


def _session_rules_rank(rank: int, group: dist.ProcessGroup) -> list[str]:
    buffer = _buffer(group)
    x = torch.arange(8, dtype=torch.float32)
    errors = []

    def expect(error: type[Exception], call: object, *args: object) -> None:
        with pytest.raises(error) as info:
            call(*args)  # type: ignore[operator]
        errors.append(str(info.value))

    expect(ValueError, buffer.all_gather, x)
    expect(ValueError, buffer.agrs_get_inplace_tensor, (2,), torch.float32)
    expect(ValueError, buffer.destroy_agrs_session)
    expect(ValueError, buffer.agrs_set_config, TWO_MIB + 1, 4)
    buffer.agrs_set_config(2 * 8 * 4 * group.size(), 3)  # room for two gathers of x
    with buffer.agrs_new_session():
        expect(ValueError, buffer.create_agrs_session)
        buffer.all_gather(x)
        expect(ValueError, buffer.all_gather, x.reshape(2, 4).t())  # not contiguous
        buffer.all_gather(x)
        expect(ValueError, buffer.all_gather, x[:1])  # bytes used up
        expect(ValueError, buffer.agrs_set_config, TWO_MIB, 4)
    buffer.agrs_set_config(TWO_MIB, 1)
    with buffer.agrs_new_session():
        buffer.reduce_scatter(torch.ones((group.size(), 4)))
        expect(ValueError, buffer.all_gather, x)  # calls used up
        expect(TypeError, buffer.reduce_scatter, torch.ones((group.size(), 4), dtype=torch.float16))
    with buffer.agrs_new_session(enabled=False):
        expect(ValueError, buffer.all_gather, x)
    buffer.destroy()
    expect(ValueError, buffer.all_gather, x)
    return errors


def test_the_session_rules_hold_on_every_rank_with_clear_errors() -> None:
    outcomes = LoopbackWorld(2, device="cpu").run(_session_rules_rank)
    assert outcomes[0] == outcomes[1]
    expected = ["all_gather: needs an open AGRS session", "agrs_get_inplace_tensor: needs an open AGRS session",
                "destroy_agrs_session: needs an open AGRS session", "must be <= the buffer's num_bytes",
                "sessions do not nest", "`t` must be contiguous", "`num_max_session_bytes` = 128 bytes",
                "needs no open AGRS session", "`num_max_all_gathers_per_session` = 1 calls",
                "`t` must have dtype torch.bfloat16 or torch.float32", "all_gather: needs an open AGRS session",
                "the buffer must be alive"]  # fmt: skip
    assert len(outcomes[0]) == len(expected), outcomes[0]
    for message, fragment in zip(outcomes[0], expected, strict=True):
        assert fragment in message, (fragment, message)


def _disagreeing_rank(rank: int, group: dist.ProcessGroup, what: str) -> str:
    buffer = _buffer(group)
    if what == "shape":
        x = torch.zeros(8 if rank == 0 else 9)
    else:  # rank 1 passes a tensor that is not contiguous
        x = torch.zeros((4, 2)) if rank == 0 else torch.zeros((2, 4)).t()
    try:
        with buffer.agrs_new_session():
            buffer.all_gather(x)
        return "no error"
    except (ValueError, EPPeerError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        buffer.destroy()


def test_ranks_that_disagree_all_raise() -> None:
    shape = LoopbackWorld(2, device="cpu").run(_disagreeing_rank, "shape")
    assert all("every rank must make the same call with the same shapes" in o for o in shape), shape
    rejected = LoopbackWorld(2, device="cpu").run(_disagreeing_rank, "contiguity")
    assert rejected[0].startswith("EPPeerError") and "rank(s) [1] rejected" in rejected[0], rejected
    assert rejected[1].startswith("ValueError") and "must be contiguous" in rejected[1], rejected


def stalled_peer_worker(rank: int, num_ranks: int) -> str:
    buffer = _buffer(dist.group.WORLD, num_cpu_timeout_secs=1)
    outcome = "joined"
    if rank == 0:
        started = time.monotonic()
        try:
            with buffer.agrs_new_session():
                buffer.all_gather(torch.zeros(4))
        except EPTimeoutError as error:
            outcome = f"timed out after {time.monotonic() - started:.1f} s: {error}"
    else:
        time.sleep(8)  # never joins the all-gather (long past the 1 s deadline)
    return outcome


def test_a_stalled_peer_raises_ep_timeout_error() -> None:
    outcomes = spawn_ranks(stalled_peer_worker, 2, timeout_s=120)
    seconds = float(outcomes[0].removeprefix("timed out after ").split(" s:")[0]) if "timed out" in outcomes[0] else 0.0
    assert 1.0 <= seconds < 30 and "a peer did not join" in outcomes[0], outcomes  # a 1 s deadline, on a busy machine


def gloo_agrs_worker(rank: int, num_ranks: int) -> bool:
    buffer = _buffer(dist.group.WORLD)
    with buffer.agrs_new_session():
        gathered, _ = buffer.all_gather(torch.full((3,), float(rank)))
        reduced, _ = buffer.reduce_scatter(torch.arange(num_ranks * 2, dtype=torch.float32).reshape(num_ranks, 2))
    buffer.destroy()
    expected = torch.arange(num_ranks * 2, dtype=torch.float32).reshape(num_ranks, 2)[rank] * num_ranks
    return torch.equal(gathered, torch.arange(num_ranks).float().unsqueeze(1).expand(-1, 3)) and torch.equal(
        reduced, expected
    )


def test_a_pair_of_gloo_processes_gathers_and_reduces() -> None:
    assert spawn_ranks(gloo_agrs_worker, 2, timeout_s=120) == [True, True]
