"""AGRS on CUDA virtual ranks of one GPU (issue 24): the same checks as on CPU, with kernels buffers
(whose AGRS runs on torch collectives until the copy-engine path is built)."""

from __future__ import annotations

import time

import pytest
import torch
from agrs_checks import agrs_rank

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_all_gather_and_reduce_scatter_on_virtual_ranks(num_ranks: int) -> None:
    seed = time.time_ns() % 1_000_000
    outcomes = LoopbackWorld(num_ranks).run(agrs_rank, seed, "kernels")
    assert num_ranks < 3 or sum(o["order_differs"] for o in outcomes) > 0, (seed, outcomes)
