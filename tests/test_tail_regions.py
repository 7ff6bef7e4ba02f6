"""The regions PP and Engram keep at the end of a window's data region (deep_ep.backends.kernels.tail):
where they sit, that a kept region never moves under another, and the errors of a window too small."""

from __future__ import annotations

import itertools
import random

import pytest

from deep_ep.backends.kernels.pp import ring_bytes, ring_header_bytes
from deep_ep.backends.kernels.tail import REGION_ALIGNMENT_BYTES, TailRegions
from deep_ep.records import WORKSPACE_BYTES


def test_regions_stack_down_from_the_end_and_keep_their_places() -> None:
    data_bytes = WORKSPACE_BYTES + (1 << 20) + 100
    tail = TailRegions(data_bytes)
    assert tail.free_end == data_bytes and tail.describe() == ""
    pp = tail.keep("pp", 5000, "pp_set_config")
    assert pp % REGION_ALIGNMENT_BYTES == 0 and data_bytes - REGION_ALIGNMENT_BYTES < pp + 5120 <= data_bytes
    engram = tail.keep("engram", 70_000, "engram_write")
    assert engram + 70_144 <= pp and tail.free_end == engram
    assert tail.keep("pp", 4000, "pp_set_config") == pp  # smaller: the same place
    assert tail.keep("engram", 90_000, "engram_write") < engram  # the lowest grows downwards
    with pytest.raises(ValueError, match=r"pp_set_config: needs 5376 bytes .* pp region, which holds 5120"):
        tail.keep("pp", 5300, "pp_set_config")  # the engram region is below: pp cannot grow
    assert not tail.fits("pp", 5300) and tail.fits("pp", 5120)


def test_a_window_too_small_names_the_op_and_what_is_kept() -> None:
    tail = TailRegions(WORKSPACE_BYTES + 10_000)
    tail.keep("engram", 6000, "engram_write")
    assert not tail.fits("pp", 6000)
    with pytest.raises(ValueError, match=r"pp_set_config: needs 6144 bytes .* engram 6144 bytes are kept"):
        tail.keep("pp", 6000, "pp_set_config")
    assert tail.describe() == "engram 6144 bytes"  # a refused region changes nothing


def test_random_sequences_never_overlap_nor_move_a_region_under_another() -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    tail = TailRegions(WORKSPACE_BYTES + (4 << 20))
    for _ in range(200):
        name = rng.choice(["pp", "engram"])
        before = dict(tail._regions)
        try:
            tail.keep(name, rng.randint(1, 3 << 20), "op")
        except ValueError:
            assert tail._regions == before, seed
            continue
        spans = sorted(tail._regions.values())
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans)), (seed, spans)
        assert spans[0][0] >= WORKSPACE_BYTES and spans[-1][0] + spans[-1][1] <= tail.data_bytes, (seed, spans)
        assert all(tail._regions[other] == before[other] for other in before if other != name), seed


def test_the_ring_holds_every_other_rank_slots_after_its_flags() -> None:
    assert ring_header_bytes(4) == 2560 and ring_header_bytes(5) == 3072  # 2 x 64 counters, 64 x slots sizes
    assert ring_bytes(8, 1000, 4) == ring_header_bytes(4) + 7 * 4 * 1024
