"""Where the reference backend's tokens go: the send layout (from `topk_idx` alone) and the receive
layout (from what arrived), as plain torch ops.

Notation as in `deep_ep.backends.base`. Rows arrive grouped by source rank ascending and, inside a
group, in source token order, which is what makes the layouts column-wise scans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deep_ep.host_reads import host_list


@dataclass
class SendLayout:
    """Where this rank's tokens go (computed from `topk_idx` alone).

    Attributes:
        dst_rank: `[T, K]` int64, the destination rank of each lane, `-1` for masked lanes.
        send_counts: tokens sent to each rank, `[N]` host ints.
        send_token_idx: `[sum(send_counts)]` int64, token indices grouped by destination rank
            ascending, in token order inside a group (the order the destination stores them).
        dst_buffer_slot_idx: `[T, K]` int32, DeepEP V2's: `rank * Tmax + slot` (the token's slot at the
            destination) on the token's highest lane to each destination rank, `-1` on its other lanes
            there and on `-1` lanes.
    """

    dst_rank: torch.Tensor
    send_counts: list[int]
    send_token_idx: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor


@dataclass
class RecvLayout:
    """What this rank received and where each (token, local expert) pair goes in the expanded layout.

    Attributes:
        recv_counts: rows received from each source rank, `[N]` host ints.
        num_recv_tokens: `R = sum(recv_counts)`.
        src_rank: `[R]` int64, the source rank of each row.
        src_token_idx: `[R]` int64, the token index at the source.
        local_expert_idx: `[R, K]` int64, the local expert of each lane or `-1`.
        expanded_row: `[R, K]` int64, the expanded row of each local lane or `-1`.
        counts: `[L]` int64, (token, lane) pairs per local expert.
        aligned_counts: `[L]` int64, `align(counts, a)`.
    """

    recv_counts: list[int]
    num_recv_tokens: int
    src_rank: torch.Tensor
    src_token_idx: torch.Tensor
    local_expert_idx: torch.Tensor
    expanded_row: torch.Tensor
    counts: torch.Tensor
    aligned_counts: torch.Tensor


def compute_send_layout(
    topk_idx: torch.Tensor, num_ranks: int, num_local_experts: int, rank: int, num_max_tokens_per_rank: int
) -> SendLayout:
    """Compute where each token goes from rank `rank`: a column-wise scan over the `[T, N]` hit matrix."""
    num_tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    dst_rank = torch.where(valid, topk_idx // num_local_experts, -1)
    hit = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, torch.where(valid, dst_rank, num_ranks), True)
    hit = hit[:, :num_ranks]
    slot = hit.long().cumsum(dim=0) - 1
    # The master lane of a destination is the token's highest lane to it: no later lane goes there
    later_same = torch.triu(dst_rank.unsqueeze(2) == dst_rank.unsqueeze(1), diagonal=1).any(dim=2)
    master = valid & ~later_same
    in_buffer = rank * num_max_tokens_per_rank + slot.gather(1, dst_rank.clamp(min=0))
    dst_buffer_slot_idx = torch.where(master, in_buffer, -1).to(torch.int32)
    send_token_idx = hit.t().nonzero()[:, 1]
    return SendLayout(
        dst_rank=dst_rank,
        send_counts=host_list(hit.sum(dim=0)),
        send_token_idx=send_token_idx,
        dst_buffer_slot_idx=dst_buffer_slot_idx.contiguous(),
    )


def compute_recv_layout(
    recv_counts: list[int],
    src_token_idx: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    rank_idx: int,
    num_local_experts: int,
    expert_alignment: int,
) -> RecvLayout:
    """Compute local expert ids, per-expert counts and the expanded row of every local lane."""
    device = recv_topk_idx.device
    num_recv_tokens = sum(recv_counts)
    num_ranks = len(recv_counts)
    src_rank = torch.repeat_interleave(
        torch.arange(num_ranks, device=device), torch.tensor(recv_counts, dtype=torch.int64, device=device)
    )
    first_expert = rank_idx * num_local_experts
    local = (recv_topk_idx >= first_expert) & (recv_topk_idx < first_expert + num_local_experts)
    local_expert_idx = torch.where(local, recv_topk_idx - first_expert, -1)

    # Rows are in (source rank, source token) order, so a column-wise scan ranks them inside each expert
    expert_hit = torch.zeros((num_recv_tokens, num_local_experts + 1), dtype=torch.bool, device=device)
    expert_hit.scatter_(1, torch.where(local, local_expert_idx, num_local_experts), True)
    expert_hit = expert_hit[:, :num_local_experts]
    counts = expert_hit.sum(dim=0)
    aligned_counts = (counts + expert_alignment - 1) // expert_alignment * expert_alignment
    offsets = aligned_counts.cumsum(dim=0) - aligned_counts
    position = expert_hit.long().cumsum(dim=0) - 1
    safe_idx = local_expert_idx.clamp(min=0)
    expanded_row = torch.where(local, offsets[safe_idx] + position.gather(1, safe_idx), -1)
    return RecvLayout(
        recv_counts=list(recv_counts),
        num_recv_tokens=num_recv_tokens,
        src_rank=src_rank,
        src_token_idx=src_token_idx,
        local_expert_idx=local_expert_idx,
        expanded_row=expanded_row,
        counts=counts,
        aligned_counts=aligned_counts,
    )


def send_offset(send_counts: list[int], rank: int) -> int:
    """The first index of `rank`'s group in `SendLayout.send_token_idx`."""
    return sum(send_counts[:rank])
