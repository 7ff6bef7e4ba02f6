"""One rank's bad input on the reference backend (CPU virtual ranks): every rank raises at once,
naming that rank and its argument, and the buffer stays usable (issue 20 #1)."""

from __future__ import annotations

import pytest
from fail_fast import bad_input_rank, check_outcomes

from deep_ep.loopback import LoopbackWorld


@pytest.mark.parametrize("what", ["topk_idx", "tokens"])
def test_a_rank_that_rejects_its_input_makes_every_rank_raise_at_once(what: str) -> None:
    num_ranks, bad_rank = 4, 3
    outcomes = LoopbackWorld(num_ranks, device="cpu", timeout_s=120).run(
        bad_input_rank, bad_rank, what, 256, "cpu-reference"
    )
    check_outcomes(outcomes, bad_rank, what)
    # The reference backend exchanged nothing: the same buffer goes on
    assert all(outcome["same_buffer"] == "usable" for outcome in outcomes), outcomes
    print(f"\nreference, EP{num_ranks}, bad {what} on rank {bad_rank}: every rank raised within "
          f"{max(o['raised_s'] for o in outcomes) * 1e3:.1f} ms; rank 0: {outcomes[0]['error'][:200]}")  # fmt: skip
