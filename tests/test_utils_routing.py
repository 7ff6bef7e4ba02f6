"""deep_ep.utils.routing: distinct experts per row, masking, hot-rank imbalance, seeding."""

from __future__ import annotations

import random

import pytest
import torch

from deep_ep.utils.routing import imbalanced_routing, uniform_routing


@pytest.fixture
def seed() -> int:
    value = random.SystemRandom().randrange(1 << 30)
    print(f"seed={value}")
    return value


def assert_valid(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
    assert ((topk_idx >= -1) & (topk_idx < num_experts)).all()
    for row in topk_idx.tolist():
        valid = [e for e in row if e >= 0]
        assert len(valid) == len(set(valid)), f"repeated expert in {row}"
    assert (topk_weights[topk_idx < 0] == 0).all()
    assert (topk_weights[topk_idx >= 0] > 0).all()


@pytest.mark.parametrize("num_topk", [1, 4, 8])
def test_uniform(num_topk: int, seed: int) -> None:
    topk_idx, topk_weights = uniform_routing(2000, 32, num_topk, generator=seed)
    assert topk_idx.shape == (2000, num_topk)
    assert_valid(topk_idx, topk_weights, 32)
    assert (topk_idx >= 0).all()
    counts = torch.bincount(topk_idx.flatten(), minlength=32).float()
    expected = 2000 * num_topk / 32
    assert (counts - expected).abs().max() < 6 * expected**0.5 + 5


def test_masked_ratio(seed: int) -> None:
    topk_idx, topk_weights = uniform_routing(4000, 16, 4, masked_ratio=0.2, generator=seed)
    assert_valid(topk_idx, topk_weights, 16)
    ratio = (topk_idx < 0).float().mean().item()
    assert 0.17 < ratio < 0.23


def test_imbalanced_hot_rank(seed: int) -> None:
    num_ranks, num_experts, hot_rank = 4, 32, 2
    topk_idx, topk_weights = imbalanced_routing(4000, num_experts, 4, num_ranks, hot_rank, 0.6, generator=seed)
    assert_valid(topk_idx, topk_weights, num_experts)
    on_hot = (topk_idx // (num_experts // num_ranks) == hot_rank).any(dim=1).float().mean().item()
    # 60% prefer the hot rank; of the rest, 1 - C(24,4)/C(32,4) ~ 0.70 hit it by chance
    assert 0.84 < on_hot < 0.92
    cold = imbalanced_routing(4000, num_experts, 4, num_ranks, hot_rank, 0.0, generator=seed)[0]
    assert (cold // 8 == hot_rank).any(dim=1).float().mean().item() < 0.75


def test_seeded_reproducible(seed: int) -> None:
    a = uniform_routing(64, 16, 3, 0.1, generator=seed)
    b = uniform_routing(64, 16, 3, 0.1, generator=torch.Generator().manual_seed(seed))
    c = uniform_routing(64, 16, 3, 0.1, generator=seed + 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_topk"):
        uniform_routing(4, 8, 9)
    with pytest.raises(ValueError, match="num_experts"):
        imbalanced_routing(4, 10, 2, num_ranks=4)
    with pytest.raises(ValueError, match="hot_rank"):
        imbalanced_routing(4, 8, 2, num_ranks=2, hot_rank=2)
