"""The text of a device-side failure (`deep_ep.backends.kernels.runtime.describe_fault`), from error-block words as the
kernels write them (fault.cuh): the rank that found the failure records its channel and counters,
a rank told by a peer records -1 for them."""

from __future__ import annotations

import random

from deep_ep.backends.kernels.layout import ERROR_REPORTED_BY_PEER, ERROR_TIMED_OUT_HERE, ERROR_WORDS
from deep_ep.backends.kernels.runtime import describe_fault


def _words(**values: int) -> dict[str, int]:
    return {name: values.get(name, 0) for name in ERROR_WORDS}


def test_a_timeout_names_both_ranks_and_the_counters_only_where_it_was_found():
    rng = random.Random()
    channel, observed, expected = rng.randrange(64), rng.randrange(1 << 20), rng.randrange(1 << 20, 1 << 21)
    here = describe_fault(_words(status=ERROR_TIMED_OUT_HERE, phase=3, rank=2, peer=5, channel=channel,
                                 observed=observed, expected=expected, reporter=2), 2.0)  # fmt: skip
    assert "dispatch arrivals timed out on rank 2 waiting for rank 5 after 2 s" in here
    assert f"(channel {channel}, counter {observed}, expected >= {expected})" in here and "told" not in here
    told = describe_fault(_words(status=ERROR_REPORTED_BY_PEER, phase=3, rank=2, peer=5, channel=-1, observed=-1,
                                 expected=-1, reporter=0), 2.0)  # fmt: skip
    assert "timed out on rank 2 waiting for rank 5" in told and "rank 2 told rank 0" in told
    assert "channel" not in told and "unusable" in told


def test_an_operation_mismatch_shows_signatures_only_where_they_were_compared():
    observed, expected = random.getrandbits(32) | 1, random.getrandbits(32) | 2
    here = describe_fault(_words(status=ERROR_TIMED_OUT_HERE, phase=8, rank=0, peer=1, channel=0,
                                 observed=observed - (1 << 32) if observed >> 31 else observed,
                                 expected=expected), 2.0)  # fmt: skip
    assert f"rank 1 ran a different operation than rank 0 (signature {observed:#x}, expected {expected:#x})" in here
    told = describe_fault(_words(status=ERROR_REPORTED_BY_PEER, phase=8, rank=0, peer=1, channel=-1, observed=-1,
                                 expected=-1, reporter=0), 2.0)  # fmt: skip
    assert "rank 1 ran a different operation than rank 0: the ranks' sequences" in told
    assert "0xffffffff" not in told
