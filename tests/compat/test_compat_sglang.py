"""SGLang's DeepEP V2 dispatcher (`--moe-a2a-backend deepep_v2`) calls on deep_ep.

Pattern source: sgl-project/sglang at commit 56bb770f94, `python/sglang/srt/layers/moe/token_dispatcher/
deepep_v2.py` (`DeepEPV2Buffer.get_buffer`, `_DeepEPV2Impl.dispatch_a/dispatch_b/combine_a/combine_b`,
`DeepEPV2Dispatcher`):
- buffer: `ElasticBuffer(group, num_max_tokens_per_rank=SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK,
  hidden=..., num_topk=..., use_fp8_dispatch=..., allow_hybrid_mode=(--deepep-v2-mode == "hybrid"),
  sl_idx=0, prefer_overlap_with_compute=False)`, logging `buffer.num_bytes`;
- SMs and QPs: `get_theoretical_num_sms(num_experts, router_topk)` (positional) and
  `get_theoretical_num_qps(num_sms)`, passed to every dispatch and combine;
- extend (prefill): `do_expand=False, do_cpu_sync=True`, `expert_alignment` of the runner, FP8 with
  UE8M0 scales in the TMA-aligned column-major layout (`use_tma_aligned_col_major_sf=True`); the receiver
  slices `int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())` rows and reads
  `list(handle.num_recv_tokens_per_expert_list)`; an empty local batch is padded to one dummy token
  routed to experts `0..K-1` with zero weights, and its combined row is dropped;
- decode (masked GEMM): `do_expand=True, do_cpu_sync=False`, blocks found from
  `handle.psum_num_recv_tokens_per_expert`, weights applied before combine, FP32 row-major scales;
- `combine(hidden_states, handle=..., topk_weights=..., num_sms=..., num_qps=...)`; both halves wait with
  `if event.event is not None: event.current_stream_wait()`; two-batch overlap runs `dispatch_a` of one
  batch before `dispatch_b` of the other.

The calls are the ones that file makes, with the same keywords, written for this test; the expert
side is a toy (per-expert channel scaling) computed here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from compat_helpers import (
    BACKENDS,
    RankInputs,
    assert_equal,
    check_backend,
    dequantize,
    device_of_group,
    expected_moe,
    make_diag,
    make_fp8,
    make_inputs,
    run_pattern,
    tma_col_major,
)

import deep_ep
from deep_ep.utils.math import align

EXPERT_ALIGNMENT = 128  # DeepGEMM's block (the runner capability's `expert_alignment`)


def _get_buffer(shape: dict[str, int], use_fp8_dispatch: bool) -> deep_ep.ElasticBuffer:
    """`DeepEPV2Buffer.get_buffer` (direct mode: `allow_hybrid_mode=False`)."""
    buffer = deep_ep.ElasticBuffer(
        dist.group.WORLD,
        num_max_tokens_per_rank=shape["num_max_tokens"],
        hidden=shape["hidden"],
        num_topk=shape["num_topk"],
        use_fp8_dispatch=use_fp8_dispatch,
        allow_hybrid_mode=False,
        sl_idx=0,
        prefer_overlap_with_compute=False,
    )
    assert buffer.num_bytes > 0
    return buffer


def _sms_and_qps(buffer: deep_ep.ElasticBuffer, shape: dict[str, int]) -> tuple[int, int]:
    num_sms = buffer.get_theoretical_num_sms(shape["num_experts"], shape["num_topk"])
    return num_sms, buffer.get_theoretical_num_qps(num_sms)


def _extend_worker(rank: int, num_ranks: int, seed: int, backend: str, shape: dict[str, int], fp8: bool) -> int:
    device = device_of_group()
    hidden, num_experts, num_topk, cap = (
        shape["hidden"],
        shape["num_experts"],
        shape["num_topk"],
        shape["num_max_tokens"],
    )
    num_local = num_experts // num_ranks
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, cap + 1, (num_ranks,), generator=gen).tolist()
    counts[num_ranks - 1] = 0  # an idle DP rank
    inputs = make_inputs(gen, counts, hidden, num_experts, num_topk)
    fp8_inputs = [make_fp8(gen, n, hidden, ue8m0=True) for n in counts]
    diag = make_diag(gen, num_experts, hidden)
    buffer = _get_buffer(shape, use_fp8_dispatch=fp8)
    check_backend(buffer, backend)
    num_sms, num_qps = _sms_and_qps(buffer, shape)

    # dispatch_a: an empty local batch becomes one dummy token (experts 0..K-1, zero weights)
    mine = inputs[rank]
    topk_ids, topk_weights = mine.topk_idx, mine.topk_weights
    data, scales = fp8_inputs[rank]
    hidden_states = mine.x
    pad_empty = hidden_states.shape[0] == 0
    if pad_empty:
        hidden_states = torch.zeros((1, hidden), dtype=torch.bfloat16)
        topk_ids = torch.arange(num_topk, dtype=torch.int64).unsqueeze(0)
        topk_weights = torch.zeros((1, num_topk), dtype=torch.float32)
        data = torch.zeros((1, hidden)).to(torch.float8_e4m3fn)
        scales = torch.full((1, scales.shape[1]), 0x7F7F7F7F, dtype=torch.int32)  # every block scale 2^0
    dispatch_x = (data.to(device), tma_col_major(scales.to(device))) if fp8 else hidden_states.to(device)
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        dispatch_x, topk_idx=topk_ids.to(torch.int64).to(device), topk_weights=topk_weights.to(device),
        num_experts=num_experts, num_max_tokens_per_rank=cap, expert_alignment=EXPERT_ALIGNMENT, num_sms=num_sms,
        num_qps=num_qps, use_tma_aligned_col_major_sf=fp8, do_cpu_sync=True, do_expand=False,
    )  # fmt: skip

    # dispatch_b
    if event.event is not None:
        event.current_stream_wait()
    recv_hidden_states, recv_scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    num_recv_tokens = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
    recv_topk_idx = recv_topk_idx[:num_recv_tokens]
    recv_topk_weights = recv_topk_weights[:num_recv_tokens]
    recv_hidden_states = recv_hidden_states[:num_recv_tokens]
    if recv_scales is not None:
        rows = recv_scales.shape[0]
        assert recv_scales.stride() == (1, align(rows, 4)), (
            f"TMA-aligned column-major scales, got {recv_scales.stride()}"
        )
        recv_scales = recv_scales[:num_recv_tokens]
    num_recv_tokens_per_expert = list(handle.num_recv_tokens_per_expert_list)
    counts_per_expert = torch.bincount(recv_topk_idx[recv_topk_idx >= 0].cpu(), minlength=num_local)
    assert num_recv_tokens_per_expert == [align(int(c), EXPERT_ALIGNMENT) for c in counts_per_expert]

    # Runner: each received token's weighted local experts (lanes of other ranks are -1)
    expert_x = dequantize(recv_hidden_states, recv_scales) if fp8 else recv_hidden_states.float()
    local_diag = diag.to(device)[rank * num_local : (rank + 1) * num_local]
    lane_out = expert_x.unsqueeze(1) * local_diag[recv_topk_idx.clamp(min=0)]
    lane_out = torch.where(recv_topk_idx.unsqueeze(2) >= 0, lane_out, 0.0)
    out = (lane_out * recv_topk_weights.unsqueeze(2)).sum(dim=1).to(torch.bfloat16)

    # combine_a / combine_b
    combined_x, _, event = buffer.combine(
        out, handle=handle, topk_weights=recv_topk_weights, num_sms=num_sms, num_qps=num_qps
    )
    if event.event is not None:
        event.current_stream_wait()
    if pad_empty:
        combined_x = combined_x[:0]
        assert combined_x.shape == (0, hidden)
        return 0
    source_x = dequantize(*fp8_inputs[rank]) if fp8 else mine.x.float()
    assert_equal(combined_x, expected_moe(source_x, mine, diag), f"rank {rank}: extend output")
    return num_recv_tokens


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-ue8m0-colmajor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_deepep_v2_extend(backend: str, fp8: bool) -> None:
    """SGLang 56bb770f94 `token_dispatcher/deepep_v2.py`, extend path, with an idle (padded) rank."""
    run_pattern(_extend_worker, backend, (fp8,))


def _decode_rows(
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    recv_topk_weights: torch.Tensor,
    handle: deep_ep.EPHandle,
    local_diag: torch.Tensor,
) -> torch.Tensor:
    """Masked-GEMM stand-in over the expanded layout: block `e` is `[align(psum[e-1]), psum[e])`."""
    expert_x = dequantize(*recv_x) if isinstance(recv_x, tuple) else recv_x.float()
    psum = handle.psum_num_recv_tokens_per_expert.tolist()
    out = torch.zeros_like(expert_x)
    for e, end in enumerate(psum):
        start = 0 if e == 0 else align(psum[e - 1], EXPERT_ALIGNMENT)
        out[start:end] = expert_x[start:end] * local_diag[e] * recv_topk_weights[start:end].unsqueeze(1)
    return out.to(torch.bfloat16)


def _decode_tbo_worker(rank: int, num_ranks: int, seed: int, backend: str, shape: dict[str, int]) -> int:
    device = device_of_group()
    hidden, num_experts, num_topk, cap = (
        shape["hidden"],
        shape["num_experts"],
        shape["num_topk"],
        shape["num_max_tokens"],
    )
    num_local = num_experts // num_ranks
    gen = torch.Generator().manual_seed(seed)
    diag = make_diag(gen, num_experts, hidden)
    local_diag = diag.to(device)[rank * num_local : (rank + 1) * num_local]
    buffer = _get_buffer(shape, use_fp8_dispatch=True)
    check_backend(buffer, backend)
    num_sms, num_qps = _sms_and_qps(buffer, shape)

    # Two-batch overlap: dispatch_a(A), dispatch_a(B), then dispatch_b / compute / combine of each
    batches: list[tuple[RankInputs, tuple, torch.Tensor]] = []
    for batch in range(2):
        counts = torch.randint(0, cap + 1, (num_ranks,), generator=gen).tolist()
        mine = make_inputs(gen, counts, hidden, num_experts, num_topk)[rank]
        data, scales = make_fp8(gen, counts[rank], hidden, ue8m0=False)
        use_fp8 = batch == 1  # plain row-major FP32 scales on the masked path
        dispatch_x = (data.to(device), scales.to(device)) if use_fp8 else mine.x.to(device)
        outputs = buffer.dispatch(
            dispatch_x, topk_idx=mine.topk_idx.to(device), topk_weights=mine.topk_weights.to(device),
            num_experts=num_experts, num_max_tokens_per_rank=cap, expert_alignment=EXPERT_ALIGNMENT,
            num_sms=num_sms, num_qps=num_qps, use_tma_aligned_col_major_sf=False, do_cpu_sync=False, do_expand=True,
        )  # fmt: skip
        batches.append((mine, outputs, dequantize(data, scales) if use_fp8 else mine.x.float()))
    total = 0
    for batch, (mine, (recv_x, recv_topk_idx, recv_topk_weights, handle, event), source_x) in enumerate(batches):
        if event.event is not None:
            event.current_stream_wait()
        assert recv_topk_idx is None
        total_expanded = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
        assert total_expanded == handle.num_expanded_tokens and handle.num_recv_tokens_per_expert_list == []
        out = _decode_rows(recv_x, recv_topk_weights, handle, local_diag)
        combined_x, combined_weights, event = buffer.combine(
            out, handle=handle, topk_weights=recv_topk_weights, num_sms=num_sms, num_qps=num_qps
        )
        if event.event is not None:
            event.current_stream_wait()
        assert_equal(combined_x, expected_moe(source_x, mine, diag), f"rank {rank} batch {batch}: decode output")
        assert_equal(combined_weights, mine.topk_weights.double(), f"rank {rank} batch {batch}: combined weights")
        total += int(handle.psum_num_recv_tokens_per_expert[-1])
    return total


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_deepep_v2_masked_decode_two_batch_overlap(backend: str) -> None:
    """SGLang 56bb770f94 `token_dispatcher/deepep_v2.py`, masked decode path, two batches in flight."""
    run_pattern(_decode_tbo_worker, backend)
