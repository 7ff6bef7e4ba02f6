"""`deep_ep.bench` on a GPU: what the benchmark's own machinery must not do to a long run."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_released_graphs_give_their_memory_pools_back():
    """Every captured graph has a memory pool of its own; releasing the graphs must return it, or a
    bench of many cases reserves each case's pools anew until a capture runs out of memory."""
    from deep_ep.bench.timing import capture, release_captured

    num_bytes = 256 << 20

    def call(r: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(r + 1)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    num_rounds, num_graphs, num_calls = 8, 2, 2
    for _ in range(num_rounds):
        op = capture(call, num_graphs, num_calls)
        assert int(op.replay_first()[0]) == 1
        release_captured([op], lambda: None)
    grown = torch.cuda.memory_reserved() - before
    # One round's graphs hold num_graphs * num_calls * num_bytes (1 GiB); the warm-up call's block
    # may stay cached outside any pool
    assert grown <= num_bytes, f"{grown / 2**30:.2f} GiB still reserved after {num_rounds} rounds of released graphs"
