"""Reference backend on 2 ranks: exact round trips, edge cases, cross-rank agreement, deadlines.

One spawn runs all the checks of `semantics_worker` in sequence; the deadline test needs its own.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.event import EventHandle, EventOverlap
from deep_ep.utils.routing import uniform_routing
from deep_ep.utils.spawn import spawn_ranks

TMAX, H = 32, 256


def small_ints(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Non-zero small integers, exact in BF16 even after summing a few of them."""
    values = torch.randint(1, 9, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    return values.to(torch.bfloat16).to(device)


def check_roundtrip(buffer: deep_ep.ElasticBuffer, gen: torch.Generator, num_experts: int, num_topk: int) -> None:
    """combine(dispatch(x)) == x * (holder ranks) plain, == x * (valid lanes) expanded; bit for bit."""
    device, rank = buffer.device, buffer.rank_idx
    num_tokens = [TMAX, 0][rank] if num_topk == 3 else int(torch.randint(1, TMAX + 1, (1,), generator=gen))
    topk_idx, _ = uniform_routing(num_tokens, num_experts, num_topk, masked_ratio=0.3, generator=gen)
    topk_idx = topk_idx.to(device)
    x = small_ints((num_tokens, H), gen, device)
    num_local = num_experts // buffer.num_ranks
    holders = torch.tensor(
        [len({e // num_local for e in row if e >= 0}) for row in topk_idx.tolist()], dtype=torch.float32
    ).reshape(num_tokens, 1)
    lanes = (topk_idx >= 0).sum(dim=1, keepdim=True).float().cpu()
    for do_expand in (False, True):
        for do_cpu_sync in (True, False):
            for alignment in (1, 8):
                recv_x, _, _, handle, _ = buffer.dispatch(
                    x, topk_idx, num_experts=num_experts, expert_alignment=alignment, do_expand=do_expand,
                    do_cpu_sync=do_cpu_sync, do_zero_padding=do_expand,
                )  # fmt: skip
                combined, weights, _ = buffer.combine(recv_x, handle)
                assert weights is None
                factor = lanes if do_expand else holders
                expected = (x.float().cpu() * factor).to(torch.bfloat16)
                assert torch.equal(combined.cpu(), expected), f"round trip {do_expand=} {do_cpu_sync=} {alignment=}"
                # A cached dispatch of other data with the same routing round-trips too
                x2 = small_ints((num_tokens, H), gen, device)
                recv_x2, _, _, same_handle, _ = buffer.dispatch(x2, handle=handle, do_expand=do_expand)
                assert same_handle is handle and recv_x2.shape == recv_x.shape
                combined2, _, _ = buffer.combine(recv_x2, handle, bias=(x, x))
                expected2 = (x2.float().cpu() * factor + 2 * x.float().cpu()).to(torch.bfloat16)
                assert torch.equal(combined2.cpu(), expected2)


def check_unrouted_tokens(buffer: deep_ep.ElasticBuffer, gen: torch.Generator) -> None:
    """Tokens whose lanes are all -1 go nowhere and combine to zero (or to the bias)."""
    device = buffer.device
    topk_idx = torch.full((5, 2), -1, dtype=torch.int64, device=device)
    topk_idx[1:3, 0] = torch.tensor([1, 6], device=device)
    x = small_ints((5, H), gen, device)
    bias = small_ints((5, H), gen, device)
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx, num_experts=8)
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined[[0, 3, 4]].cpu(), torch.zeros((3, H), dtype=torch.bfloat16))
    assert torch.equal(combined[1:3].cpu(), x[1:3].cpu())
    combined, _, _ = buffer.combine(recv_x, handle, bias=bias)
    assert torch.equal(combined[[0, 3, 4]].cpu(), bias[[0, 3, 4]].cpu())


def check_agreement(buffer: deep_ep.ElasticBuffer, gen: torch.Generator) -> None:
    """Arguments that must agree across ranks raise ValueError on every rank; bad input never communicates."""
    device, rank = buffer.device, buffer.rank_idx
    topk_idx, _ = uniform_routing(4, 8, 2, generator=gen)
    topk_idx = topk_idx.to(device)
    x = small_ints((4, H), gen, device)
    with pytest.raises(ValueError, match="all ranks must pass the same `num_experts`"):
        buffer.dispatch(x, topk_idx, num_experts=8 if rank == 0 else 16)
    with pytest.raises(ValueError, match="all ranks must pass the same `hidden`"):
        buffer.dispatch(x[:, : H // 2 * (1 + rank)].contiguous(), topk_idx, num_experts=8)
    # Fields the user did not name are worded as the arguments they come from
    with pytest.raises(ValueError, match=r"the same `topk_weights`, got \[given, None\]"):
        buffer.dispatch(x, topk_idx, torch.ones(4, 2, device=device) if rank == 0 else None, num_experts=8)
    with pytest.raises(ValueError, match=r"the same `x` dtype, got \[bfloat16, float8_e4m3fn\]"):
        fp8 = (x.to(torch.float8_e4m3fn), torch.ones(4, H // 128, device=device))
        buffer.dispatch(x if rank == 0 else fp8, topk_idx, num_experts=8)
    with pytest.raises(ValueError, match="`num_experts` must be a multiple of the number of ranks"):
        buffer.dispatch(x, topk_idx, num_experts=7)
    # Only rank 0 passes a bad argument: it raises, and tells rank 1, whose same call raises too;
    # nothing moved, so both go on with the same buffer
    if rank == 0:
        with pytest.raises(ValueError, match="`topk_idx`"):
            buffer.dispatch(x, topk_idx + 100, num_experts=8)
    else:
        with pytest.raises(deep_ep.EPPeerError, match=r"rank 0 rejected its input \(ValueError: dispatch: `topk_idx`"):
            buffer.dispatch(x, topk_idx, num_experts=8)
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx, num_experts=8)
    buffer.combine(recv_x, handle)


def check_deterministic_and_events(buffer: deep_ep.ElasticBuffer, gen: torch.Generator) -> None:
    """Two identical dispatches give identical bits; events, hooks and context managers work on CPU."""
    device = buffer.device
    topk_idx, topk_weights = uniform_routing(TMAX, 16, 4, masked_ratio=0.1, generator=gen)
    topk_idx, topk_weights = topk_idx.to(device), topk_weights.to(device)
    x = torch.randn((TMAX, H), generator=gen).to(torch.bfloat16).to(device)
    first = buffer.dispatch(x, topk_idx, topk_weights, num_experts=16, do_expand=True, do_zero_padding=True)
    second = buffer.dispatch(x, topk_idx, topk_weights, num_experts=16, do_expand=True, do_zero_padding=True,
                             async_with_compute_stream=True)  # fmt: skip
    calls = []
    second[-1].register_hook_after_wait(lambda: calls.append(1))
    with second[-1](release_handle=True):
        pass
    assert calls == [1] and second[-1].event is None
    for a, b in ((first[0], second[0]), (first[2], second[2])):
        assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))
    assert torch.equal(first[3].recv_src_metadata, second[3].recv_src_metadata)
    combined = [buffer.combine(first[0], first[3], topk_weights=first[2])[0] for _ in range(2)]
    assert torch.equal(combined[0].cpu().view(torch.uint8), combined[1].cpu().view(torch.uint8))
    event = buffer.capture()
    assert isinstance(event, EventHandle) and event.query()
    overlap = EventOverlap(event)
    overlap.current_stream_wait()
    assert buffer.get_logical_domain_size() == (1, 2) and buffer.get_physical_domain_size() == (1, 2)
    assert (buffer.num_scaleup_ranks, buffer.scaleup_rank_idx, buffer.scaleout_rank_idx) == (2, buffer.rank_idx, 0)
    assert (buffer.get_comm_stream() is None) == (device.type == "cpu")
    buffer.barrier()
    buffer.barrier(use_comm_stream=False, with_cpu_sync=True)


def semantics_worker(rank: int, num_ranks: int, seed: int) -> None:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=TMAX, hidden=H, backend="reference")
    no_multi = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=TMAX, hidden=H, allow_multiple_reduction=False, backend="reference"
    )
    try:
        for num_experts, num_topk in ((2, 1), (8, 3), (16, 4)):
            check_roundtrip(buffer, gen, num_experts, num_topk)
            check_roundtrip(no_multi, gen, num_experts, num_topk)
        check_unrouted_tokens(buffer, gen)
        check_agreement(buffer, gen)
        check_deterministic_and_events(buffer, gen)
    except Exception as error:
        raise AssertionError(f"seed={seed}: {error}") from error


def deadline_worker(rank: int, num_ranks: int) -> str:
    buffer = deep_ep.ElasticBuffer(dist.group.WORLD, 2 << 20, num_cpu_timeout_secs=2, backend="reference")
    if rank == 1:
        time.sleep(5)  # stays alive (so the peer sees silence, not a closed connection) but never calls
        return "idle"
    topk_idx = torch.tensor([[0], [1]], dtype=torch.int64)
    x = torch.ones((2, 128), dtype=torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(deep_ep.EPTimeoutError, match="rank 0 of 2 waited more than 2 s"):
        buffer.dispatch(x, topk_idx, num_experts=2, num_max_tokens_per_rank=2)
    assert time.monotonic() - start < 6
    with pytest.raises(ValueError, match="failed earlier"):
        buffer.dispatch(x, topk_idx, num_experts=2, num_max_tokens_per_rank=2)
    return "timed out"


def fresh_seed() -> int:
    seed = random.SystemRandom().randrange(1 << 30)
    print(f"seed={seed}")
    return seed


def test_semantics_2_ranks() -> None:
    spawn_ranks(semantics_worker, 2, args=(fresh_seed(),), timeout_s=300)


def test_host_deadline_raises_timeout() -> None:
    assert spawn_ranks(deadline_worker, 2, timeout_s=120) == ["timed out", "idle"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_semantics_2_gpus_nccl() -> None:
    spawn_ranks(semantics_worker, 2, backend="nccl", args=(fresh_seed(),), timeout_s=300)
