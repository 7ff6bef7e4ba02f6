"""Pipeline send/recv on CPU ranks (issue 24, the reference part): a ring, a pair that is not adjacent,
several tensors in flight, any dtype bit for bit, the sender free to reuse its tensor at once, a size
mismatch, the argument checks, and a receiver whose sender never sends (`EPTimeoutError`, on 2 gloo
processes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.errors import EPTimeoutError
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.spawn import spawn_ranks

TWO_MIB = 2 << 20


def _buffer(group: dist.ProcessGroup, **kwargs: object) -> deep_ep.ElasticBuffer:
    buffer = deep_ep.ElasticBuffer(group, TWO_MIB, backend="reference", explicitly_destroy=True, **kwargs)
    buffer.pp_set_config(4096, 4)
    return buffer


def _tensor(src: int, dst: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(src * 1000 + dst * 10 + i)
    raw = torch.randint(0, 256, (16 * (i + 1) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(-1, 4)


def _exchange_rank(rank: int, group: dist.ProcessGroup) -> list[str]:
    buffer = _buffer(group)
    n = group.size()
    checked = []
    # A ring: send to the next rank, then receive from the previous one
    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.float8_e5m2):
        t = _tensor(rank, (rank + 1) % n, 0, dtype)
        buffer.pp_send(t, (rank + 1) % n)
        t.zero_()  # the send copied it
        got = torch.empty_like(t)
        buffer.pp_recv(got, (rank - 1) % n)
        assert torch.equal(got.view(torch.uint8), _tensor((rank - 1) % n, rank, 0, dtype).view(torch.uint8))
        checked.append(f"ring {dtype}")
    # Rank 0 to rank 2 (not adjacent), three tensors in flight before the first is received
    if rank == 0:
        for i in range(3):
            buffer.pp_send(_tensor(0, 2, i, torch.int8), 2)
    if rank == 2:
        for i in range(3):
            got = torch.empty_like(_tensor(0, 2, i, torch.int8))
            buffer.pp_recv(got, 0)
            assert torch.equal(got, _tensor(0, 2, i, torch.int8)), i
            checked.append(f"from 0, message {i}")
    buffer.barrier()
    buffer.destroy()
    return checked


def test_tensors_reach_any_rank_in_order_bit_for_bit() -> None:
    outcomes = LoopbackWorld(4, device="cpu").run(_exchange_rank)
    assert all(len(o) == 4 for o in outcomes[:2] + outcomes[3:]) and len(outcomes[2]) == 7, outcomes


def _mismatch_rank(rank: int, group: dist.ProcessGroup) -> str:
    buffer = _buffer(group)
    outcome = "sent"
    if rank == 0:
        buffer.pp_send(torch.arange(8, dtype=torch.float32), 1)
        buffer.pp_send(torch.arange(4, dtype=torch.float32), 1)
    else:
        with pytest.raises(ValueError, match="`t` must hold the 32 bytes rank 0 sent, got 16"):
            buffer.pp_recv(torch.empty(4), 0)
        got = torch.empty(4)
        buffer.pp_recv(got, 0)  # the next message is intact
        outcome = str(got.tolist())
    buffer.destroy()
    return outcome


def test_a_receiver_of_the_wrong_size_raises_and_the_next_message_is_intact() -> None:
    assert LoopbackWorld(2, device="cpu").run(_mismatch_rank) == ["sent", "[0.0, 1.0, 2.0, 3.0]"]


def _checks_rank(rank: int, group: dist.ProcessGroup) -> list[str]:
    buffer = deep_ep.ElasticBuffer(group, TWO_MIB, backend="reference", explicitly_destroy=True)
    errors = []
    for call in (lambda: buffer.pp_send(torch.zeros(4), 1 - rank),
                 lambda: buffer.pp_set_config(TWO_MIB, 2),
                 lambda: buffer.pp_set_config(0, 2)):  # fmt: skip
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    buffer.pp_set_config(64, 2)
    for call in (lambda: buffer.pp_send(torch.zeros(17), 1 - rank),
                 lambda: buffer.pp_send(torch.zeros(4), rank),
                 lambda: buffer.pp_recv(torch.zeros(4), 5),
                 lambda: buffer.pp_send(torch.zeros((4, 2)).t(), 1 - rank)):  # fmt: skip
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    buffer.destroy()
    return errors


def test_bad_arguments_are_refused_naming_them() -> None:
    errors = LoopbackWorld(2, device="cpu").run(_checks_rank)[0]
    fragments = ["needs `pp_set_config", "these limits need", "`num_max_tensor_bytes` must be a positive int",
                 "at most `num_max_tensor_bytes` = 64 bytes, got 68", "`dst_rank_idx` must be another rank",
                 "`src_rank_idx` must be another rank in [0, 2)", "`t` must be contiguous"]  # fmt: skip
    assert len(errors) == len(fragments), errors
    for error, fragment in zip(errors, fragments, strict=True):
        assert fragment in error, (fragment, error)


def silent_sender_worker(rank: int, num_ranks: int) -> str:
    buffer = _buffer(dist.group.WORLD, num_cpu_timeout_secs=1)
    outcome = "idle"
    if rank == 1:
        started = time.monotonic()
        try:
            buffer.pp_recv(torch.empty(4), 0)
        except EPTimeoutError as error:
            outcome = f"timed out after {time.monotonic() - started:.1f} s: {error}"
    else:
        time.sleep(8)  # never sends (long past the 1 s deadline)
    return outcome


def test_a_receiver_whose_sender_never_sends_raises_ep_timeout_error() -> None:
    outcomes = spawn_ranks(silent_sender_worker, 2, timeout_s=120)
    seconds = float(outcomes[1].removeprefix("timed out after ").split(" s:")[0]) if "timed out" in outcomes[1] else 0.0
    assert 1.0 <= seconds < 30 and "pp_recv from rank 0" in outcomes[1], outcomes  # a 1 s deadline, on a busy machine


def gloo_pair_worker(rank: int, num_ranks: int) -> bool:
    buffer = _buffer(dist.group.WORLD)
    buffer.pp_send(_tensor(rank, 1 - rank, 2, torch.bfloat16), 1 - rank)
    got = torch.empty_like(_tensor(1 - rank, rank, 2, torch.bfloat16))
    buffer.pp_recv(got, 1 - rank)
    buffer.barrier()  # both sends done before either process leaves (gloo drops a pair whose peer left)
    buffer.destroy()
    return torch.equal(got.view(torch.int16), _tensor(1 - rank, rank, 2, torch.bfloat16).view(torch.int16))


def test_a_pair_of_gloo_processes_exchanges_tensors() -> None:
    assert spawn_ranks(gloo_pair_worker, 2, timeout_s=120) == [True, True]
