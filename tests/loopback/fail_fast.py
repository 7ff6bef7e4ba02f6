"""One rank's bad input on virtual ranks: the rank function of the fail-fast tests (CPU and GPU).

Every rank runs a correct dispatch and combine, then the same sequence (a CPU-sync dispatch, its
combine, another dispatch) in which one rank's input is bad. With deadlines of a minute, raising
within a second shows that the bad rank told its peers. Then every rank replaces the buffer on the
same group and a correct dispatch and combine run again.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

NUM_EXPERTS, NUM_TOPK, NUM_MAX_TOKENS = 256, 4, 64
BAD_VALUE, BAD_AT = 300, (17, 2)
DEADLINE_S = 60


def _inputs(rank: int, num_tokens: int, hidden: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from deep_ep.utils.routing import uniform_routing

    gen = torch.Generator().manual_seed(1000 * rank + num_tokens)
    topk_idx, _ = uniform_routing(num_tokens, NUM_EXPERTS, NUM_TOPK, generator=gen)
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    return x.to(device), topk_idx.to(device)


def _round_trip(buffer: Any, x: torch.Tensor, topk_idx: torch.Tensor, **kwargs: Any) -> None:
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, num_experts=NUM_EXPERTS, **kwargs)
    buffer.combine(recv_x if not isinstance(recv_x, tuple) else recv_x[0], handle)


def _buffer(group: Any, hidden: int, backend: str) -> Any:
    import deep_ep

    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=NUM_MAX_TOKENS, hidden=hidden, num_topk=NUM_TOPK,
                                 backend=backend, explicitly_destroy=True, num_cpu_timeout_secs=DEADLINE_S,
                                 num_gpu_timeout_secs=DEADLINE_S)  # fmt: skip


def bad_input_rank(rank: int, group: Any, bad_rank: int, what: str, hidden: int, backend: str) -> dict:
    """`what`: "topk_idx" (value 300 at [17, 2]) or "tokens" (one more than `num_max_tokens_per_rank`)."""
    device = "cuda" if torch.cuda.is_available() and backend != "cpu-reference" else "cpu"
    backend = "reference" if backend == "cpu-reference" else backend
    buffer = _buffer(group, hidden, backend)
    x, topk_idx = _inputs(rank, 48, hidden, device)
    # Kernels loaded, every rank in step; the calls below have this shape, so where a buffer has a
    # steady path (no guard bytes) they are replays, as the second round trip here is
    for _ in range(2):
        _round_trip(buffer, x, topk_idx, do_cpu_sync=True)
    steady = getattr(buffer, "_steady", None)
    if rank == bad_rank and what == "topk_idx":
        topk_idx = topk_idx.clone()
        topk_idx[BAD_AT] = BAD_VALUE
    if rank == bad_rank and what == "tokens":
        x, topk_idx = _inputs(rank, NUM_MAX_TOKENS + 1, hidden, device)
    x_before, topk_before = x.clone(), topk_idx.clone()
    dist.barrier(group=group)
    started = time.monotonic()
    outcome: dict = {"error": None, "type": None, "steady_calls": None if steady is None else steady.num_calls}
    try:
        _round_trip(buffer, x, topk_idx, do_cpu_sync=True)
        _round_trip(buffer, x, topk_idx, do_cpu_sync=True)
    except Exception as error:
        outcome.update(error=str(error), type=type(error).__name__)
    outcome["raised_s"] = time.monotonic() - started
    outcome["inputs_intact"] = torch.equal(x, x_before) and torch.equal(topk_idx, topk_before)
    try:
        _round_trip(buffer, *_inputs(rank, 40, hidden, device))
        outcome["same_buffer"] = "usable"
    except Exception as error:
        outcome["same_buffer"] = f"{type(error).__name__}: {error}"
    dist.barrier(group=group)  # every rank's last call on the old buffer has raised or run
    buffer.destroy()
    fresh = _buffer(group, hidden, backend)
    _round_trip(fresh, *_inputs(rank, 40, hidden, device), do_cpu_sync=True)
    fresh.destroy()
    outcome["new_buffer"] = "usable"
    return outcome


def check_outcomes(outcomes: list[dict], bad_rank: int, what: str) -> None:
    """Every rank raised within a second, the peers naming the bad rank and its argument."""
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is not None, f"rank {rank} did not raise: {outcome}"
        assert outcome["raised_s"] < 1.0, f"rank {rank} raised after {outcome['raised_s']:.2f} s: {outcome}"
        assert outcome["inputs_intact"] and outcome["new_buffer"] == "usable", outcome
        if what == "topk_idx":
            assert "`topk_idx`" in outcome["error"] and str(BAD_VALUE) in outcome["error"], outcome
            assert f"[{BAD_AT[0]}, {BAD_AT[1]}]" in outcome["error"], outcome
        else:
            assert "num_max_tokens_per_rank" in outcome["error"] or "tokens" in outcome["error"], outcome
        if rank == bad_rank:
            assert outcome["type"] == "ValueError", outcome
        else:
            assert outcome["type"] == "EPPeerError" and f"rank {bad_rank}" in outcome["error"], outcome
