"""Random routing tables for tests and benchmarks (seeded, distinct experts per token).

Every generator returns `(topk_idx, topk_weights)`: `topk_idx` `[num_tokens, num_topk]` with
`torch.int64` (global expert ids, `-1` for a masked lane, no duplicate expert in a row) and
`topk_weights` `[num_tokens, num_topk]` with `torch.float32` (positive, `0` on masked lanes).
Random numbers are drawn on the CPU from the given generator, so results do not depend on the device.
"""

from __future__ import annotations

import torch


def _make_generator(generator: torch.Generator | int | None) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        return generator
    result = torch.Generator()
    if generator is None:
        result.seed()
    else:
        result.manual_seed(int(generator))
    return result


def _finish(
    scores: torch.Tensor,
    num_topk: int,
    masked_ratio: float,
    generator: torch.Generator,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = scores.shape
    if not 0 < num_topk <= num_experts:
        raise ValueError(f"routing: `num_topk` must be in [1, {num_experts}], got {num_topk}")
    if not 0.0 <= masked_ratio <= 1.0:
        raise ValueError(f"routing: `masked_ratio` must be in [0, 1], got {masked_ratio}")
    topk_idx = torch.topk(scores, num_topk, dim=1, sorted=False).indices.to(torch.int64)

    # Shuffle the lanes, so that lane order carries no information
    lane_order = torch.rand((num_tokens, num_topk), generator=generator).argsort(dim=1)
    topk_idx = topk_idx.gather(1, lane_order)
    topk_weights = torch.rand((num_tokens, num_topk), generator=generator) + 0.05
    if masked_ratio > 0:
        masked = torch.rand((num_tokens, num_topk), generator=generator) < masked_ratio
        topk_idx = topk_idx.masked_fill(masked, -1)
        topk_weights = topk_weights.masked_fill(masked, 0.0)
    return topk_idx.contiguous().to(device), topk_weights.float().contiguous().to(device)


def uniform_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    masked_ratio: float = 0.0,
    generator: torch.Generator | int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route every token to `num_topk` distinct experts drawn uniformly at random.

    Arguments:
        num_tokens: the number of tokens `T`.
        num_experts: the number of experts `E`.
        num_topk: the number of lanes `K` per token (`K <= E`).
        masked_ratio: the probability that a lane is masked to `-1`.
        generator: a CPU `torch.Generator`, or an int seed, or `None` for a fresh seed.
        device: where the results go.

    Returns:
        topk_idx: `[T, K]` with `torch.int64`.
        topk_weights: `[T, K]` with `torch.float32`.
    """
    generator = _make_generator(generator)
    scores = torch.rand((num_tokens, num_experts), generator=generator)
    return _finish(scores, num_topk, masked_ratio, generator, device)


def imbalanced_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    num_ranks: int,
    hot_rank: int = 0,
    hot_fraction: float = 0.5,
    masked_ratio: float = 0.0,
    generator: torch.Generator | int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens with a hot rank: a fraction of the tokens prefer the hot rank's experts.

    A preferring token takes `min(K, E / num_ranks)` of its lanes from the hot rank's experts and the
    rest uniformly from the others; the remaining tokens are routed uniformly.

    Arguments:
        num_tokens: the number of tokens `T`.
        num_experts: the number of experts `E` (a multiple of `num_ranks`).
        num_topk: the number of lanes `K` per token (`K <= E`).
        num_ranks: the number of ranks the experts are split over.
        hot_rank: the rank whose experts are preferred.
        hot_fraction: the probability that a token prefers the hot rank.
        masked_ratio: the probability that a lane is masked to `-1`.
        generator: a CPU `torch.Generator`, or an int seed, or `None` for a fresh seed.
        device: where the results go.

    Returns:
        topk_idx: `[T, K]` with `torch.int64`.
        topk_weights: `[T, K]` with `torch.float32`.
    """
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"imbalanced_routing: `num_experts` ({num_experts}) must be a multiple of `num_ranks` ({num_ranks})"
        )
    if not 0 <= hot_rank < num_ranks:
        raise ValueError(f"imbalanced_routing: `hot_rank` must be in [0, {num_ranks}), got {hot_rank}")
    generator = _make_generator(generator)
    num_local_experts = num_experts // num_ranks
    scores = torch.rand((num_tokens, num_experts), generator=generator)
    prefers_hot = torch.rand((num_tokens, 1), generator=generator) < hot_fraction
    bonus = torch.zeros((1, num_experts))
    bonus[0, hot_rank * num_local_experts : (hot_rank + 1) * num_local_experts] = 2.0
    scores = scores + prefers_hot.float() * bonus
    return _finish(scores, num_topk, masked_ratio, generator, device)
