"""Megatron-Core's DeepEP V2 flex-dispatcher calls (`moe_flex_dispatcher_backend="deepepv2"`) on deep_ep.

Pattern source: NVIDIA/Megatron-LM, branch `dev` at commit d48bd6be0a85 (2026-08-21, megatron-core
0.19.0 in `megatron/core/package_info.py`; the backend came with PR #4793, commit c049020597):
- `megatron/core/transformer/moe/fused_a2a.py`: `get_elastic_buffer`, `DeepepV2Dispatch`,
  `DeepepV2Combine` (autograd functions: dispatch / combine forward, combine / cached dispatch backward);
- `megatron/core/transformer/moe/token_dispatcher.py`: `_DeepepV2Manager` (top-k of the multihot
  probs, `-1` for zero-probability lanes, FP32 probs, multihot permutation from `recv_topk_idx`,
  `tokens_per_expert` from `handle.num_recv_tokens_per_expert_list`), driven by `MoEFlexTokenDispatcher`
  with `async_finish=True, allocate_on_comm_stream=True`.
No PyPI release has this backend (megatron-core 0.16.1, the newest, offers 'deepep' and 'hybridep').

The calls below are the ones those files make, with the same keywords, written for this test; the
Megatron-side tensor work (multihot, permute, unpermute) is done here with plain torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from compat_helpers import (
    BACKENDS,
    assert_equal,
    check_backend,
    device_of_group,
    expected_moe,
    expected_weight_grads,
    make_diag,
    make_inputs,
    run_pattern,
    signed_ints,
)

import deep_ep


def _megatron_topk(weights: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Megatron's `setup_metadata`: multihot probs `[T, E]` -> `torch.topk` -> `-1` where the prob is 0."""
    probs = torch.zeros((topk_idx.shape[0], num_experts), dtype=torch.float32)
    valid = topk_idx >= 0
    probs[torch.arange(topk_idx.shape[0]).unsqueeze(1).expand_as(topk_idx)[valid], topk_idx[valid]] = weights[valid]
    token_probs, token_indices = torch.topk(probs, topk_idx.shape[1], dim=-1)
    return token_probs, token_indices.masked_fill(token_probs == 0, -1)


