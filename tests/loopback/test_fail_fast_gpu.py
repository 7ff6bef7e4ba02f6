"""One rank's bad input on the NVLink kernels (virtual ranks on one GPU): every rank raises within a
second, naming that rank and its argument, nothing is written outside a window or an output, and a
new buffer on the same group works (issue 20 #1)."""

from __future__ import annotations

import pytest
import torch
from fail_fast import bad_input_rank, check_outcomes

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("what", ["topk_idx", "tokens"])
@pytest.mark.parametrize("num_ranks", [4, 8])
def test_a_rank_that_rejects_its_input_stops_every_rank_at_once(num_ranks: int, what: str) -> None:
    bad_rank = num_ranks - 1
    world = LoopbackWorld(num_ranks, guard_bytes=64 << 10)
    outcomes = world.run(bad_input_rank, bad_rank, what, 2048, "kernels")
    damaged = world.check_guards()
    world.close()
    check_outcomes(outcomes, bad_rank, what)
    assert damaged == [], damaged
    # The kernels cannot undo an operation the peers are inside: the old buffer is unusable everywhere
    assert all("unusable" in outcome["same_buffer"] for outcome in outcomes), outcomes
    print(f"\nkernels, EP{num_ranks}, bad {what} on rank {bad_rank}: every rank raised within "
          f"{max(o['raised_s'] for o in outcomes) * 1e3:.1f} ms; rank 0: {outcomes[0]['error'][:220]}")  # fmt: skip
