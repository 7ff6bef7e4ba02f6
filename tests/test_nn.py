"""deep_ep.nn on the reference backend (gloo): autograd dispatch/combine and ExpertParallelMoE vs a dense MoE.

The rank workers and the dense model live in `nn_reference.py` (shared with `test_nn_gpu.py`). Each
spawn runs several workers: process start-up costs more than the checks. Seeds are fresh per run
(`EP_TEST_SEED` fixes one) and appear in every failure message.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from nn_reference import ExpertMLP, assert_rounded_close, dense_moe, fresh_seed, route, suite_worker
from torch import nn

import deep_ep
from deep_ep import nn as epnn
from deep_ep.utils.spawn import spawn_ranks

# Dispatch layouts of the adjoint check: (do_expand, do_cpu_sync, expert_alignment)
MODES = [(False, True, 1), (False, False, 1), (True, True, 1), (True, True, 4), (True, False, 4)]

# ExpertParallelMoE configurations of the dense comparison
CONFIGS_2 = [
    dict(grouped=False, expand=False, shared=True, empty_rank=True),
    dict(grouped=False, expand=True, alignment=2, normalize=False),
    dict(grouped=True, expand=True, alignment=4, cpu_sync=True, **{"async": True}),
    dict(grouped=True, expand=True, alignment=4, cpu_sync=False),
    dict(grouped=False, expand=False, dtype="bfloat16"),
]
CONFIGS_4 = [
    dict(grouped=False, expand=False, empty_rank=True),
    dict(grouped=True, expand=True, alignment=2, cpu_sync=False, shared=True),
]


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", fresh_seed()))


def _setup(num_experts: int, **configs: list[dict]) -> dict:
    return dict(backend="reference", hidden=64, ffn=32, num_experts=num_experts, num_topk=3, num_max_tokens=24,
                modes=MODES, **configs)  # fmt: skip


def test_autograd_functions_gradcheck_and_micro_batches_2_ranks() -> None:
    seed = _seed()
    results = spawn_ranks(suite_worker, 2, args=(seed, _setup(8), ["adjoint", "micro_batches"]), timeout_s=240)
    assert results[0] == {"adjoint": len(MODES), "micro_batches": 2}, f"seed {seed}: {results}"


def test_moe_layer_matches_dense_2_ranks() -> None:
    seed = _seed()
    results = spawn_ranks(suite_worker, 2, args=(seed, _setup(8, configs=CONFIGS_2), ["moe"]), timeout_s=240)
    assert len(results[0]["moe"]) == len(CONFIGS_2), f"seed {seed}: {results}"


def test_functions_and_moe_layer_4_ranks() -> None:
    seed = _seed()
    setup = _setup(8, configs=CONFIGS_4)
    results = spawn_ranks(suite_worker, 4, args=(seed, setup, ["adjoint", "micro_batches", "moe"]), timeout_s=300)
    assert all(r["adjoint"] == len(MODES) and len(r["moe"]) == len(CONFIGS_4) for r in results), f"seed {seed}"


# ---------------------------------------------------------------------------------------------- one rank


@pytest.fixture(scope="module")
def buffer() -> Iterator[deep_ep.ElasticBuffer]:
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    buf = deep_ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=32, hidden=64, num_topk=4, backend="reference"
    )
    yield buf
    if created:
        dist.destroy_process_group()


def test_moe_layer_one_rank_matches_dense(buffer: deep_ep.ElasticBuffer) -> None:
    gen = torch.Generator().manual_seed(_seed())
    experts = [ExpertMLP(64, 16, gen, torch.device("cpu"), torch.float32) for _ in range(4)]
    layer = epnn.ExpertParallelMoE(buffer, 64, 4, 2, nn.ModuleList(experts))
    x = torch.randn((20, 64), generator=gen).requires_grad_()
    out = layer(x)
    dense_x = x.detach().clone().requires_grad_()
    expected = dense_moe(dense_x, layer.gate.weight, experts, 1, 2, True, False, layer.route(x)[0])
    assert_rounded_close(out, expected, "one-rank output")
    probe = torch.randn(out.shape, generator=gen)
    (out * probe).sum().backward()
    (expected * probe).sum().backward()
    assert_rounded_close(x.grad, dense_x.grad, "one-rank x.grad")
    idx, weights = layer.route(x)
    expected_idx, expected_weights = route(x, layer.gate.weight, 2, True)
    assert torch.equal(idx, expected_idx) and torch.allclose(weights, expected_weights)
    assert torch.allclose(weights.sum(dim=1), torch.ones(20))


def test_moe_layer_argument_errors(buffer: deep_ep.ElasticBuffer) -> None:
    gen = torch.Generator().manual_seed(1)
    experts = nn.ModuleList([ExpertMLP(64, 16, gen, torch.device("cpu"), torch.float32) for _ in range(4)])
    with pytest.raises(ValueError, match="`experts` must hold the 4 local experts"):
        epnn.ExpertParallelMoE(buffer, 64, 4, 2, experts[:3])
    with pytest.raises(ValueError, match="`num_topk` must be in"):
        epnn.ExpertParallelMoE(buffer, 64, 4, 5, experts)
    with pytest.raises(ValueError, match="needs `do_expand`=True"):
        epnn.ExpertParallelMoE(buffer, 64, 4, 2, lambda x, handle: x, do_expand=False)
    with pytest.raises(ValueError, match="`do_cpu_sync`=False needs a grouped"):
        epnn.ExpertParallelMoE(buffer, 64, 4, 2, experts, do_cpu_sync=False)
    with pytest.raises(TypeError, match=r"`experts` must be an nn\.ModuleList or a callable"):
        epnn.ExpertParallelMoE(buffer, 64, 4, 2, 3)  # type: ignore[arg-type]
    # The autograd dispatch takes BF16 only (the facade takes any dtype as bytes)
    x = torch.randn((4, 64)).requires_grad_()
    with pytest.raises(TypeError, match=r"`x` must have dtype torch\.bfloat16"):
        epnn.dispatch(buffer, x, torch.zeros((4, 1), dtype=torch.int64), num_experts=4)


def test_functions_return_the_buffer_tuples(buffer: deep_ep.ElasticBuffer) -> None:
    gen = torch.Generator().manual_seed(_seed())
    x = torch.randn((6, 64), generator=gen).to(torch.bfloat16).requires_grad_()
    topk_idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    weights = torch.rand((6, 2), generator=gen).requires_grad_()
    recv_x, recv_topk_idx, recv_weights, handle, event = epnn.dispatch(buffer, x, topk_idx, weights, num_experts=4)
    assert isinstance(handle, deep_ep.EPHandle) and isinstance(event, deep_ep.EventOverlap)
    assert recv_x.requires_grad and recv_weights.requires_grad and not recv_topk_idx.requires_grad
    combined, combined_weights, event = epnn.combine(buffer, recv_x * 3, handle, topk_weights=recv_weights)
    assert torch.equal(combined, (x * 3).detach()) and torch.equal(combined_weights, weights.detach())
    (combined.float().sum() + combined_weights.sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 3)) and torch.equal(weights.grad, torch.ones_like(weights))