def _megatron_worker(rank: int, num_ranks: int, seed: int, backend: str, shape: dict[str, int]) -> int:
    group = dist.group.WORLD
    device = device_of_group()
    hidden, num_experts, num_topk = shape["hidden"], shape["num_experts"], shape["num_topk"]
    num_local = num_experts // num_ranks
    gen = torch.Generator().manual_seed(seed)
    # Megatron passes hidden_states.shape[0] as num_max_tokens_per_rank: the ranks hold equal batches
    num_tokens = int(torch.randint(1, shape["num_max_tokens"] + 1, (1,), generator=gen))
    inputs = make_inputs(gen, [num_tokens] * num_ranks, hidden, num_experts, num_topk)
    diag = make_diag(gen, num_experts, hidden)
    grads = [signed_ints((num_tokens, hidden), gen).to(torch.bfloat16) for _ in range(num_ranks)]
    for item in inputs:  # the routing Megatron derives from its multihot probs
        item.topk_weights, item.topk_idx = _megatron_topk(item.topk_weights, item.topk_idx, num_experts)
    mine = inputs[rank]

    # get_elastic_buffer(): size hint with keywords, then the constructor; reuse test on these attributes
    num_bytes = deep_ep.ElasticBuffer.get_buffer_size_hint(
        group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk
    )
    buffer = deep_ep.ElasticBuffer(
        group, num_bytes=num_bytes, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk
    )
    check_backend(buffer, backend)
    assert buffer.group == group and buffer.num_bytes >= num_bytes and buffer.num_max_tokens_per_rank >= num_tokens

    # DeepepV2Dispatch.forward with async_finish=True, allocate_on_comm_stream=True
    x = mine.x.to(device)
    token_probs = mine.topk_weights.to(device)
    previous_event = buffer.capture()
    recv_x, recv_indices, recv_probs, handle, event = buffer.dispatch(
        x.contiguous(), topk_idx=mine.topk_idx.to(device), topk_weights=token_probs, num_experts=num_experts,
        num_max_tokens_per_rank=x.shape[0], expert_alignment=1, num_sms=0, previous_event=previous_event,
        async_with_compute_stream=True, allocate_on_comm_stream=True,
    )  # fmt: skip
    event.current_stream_wait()
    num_sms = handle.num_sms
    tokens_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list)

    # _DeepepV2Manager: multihot from the local expert ids, permute by expert, run the experts with the
    # probs applied, unpermute (sum back per received token)
    recv_x_leaf = recv_x.float().requires_grad_()
    recv_probs_leaf = recv_probs.requires_grad_()
    valid = recv_indices != -1
    rows, lanes = valid.nonzero(as_tuple=True)
    local_expert = recv_indices[rows, lanes]
    order = torch.argsort(local_expert, stable=True)  # expert-major, token order inside an expert
    rows, lanes, local_expert = rows[order], lanes[order], local_expert[order]
    assert torch.equal(torch.bincount(local_expert.cpu(), minlength=num_local), tokens_per_expert), "tokens_per_expert"
    assert int(tokens_per_expert.sum()) == rows.numel(), "num_out_tokens"
    expert_diag = diag.to(device)[local_expert + rank * num_local]
    permuted_out = recv_x_leaf[rows] * expert_diag * recv_probs_leaf[rows, lanes].unsqueeze(1)
    unpermuted = torch.zeros_like(recv_x_leaf).index_add(0, rows, permuted_out)

    # DeepepV2Combine.forward
    previous_event = buffer.capture()
    combined_x, combined_probs, event = buffer.combine(
        unpermuted.to(torch.bfloat16).contiguous(), handle=handle, num_sms=num_sms, previous_event=previous_event,
        async_with_compute_stream=True, allocate_on_comm_stream=True,
    )  # fmt: skip
    event.current_stream_wait()
    assert combined_probs is None
    assert_equal(combined_x, expected_moe(mine.x, mine, diag), f"rank {rank}: combined hidden states")

    # DeepepV2Combine.backward: a cached dispatch of the output gradient
    previous_event = buffer.capture()
    grad_unpermuted, _, _, _, event = buffer.dispatch(
        grads[rank].to(device).contiguous(), handle=handle, num_sms=num_sms, previous_event=previous_event,
        async_with_compute_stream=True, allocate_on_comm_stream=True,
    )  # fmt: skip
    event.current_stream_wait()
    grad_recv_x, grad_recv_probs = torch.autograd.grad(
        unpermuted, (recv_x_leaf, recv_probs_leaf), grad_outputs=grad_unpermuted.float()
    )

    # DeepepV2Dispatch.backward: combine of the gradients, probs gradient as FP32 top-k weights
    previous_event = buffer.capture()
    grad_x, grad_token_probs, event = buffer.combine(
        grad_recv_x.to(torch.bfloat16).contiguous(), handle=handle, topk_weights=grad_recv_probs.float(),
        num_sms=num_sms, previous_event=previous_event, async_with_compute_stream=True, allocate_on_comm_stream=True,
    )  # fmt: skip
    event.current_stream_wait()
    assert_equal(grad_x, expected_moe(grads[rank], mine, diag), f"rank {rank}: gradient of the hidden states")
    expected_probs_grad = expected_weight_grads(mine.x, grads[rank], mine, diag)
    assert_equal(grad_token_probs, expected_probs_grad, f"rank {rank}: gradient of the token probs")
    return int(tokens_per_expert.sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_megatron_deepepv2_flex_dispatcher_pattern(backend: str) -> None:
    """Megatron-LM dev@d48bd6be0a85 `fused_a2a.py` DeepepV2Dispatch/DeepepV2Combine + `_DeepepV2Manager`."""
    counts = run_pattern(_megatron_worker, backend)
    assert sum(counts) > 0


def _megatron_two_layers_worker(rank: int, num_ranks: int, seed: int, backend: str, shape: dict[str, Any]) -> None:
    """Megatron keeps one handle per layer: two dispatches in flight, combined in reverse order."""
    device = device_of_group()
    hidden, num_experts, num_topk = shape["hidden"], shape["num_experts"], shape["num_topk"]
    gen = torch.Generator().manual_seed(seed)
    num_tokens = shape["num_max_tokens"]
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD,
        num_bytes=deep_ep.ElasticBuffer.get_buffer_size_hint(
            dist.group.WORLD, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk
        ),
        num_max_tokens_per_rank=num_tokens,
        hidden=hidden,
        num_topk=num_topk,
    )
    check_backend(buffer, backend)
    layers = []
    for _ in range(2):
        inputs = make_inputs(gen, [num_tokens] * num_ranks, hidden, num_experts, num_topk)[rank]
        out = buffer.dispatch(
            inputs.x.to(device), topk_idx=inputs.topk_idx.to(device), topk_weights=inputs.topk_weights.to(device),
            num_experts=num_experts, num_max_tokens_per_rank=num_tokens, expert_alignment=1, num_sms=0,
            previous_event=buffer.capture(), async_with_compute_stream=True, allocate_on_comm_stream=True,
        )  # fmt: skip
        layers.append((inputs, out))
    for inputs, (recv_x, recv_indices, _, handle, event) in reversed(layers):
        event.current_stream_wait()
        holders = (recv_indices >= 0).any(dim=1)
        assert bool(holders.all()), "every received token has a local expert"
        combined, _, event = buffer.combine(recv_x, handle=handle, num_sms=handle.num_sms,
                                            previous_event=buffer.capture(), async_with_compute_stream=True,
                                            allocate_on_comm_stream=True)  # fmt: skip
        event.current_stream_wait()
        # Each token comes back once per holder rank
        owners = torch.where(inputs.topk_idx >= 0, inputs.topk_idx // (num_experts // num_ranks), -1)
        num_holders = torch.stack([(owners == r).any(dim=1) for r in range(num_ranks)], dim=1).sum(dim=1)
        assert_equal(combined, inputs.x.double() * num_holders.unsqueeze(1).double(), f"rank {rank}: round trip")


@pytest.mark.parametrize("backend", BACKENDS)
def test_megatron_two_layers_in_flight(backend: str) -> None:
    """Megatron-LM dev@d48bd6be0a85 `token_dispatcher.py`: a handle per layer (`_DeepepV2Manager.handle`)."""
    run_pattern(_megatron_two_layers_worker, backend)
