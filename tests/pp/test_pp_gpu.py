"""Pipeline send/recv on CUDA virtual ranks of one GPU (issue 24). Kernels buffers move the tensors
with the copy engines through the ring in the windows (deep_ep.backends.kernels.pp): random schedules
between any ranks, several rounds so that every pair's ring goes round more than once, bit for bit;
a receive of the wrong size raised at the next call with the buffer still usable; a peer that never
receives or never sends makes the device wait expire; a window too small for a ring falls back to
the group's point-to-point calls."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.backends.kernels.pp import NvlinkPp
from deep_ep.host_reads import wait_for_stream
from deep_ep.loopback import LoopbackRankError, LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

NUM_SLOTS = 3
MAX_BYTES = 1 << 16
DTYPES = (torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.int64)


def _message(seed: int, key: tuple[int, ...], num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor a message carries, rebuilt from its key by sender and receiver alike."""
    gen = torch.Generator(device="cuda").manual_seed(hash((seed, *key)) % 2**63)
    raw = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen, device="cuda")
    return raw.view(dtype)


def _schedule(seed: int, num_ranks: int, num_rounds: int) -> list[list[tuple[int, int, int, torch.dtype]]]:
    """Per round, messages `(src, dst, num_bytes, dtype)`: at most `NUM_SLOTS` per pair (a round's
    sends all come before its receives on every stream, so more would wait for themselves)."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(num_rounds):
        messages = []
        for src in range(num_ranks):
            for dst in rng.sample([r for r in range(num_ranks) if r != src], k=min(3, num_ranks - 1)):
                for _ in range(rng.randint(1, NUM_SLOTS)):
                    dtype = rng.choice(DTYPES)
                    num_elements = rng.choice([0, 1, 7, 33, MAX_BYTES // dtype.itemsize])
                    messages.append((src, dst, num_elements * dtype.itemsize, dtype))
        rounds.append(messages)
    return rounds


def _schedule_rank(rank: int, group: dist.ProcessGroup, seed: int, num_rounds: int) -> dict:
    buffer = deep_ep.ElasticBuffer(group, 16 << 20, backend="kernels", explicitly_destroy=True)
    buffer.pp_set_config(MAX_BYTES, NUM_SLOTS)
    assert isinstance(buffer._pp.engine, NvlinkPp)
    received: list[tuple[torch.Tensor, torch.Tensor]] = []
    for round_idx, messages in enumerate(_schedule(seed, group.size(), num_rounds)):
        for i, (src, dst, num_bytes, dtype) in enumerate(messages):
            if src == rank:
                t = _message(seed, (round_idx, i), num_bytes, dtype)
                buffer.pp_send(t, dst)
                t.view(torch.uint8).fill_(0xA5)  # the sender may reuse its tensor at once (stream order)
        for i, (src, dst, num_bytes, dtype) in enumerate(messages):
            if dst == rank:
                got = torch.empty(num_bytes // dtype.itemsize, dtype=dtype, device="cuda")
                buffer.pp_recv(got, src)
                received.append((got, _message(seed, (round_idx, i), num_bytes, dtype)))
    # Poll before reading: a blocking read here could hold back a peer's launch (virtual ranks)
    assert wait_for_stream(timeout_s=60)
    buffer.backend.runtime.check_error()
    same = [torch.equal(got.view(torch.uint8), want.view(torch.uint8)) for got, want in received]
    buffer.barrier()
    buffer.destroy()
    return dict(num_received=len(received), all_equal=all(same))


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_random_schedules_between_any_ranks_are_bitwise_through_the_ring(num_ranks: int) -> None:
    seed = time.time_ns() % 1_000_000
    outcomes = LoopbackWorld(num_ranks).run(_schedule_rank, seed, 4)
    assert all(o["all_equal"] for o in outcomes), (seed, outcomes)
    expected = sum(len(messages) for messages in _schedule(seed, num_ranks, 4))
    assert sum(o["num_received"] for o in outcomes) == expected, (seed, outcomes)


def _wrong_size_rank(rank: int, group: dist.ProcessGroup) -> str:
    buffer = deep_ep.ElasticBuffer(group, 4 << 20, backend="kernels", explicitly_destroy=True)
    buffer.pp_set_config(4096, 2)
    outcome = "no error"
    payload = torch.arange(64, dtype=torch.int32, device="cuda")
    if rank == 0:
        buffer.pp_send(payload, 1)
        buffer.pp_send(payload * 3, 1)
    else:
        buffer.pp_recv(torch.empty(128, dtype=torch.int32, device="cuda"), 0)  # 512 bytes for 256 sent
        got = torch.empty(64, dtype=torch.int32, device="cuda")
        assert wait_for_stream(timeout_s=60)
        try:
            buffer.pp_recv(got, 0)
        except ValueError as error:
            outcome = str(error)
        buffer.pp_recv(got, 0)  # the buffer stays usable: the second message is the next
        assert wait_for_stream(timeout_s=60)
        outcome += f" | next message equal: {torch.equal(got, payload * 3)}"
    buffer.barrier()
    buffer.destroy()
    return outcome


def test_a_receive_of_the_wrong_size_raises_at_the_next_call_and_the_buffer_stays_usable() -> None:
    outcomes = LoopbackWorld(2).run(_wrong_size_rank)
    assert "must hold the 256 bytes rank 0 sent, got 512" in outcomes[1], outcomes
    assert outcomes[1].endswith("next message equal: True"), outcomes


def _silent_peer_rank(rank: int, group: dist.ProcessGroup, silent: str) -> str:
    buffer = deep_ep.ElasticBuffer(group, 4 << 20, backend="kernels", num_gpu_timeout_secs=2, explicitly_destroy=True)
    buffer.pp_set_config(1024, 2)
    stream = torch.cuda.current_stream()
    outcome = "no error"
    if rank == 0:
        try:
            if silent == "receiver":  # a third send needs a slot the receiver never frees
                for _ in range(3):
                    buffer.pp_send(torch.ones(256, device="cuda"), 1)
            else:  # a receive of a message that never comes
                buffer.pp_recv(torch.empty(256, device="cuda"), 1)
            buffer.backend.runtime.wait(stream, "the PP calls")
        except deep_ep.EPTimeoutError as error:
            outcome = str(error)
    dist.barrier(group=group)
    buffer.destroy()
    return outcome


@pytest.mark.parametrize("silent", ["receiver", "sender"])
def test_a_peer_that_never_takes_part_makes_the_device_wait_expire(silent: str) -> None:
    try:
        outcomes = LoopbackWorld(2).run(_silent_peer_rank, silent)
    except LoopbackRankError as error:  # pragma: no cover - the message says which rank failed how
        raise AssertionError(str(error)) from error
    phase = "PP credit" if silent == "receiver" else "PP arrival"
    assert phase in outcomes[0] and "waiting for rank 1" in outcomes[0], outcomes


def _small_window_rank(rank: int, group: dist.ProcessGroup) -> bool:
    n = group.size()
    # V2's hint holds the rings of two neighbours, ours one per peer: 8 ranks need more, so the
    # group's point-to-point calls carry the tensors
    num_bytes = deep_ep.ElasticBuffer.get_pp_buffer_size_hint(1 << 18, 4)
    buffer = deep_ep.ElasticBuffer(group, num_bytes, backend="kernels", explicitly_destroy=True)
    buffer.pp_set_config(1 << 18, 4)
    fell_back = buffer._pp.engine is None
    gen = torch.Generator(device="cuda").manual_seed(rank)
    sent = [torch.randn((64, 128), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    for t in sent:
        buffer.pp_send(t, (rank + 2) % n)
    got = [torch.empty_like(t) for t in sent]
    for t in got:
        buffer.pp_recv(t, (rank - 2) % n)
    gen = torch.Generator(device="cuda").manual_seed((rank - 2) % n)
    expected = [torch.randn((64, 128), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    buffer.destroy()
    return fell_back and all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, expected, strict=True)
    )


def test_a_window_without_room_for_every_ring_falls_back_to_point_to_point() -> None:
    assert LoopbackWorld(8).run(_small_window_rank) == [True] * 8
