"""The torch path a user writes without this library: index, exchange counts, `all_to_all_single`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def torch_dispatch(x: Any, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup):
    """Send every token once to each rank owning one of its experts; returns the received tensors and
    what combine needs (the send order and both split lists)."""
    num_ranks = group.size()
    owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // num_ranks), -1)
    hits = torch.stack([(owner == d).any(dim=1) for d in range(num_ranks)])  # [N, T]
    send_idx = torch.cat([hits[d].nonzero().squeeze(1) for d in range(num_ranks)])
    send_counts = hits.sum(dim=1).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    tensors = x if isinstance(x, tuple) else (x,)
    received = []
    for tensor in tensors:
        payload = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
        out = payload.new_empty((sum(recv_splits), *payload.shape[1:]))
        dist.all_to_all_single(out, payload[send_idx].contiguous(), recv_splits, send_splits, group=group)
        received.append(out)
    return received, send_idx, send_splits, recv_splits


def torch_combine(y: torch.Tensor, send_idx: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                  num_tokens: int, group: dist.ProcessGroup) -> torch.Tensor:  # fmt: skip
    """The reverse: `all_to_all_single` the rows back, then sum them per token in FP32."""
    back = y.new_empty((sum(send_splits), y.shape[1]))
    dist.all_to_all_single(back, y, send_splits, recv_splits, group=group)
    combined = torch.zeros((num_tokens, y.shape[1]), dtype=torch.float32, device=y.device)
    combined.index_add_(0, send_idx, back.float())
    return combined.to(torch.bfloat16)
