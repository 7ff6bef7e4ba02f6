"""Megatron-Core's own MoELayer (flex dispatcher, DeepEP V2 backend) trained a few steps on deep_ep, 2 GPUs.

Needs a megatron-core whose flex dispatcher has `moe_flex_dispatcher_backend="deepepv2"`: today only
the `dev` branch of NVIDIA/Megatron-LM (checked at d48bd6be0a85, megatron-core 0.19.0); no PyPI
release has it (0.16.1, the newest, offers 'deepep', which needs DeepEP V1's `deep_ep.Buffer`, and
'hybridep'). The test is skipped when the installed megatron-core lacks it; `docs/frameworks/megatron.md`
says how to carry one to the GPU machine. No transformer-engine or apex: the layer is built from
Megatron's local (pure torch) spec, SequentialMLP experts, with the router in FP32.

Each step: the layer runs forward and backward on every rank's `[S, B, H]` BF16 tokens (the same batch
every step, loss `<y, probe>` per token, which SGD must lower); each rank also
computes the same MoE densely in FP32 over all ranks' tokens from the layer's current weights (router
softmax over the top-k logits, `sum_k p_k * fc2(gelu(fc1(x)))`) and compares the loss, the router and
expert gradients and the input gradient within BF16 arithmetic; then both take an SGD step.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from deep_ep.utils.spawn import spawn_ranks

HIDDEN, FFN, NUM_EXPERTS, NUM_TOPK = 1024, 256, 8, 2
SEQ, BATCH, STEPS, LR = 64, 2, 3, 2e-3


def _megatron_has_deepepv2() -> bool:
    """Whether megatron-core is installed and its fused_a2a module found deep_ep's ElasticBuffer."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return False
    try:
        from megatron.core.transformer.moe import fused_a2a
    except Exception:
        return False
    return getattr(fused_a2a, "deepepv2_dispatch", None) is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _bf16_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 3e-2) -> float:
    """Max error relative to the largest expected element; BF16 weights and activations on one side."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = float(expected.abs().max())
    assert scale > 0, f"{what}: expected all zeros"
    error = float((actual - expected).abs().max()) / scale
    assert error <= rtol, f"{what}: max error {error:.3e} of the largest element ({scale:.3e}) > {rtol}"
    return error


def _dense_moe(x: torch.Tensor, router: torch.Tensor, fc1: list, fc2: list, routing_map: torch.Tensor) -> torch.Tensor:
    """`[T, H]` FP32: Megatron's top-k softmax router (softmax over the top-k logits), gelu MLP experts.

    The experts of each token are Megatron's (`routing_map` `[T, E]`, from its router on the same
    batches), so that a near-tie cannot be broken differently; they must be a top-k of these logits.
    """
    logits = x @ router.t()
    top_idx = routing_map.nonzero()[:, 1].view(-1, NUM_TOPK)
    scores = logits.gather(1, top_idx)
    others = logits.detach().masked_fill(routing_map, float("-inf")).amax(dim=1)
    assert bool((others <= scores.detach().amin(dim=1) + 1e-3).all()), "Megatron's experts are not a top-k"
    probs = torch.softmax(scores, dim=-1)
    out = torch.zeros_like(x)
    for e in range(NUM_EXPERTS):
        rows, lanes = (top_idx == e).nonzero(as_tuple=True)
        expert_out = F.gelu(x[rows] @ fc1[e].t()) @ fc2[e].t()
        out = out.index_add(0, rows, expert_out * probs[rows, lanes].unsqueeze(1))
    return out


def _megatron_e2e_worker(rank: int, num_ranks: int, seed: int) -> list[float]:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=num_ranks)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, num_moe_experts=NUM_EXPERTS,
        moe_router_topk=NUM_TOPK, moe_ffn_hidden_size=FFN, moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="deepepv2", moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, expert_model_parallel_size=num_ranks, add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, moe_grouped_gemm=False,
    )  # fmt: skip
    layer = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)(config=config)
    layer = layer.to(device)
    layer.train()
    num_local = NUM_EXPERTS // num_ranks
    experts = layer.experts.local_experts
    assert len(experts) == num_local
    assert type(layer.token_dispatcher._comm_manager).__name__ == "_DeepepV2Manager"

    # Our weights, the same on every rank (each rank keeps its own experts)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn((NUM_EXPERTS, HIDDEN), generator=gen) / HIDDEN**0.5)
        for e in range(NUM_EXPERTS):
            fc1 = torch.randn((FFN, HIDDEN), generator=gen) / HIDDEN**0.5
            fc2 = torch.randn((HIDDEN, FFN), generator=gen) / FFN**0.5
            if e // num_local == rank:
                experts[e % num_local].linear_fc1.weight.copy_(fc1)
                experts[e % num_local].linear_fc2.weight.copy_(fc2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR)

    # One batch, trained on for a few steps: the loss `<y, probe> / tokens` must go down
    xs = [torch.randn((SEQ, BATCH, HIDDEN), generator=gen).to(torch.bfloat16) for _ in range(num_ranks)]
    probes = [torch.randn((SEQ, BATCH, HIDDEN), generator=gen) / (SEQ * BATCH * num_ranks) for _ in range(num_ranks)]
    losses = []
    for step in range(STEPS):
        # Megatron: this rank's tokens
        x = xs[rank].to(device).clone().requires_grad_()
        out, _ = layer(x)
        loss = (out.float() * probes[rank].to(device)).sum()
        loss.backward()
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        router_grad = layer.router.weight.grad.float().clone()
        dist.all_reduce(router_grad)

        # Dense: every rank's tokens, the layer's current weights (experts gathered from their ranks)
        fc1_all, fc2_all = [], []
        for i in range(num_local):
            for name, store in (("linear_fc1", fc1_all), ("linear_fc2", fc2_all)):
                local = getattr(experts[i], name).weight.detach().float().contiguous()
                gathered = [torch.empty_like(local) for _ in range(num_ranks)]
                dist.all_gather(gathered, local)
                store.append(gathered)
        fc1 = [fc1_all[e % num_local][e // num_local].clone().requires_grad_() for e in range(NUM_EXPERTS)]
        fc2 = [fc2_all[e % num_local][e // num_local].clone().requires_grad_() for e in range(NUM_EXPERTS)]
        router = layer.router.weight.detach().float().clone().requires_grad_()
        dense_x = torch.cat([t.reshape(-1, HIDDEN) for t in xs]).float().to(device).detach().requires_grad_()
        with torch.no_grad():  # Megatron's routing of every rank's batch (the same bits as on that rank)
            routing_map = torch.cat([layer.router(t.to(device))[1].reshape(-1, NUM_EXPERTS) for t in xs])
        dense_out = _dense_moe(dense_x, router, fc1, fc2, routing_map.bool())
        dense_loss = (dense_out * torch.cat([p.reshape(-1, HIDDEN) for p in probes]).to(device)).sum()
        dense_loss.backward()

        what = f"step {step} rank {rank} seed {seed}"
        tokens = slice(rank * SEQ * BATCH, (rank + 1) * SEQ * BATCH)
        magnitude = float(
            (dense_out.detach() * torch.cat([p.reshape(-1, HIDDEN) for p in probes]).to(device)).abs().sum()
        )
        dense_value = float(dense_loss.detach())
        assert abs(float(total_loss) - dense_value) <= 1e-2 * magnitude, (
            f"{what}: loss {float(total_loss)} vs dense {dense_value} (scale {magnitude:.3e})"
        )
        _bf16_close(out.reshape(-1, HIDDEN), dense_out[tokens], f"{what}: output")
        _bf16_close(x.grad.reshape(-1, HIDDEN), dense_x.grad[tokens], f"{what}: input gradient")
        _bf16_close(router_grad, router.grad, f"{what}: router gradient", rtol=5e-2)
        for i in range(num_local):
            e = rank * num_local + i
            _bf16_close(experts[i].linear_fc1.weight.grad, fc1[e].grad, f"{what}: expert {e} fc1 gradient", rtol=5e-2)
            _bf16_close(experts[i].linear_fc2.weight.grad, fc2[e].grad, f"{what}: expert {e} fc2 gradient", rtol=5e-2)
        # The router is replicated: apply the summed gradient on every rank (what DDP would do)
        layer.router.weight.grad.copy_(router_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total_loss))
    parallel_state.destroy_model_parallel()
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), f"rank {rank}: losses {losses}"
    return losses


@pytest.mark.skipif(
    not _megatron_has_deepepv2(),
    reason="needs megatron-core with moe_flex_dispatcher_backend='deepepv2' (Megatron-LM dev branch; not on PyPI)",
)
def test_megatron_moe_layer_deepepv2_trains_like_dense() -> None:
    seed = int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))
    losses = spawn_ranks(_megatron_e2e_worker, 2, backend="nccl", args=(seed,), timeout_s=600)
    assert losses[0] == losses[1]
    print(f"\nmegatron e2e: MoELayer(flex, deepepv2) on deep_ep, {STEPS} SGD steps, losses {losses[0]}, seed {seed}")
