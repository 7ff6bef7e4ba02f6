"""vLLM's `deepep_v2` all-to-all backend (`--all2all-backend deepep_v2`) calls on deep_ep.

Pattern source: vllm-project/vllm at commit a7fc96c0a6 (stored version of
`vllm/model_executor/layers/fused_moe/prepare_finalize/deepep_v2.py`, `DeepEPV2PrepareAndFinalize`),
with the buffer made by `DeepEPV2All2AllManager` in `vllm/distributed/device_communicators/all2all.py`
(the backend came with vLLM PR #41183). The manager builds `ElasticBuffer(group=..., num_max_tokens_per_rank,
hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode=VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE,
prefer_overlap_with_compute=VLLM_DEEPEP_V2_PREFER_OVERLAP, allow_multiple_reduction=
VLLM_DEEPEP_V2_ALLOW_MULTIPLE_REDUCTION (default False), explicitly_destroy=True)`, asks
`get_theoretical_num_sms(num_experts=..., num_topk=...)` and calls `destroy()` on shutdown.

prepare: prefill (eager) dispatches `do_expand=True, do_cpu_sync=True` and rebuilds per-row expert ids
from `handle.num_recv_tokens_per_expert_list`; decode (CUDA graphs) dispatches `do_expand=False,
do_cpu_sync=False` with `num_max_tokens_per_rank` = the next power of two of the largest DP batch and
turns `recv_topk_idx` into global ids, `-1` for other ranks' lanes and for rows at or past
`handle.psum_num_recv_tokens_per_scaleup_rank[-1]`. Both wait with `if event.event is not None:
event.current_stream_wait()`. finalize: weight-and-reduce on the expert side, then
`combine(x=..., handle=..., topk_weights=None, async_with_compute_stream=False)`. DBO keeps one handle
per micro-batch (`self.handles[ubatch_id]`). FP8 block-quantized activations travel as `(data, FP32 scales)`.

The calls are the ones that file makes, with the same keywords, written for this test; the expert
side is a toy (per-expert channel scaling) computed here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from compat_helpers import (
    BACKENDS,
    assert_equal,
    check_backend,
    dequantize,
    device_of_group,
    expected_moe,
    make_diag,
    make_fp8,
    make_inputs,
    run_pattern,
)

import deep_ep


def _make_buffer(shape: dict[str, int], use_fp8_dispatch: bool) -> tuple[deep_ep.ElasticBuffer, int]:
    """`DeepEPV2All2AllManager.get_handle`: the buffer and its SM count."""
    buffer = deep_ep.ElasticBuffer(
        group=dist.group.WORLD,
        num_max_tokens_per_rank=shape["num_max_tokens"],
        hidden=shape["hidden"],
        num_topk=shape["num_topk"],
        use_fp8_dispatch=use_fp8_dispatch,
        allow_hybrid_mode=True,
        prefer_overlap_with_compute=False,
        allow_multiple_reduction=False,
        explicitly_destroy=True,
    )
    num_sms = buffer.get_theoretical_num_sms(num_experts=shape["num_experts"], num_topk=shape["num_topk"])
    assert num_sms > 0
    return buffer, num_sms


def _prefill_rows(
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    recv_topk_weights: torch.Tensor,
    counts: list[int],
    rank_expert_offset: int,
    diag: torch.Tensor,
) -> torch.Tensor:
    """Receiver + experts + TopKWeightAndReduceContiguous for the expanded layout: `[rows, H]` BF16."""
    expert_x = dequantize(*recv_x) if isinstance(recv_x, tuple) else recv_x.float()
    total = sum(counts)
    topk_ids = torch.empty(total, dtype=torch.int64, device=expert_x.device)
    offset = 0
    for i, count in enumerate(counts):
        topk_ids[offset : offset + count] = i + rank_expert_offset
        offset += count
    topk_ids = topk_ids.unsqueeze(1)
    weights = recv_topk_weights.unsqueeze(1)
    fused = expert_x.unsqueeze(1) * diag.to(expert_x.device)[topk_ids]  # [rows, 1, H]
    return (fused * weights.unsqueeze(2)).sum(dim=1).to(torch.bfloat16)


def _vllm_prefill_worker(rank: int, num_ranks: int, seed: int, backend: str, shape: dict[str, int], fp8: bool) -> int:
    device = device_of_group()
    hidden, num_experts, num_topk = shape["hidden"], shape["num_experts"], shape["num_topk"]
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, shape["num_max_tokens"] + 1, (num_ranks,), generator=gen).tolist()
    inputs = make_inputs(gen, counts, hidden, num_experts, num_topk)
    diag = make_diag(gen, num_experts, hidden)
    fp8_inputs = [make_fp8(gen, n, hidden, ue8m0=False) for n in counts]
    mine = inputs[rank]
    buffer, _ = _make_buffer(shape, use_fp8_dispatch=fp8)
    check_backend(buffer, backend)
    rank_expert_offset = rank * (num_experts // num_ranks)
    try:
        handles: list[deep_ep.EPHandle | None] = [None, None]
        receivers, sources = [], []
        # DBO: two micro-batches (halves of the batch) dispatched before either is finalized
        for ubatch, part in enumerate((slice(0, counts[rank] // 2), slice(counts[rank] // 2, counts[rank]))):
            if fp8:
                data, scales = fp8_inputs[rank]
                token_data = (data[part].contiguous().to(device), scales[part].contiguous().to(device))
                source_x = dequantize(data[part], scales[part])
            else:
                token_data = mine.x[part].contiguous().to(device)
                source_x = mine.x[part].float()
            recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
                x=token_data, topk_idx=mine.topk_idx[part].contiguous().to(device),
                topk_weights=mine.topk_weights[part].contiguous().to(device), num_experts=num_experts,
                num_max_tokens_per_rank=None, do_expand=True, do_cpu_sync=True, async_with_compute_stream=False,
            )  # fmt: skip
            handles[ubatch] = handle
            assert recv_topk_idx is None and recv_topk_weights.dim() == 1
            receivers.append((event, recv_x, recv_topk_weights, handle.num_recv_tokens_per_expert_list))
            sources.append((source_x, part))
        total_rows = 0
        for ubatch in range(2):
            event, recv_x, recv_topk_weights, expert_counts = receivers[ubatch]
            if event.event is not None:
                event.current_stream_wait()
            fused = _prefill_rows(recv_x, recv_topk_weights, expert_counts, rank_expert_offset, diag)
            total_rows += fused.shape[0]
            output = torch.empty((handles[ubatch].num_tokens, hidden), dtype=torch.bfloat16, device=device)
            combined_x, _, _ = buffer.combine(
                x=fused, handle=handles[ubatch], topk_weights=None, async_with_compute_stream=False
            )
            output.copy_(combined_x, non_blocking=True)
            source_x, part = sources[ubatch]
            routing = type(mine)(mine.x[part], mine.topk_idx[part], mine.topk_weights[part])
            assert_equal(output, expected_moe(source_x, routing, diag), f"rank {rank} ubatch {ubatch}: output")
    finally:
        buffer.destroy()
    return total_rows


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_deepep_v2_prefill_with_dbo(backend: str, fp8: bool) -> None:
    """vLLM a7fc96c0a6 `prepare_finalize/deepep_v2.py`, eager path (`use_cudagraph=False`), two DBO handles."""
    run_pattern(_vllm_prefill_worker, backend, (fp8,))


def _vllm_decode_worker(rank: int, num_ranks: int, seed: int, backend: str, shape: dict[str, int]) -> int:
    device = device_of_group()
    hidden, num_experts, num_topk = shape["hidden"], shape["num_experts"], shape["num_topk"]
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, shape["num_max_tokens"] // 2 + 1, (num_ranks,), generator=gen).tolist()
    inputs = make_inputs(gen, counts, hidden, num_experts, num_topk)
    diag = make_diag(gen, num_experts, hidden)
    mine = inputs[rank]
    buffer, _ = _make_buffer(shape, use_fp8_dispatch=False)
    check_backend(buffer, backend)
    rank_expert_offset = rank * (num_experts // num_ranks)
    try:
        # num_max_tokens_per_rank: the next power of two of the largest DP batch (the same on all ranks)
        largest = max(counts)
        num_max_tokens_per_rank = 1 << max(largest - 1, 0).bit_length()
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            x=mine.x.to(device), topk_idx=mine.topk_idx.to(device), topk_weights=mine.topk_weights.to(device),
            num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank, do_expand=False,
            do_cpu_sync=False, async_with_compute_stream=False,
        )  # fmt: skip
        assert recv_x.shape[0] == num_ranks * num_max_tokens_per_rank, "worst-case rows without CPU sync"
        if event.event is not None:
            event.current_stream_wait()

        # _globalize_recv_topk_idx: global ids for local lanes of real rows, -1 elsewhere
        psum_recv_per_rank = handle.psum_num_recv_tokens_per_scaleup_rank
        num_recv = psum_recv_per_rank[psum_recv_per_rank.shape[0] - 1]
        rows = torch.arange(recv_topk_idx.shape[0], device=device).unsqueeze(1)
        global_ids = recv_topk_idx + rank_expert_offset
        valid = (recv_topk_idx >= 0) & (global_ids < num_experts) & (rows < num_recv)
        topk_ids = torch.where(valid, global_ids, -1)
        expected_rows = sum(
            int(((inputs[r].topk_idx // (num_experts // num_ranks)) == rank).any(dim=1).sum()) for r in range(num_ranks)
        )
        assert int(num_recv) == expected_rows, "psum_num_recv_tokens_per_scaleup_rank[-1]"

        # Experts (standard format, [M, K, H]; -1 lanes give zeros), weight-and-reduce over the lanes.
        # Rows past num_recv are garbage in vLLM: make them NaN, combine must not read them.
        per_lane = recv_x.float().unsqueeze(1) * diag.to(device)[topk_ids.clamp(min=0)]
        per_lane = torch.where(topk_ids.unsqueeze(2) >= 0, per_lane, 0.0)
        fused = (per_lane * recv_topk_weights.unsqueeze(2)).sum(dim=1).to(torch.bfloat16)
        fused[rows.squeeze(1) >= num_recv] = float("nan")
        combined_x, _, _ = buffer.combine(x=fused, handle=handle, topk_weights=None, async_with_compute_stream=False)
        output = torch.empty_like(combined_x).copy_(combined_x, non_blocking=True)
        assert_equal(output, expected_moe(mine.x, mine, diag), f"rank {rank}: decode output")
    finally:
        buffer.destroy()
    return int(num_recv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_deepep_v2_decode_cudagraph_mode(backend: str) -> None:
    """vLLM a7fc96c0a6 `prepare_finalize/deepep_v2.py`, CUDA-graph path (`use_cudagraph=True`)."""
    run_pattern(_vllm_decode_worker, backend)
