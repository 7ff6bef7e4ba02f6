"""Shared by the kernel tests (2 GPUs over NCCL, or virtual ranks on one GPU): inputs, and checks of
the kernels' results against `deep_ep.reference`, compared as raw bytes (the sign of zero counts)."""

from __future__ import annotations

from typing import Any

import torch

# Dispatch data kinds. BF16 and FP8 (e4m3) with per-128 FP32 or packed UE8M0 scales are real values;
# the raw kinds are random bytes that the library must move untouched (DeepEP V2: any dtype whose row
# is a multiple of 16 bytes, scales of any pack count and strides): float16, int8, FP8 e5m2 alone,
# packed FP4 (two per uint8) with UE8M0 exponents per 32 elements packed 4 per int32 and given
# column-major, and MXFP8 (e4m3 with one FP32 scale per 32 elements, column-major).
RAW_KINDS = ("f16", "i8", "e5m2", "fp4x2", "mx32")


def row_bytes(kind: str, hidden: int) -> tuple[int, int]:
    """`(data bytes, scale bytes)` of one token of `kind` with `hidden` elements."""
    blocks32 = -(-hidden // 32)
    return {
        "bf16": (2 * hidden, 0), "f16": (2 * hidden, 0), "i8": (hidden, 0), "e5m2": (hidden, 0),
        "fp32": (hidden, 4 * -(-hidden // 128)), "ue8m0": (hidden, 4 * -(-hidden // 512)),
        "fp4x2": (hidden // 2, 4 * -(-blocks32 // 4)), "mx32": (hidden, 4 * blocks32),
    }[kind]  # fmt: skip


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return data.view(dtype)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def make_x(kind: str, num_tokens: int, hidden: int, gen: torch.Generator, device: Any) -> Any:
    """One rank's dispatch `x` of `kind` (see `RAW_KINDS` and `row_bytes`): a tensor or `(data, scales)`."""
    from deep_ep.utils.fp8 import per_token_cast_to_fp8

    if kind in ("bf16", "fp32", "ue8m0"):
        x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
        if kind == "bf16":
            return x.to(device)
        return tuple(t.to(device) for t in per_token_cast_to_fp8(x, use_ue8m0=kind == "ue8m0"))
    dtype = {"f16": torch.float16, "i8": torch.int8, "e5m2": torch.float8_e5m2, "fp4x2": torch.uint8,
             "mx32": torch.float8_e4m3fn}[kind]  # fmt: skip
    data_bytes, scale_bytes = row_bytes(kind, hidden)
    data = _random_bytes((num_tokens, data_bytes // dtype.itemsize), dtype, gen).to(device)
    if kind == "fp4x2":
        scales = _column_major(_random_bytes((num_tokens, scale_bytes // 4), torch.int32, gen)).to(device)
    elif kind == "mx32":
        scales = torch.rand((scale_bytes // 4, num_tokens), generator=gen).to(device).t()  # column-major
    else:
        return data
    return data, scales


def make_inputs(rank: int, num_ranks: int, num_tokens: int, hidden: int, dtype: str, num_experts: int,
                num_topk: int, routing: str, masked: float, num_bias: int, seed: int, device: Any) -> tuple:  # fmt: skip
    """`(x, topk_idx, topk_weights, bias)` of one rank, random with `seed`.

    `dtype`: `'bf16'`, `'fp32'` (FP8 with FP32 per-128 scales), `'ue8m0'` (FP8 with packed UE8M0
    scales) or one of `RAW_KINDS`. `routing`: `'uniform'`, `'hot'` (half the tokens prefer rank 1's experts), `'one'`
    (every token goes to rank 0) or `'none'` (every lane -1). `bias`: `None`, one tensor or a pair.
    """
    from deep_ep.utils.routing import imbalanced_routing, uniform_routing

    gen = torch.Generator().manual_seed(seed * 131 + rank)
    if routing == "hot":
        topk_idx, weights = imbalanced_routing(num_tokens, num_experts, num_topk, num_ranks, hot_rank=1 % num_ranks,
                                               masked_ratio=masked, generator=gen)  # fmt: skip
    elif routing == "one":
        num_local = num_experts // num_ranks
        scores = torch.rand((num_tokens, num_local), generator=gen)
        k = min(num_topk, num_local)
        topk_idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
        topk_idx[:, :k] = torch.topk(scores, k, dim=1).indices
        weights = torch.rand((num_tokens, num_topk), generator=gen).masked_fill(topk_idx < 0, 0.0)
    else:
        topk_idx, weights = uniform_routing(num_tokens, num_experts, num_topk, masked_ratio=masked, generator=gen)
        if routing == "none":
            topk_idx.fill_(-1)
            weights.zero_()
    x = make_x(dtype, num_tokens, hidden, gen, device)
    bias = [torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).to(device) for _ in range(num_bias)]
    bias = None if num_bias == 0 else (bias[0] if num_bias == 1 else tuple(bias))
    return x, topk_idx.to(device), weights.to(device), bias


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` in row-major order (so `-0.0` and `+0.0` differ)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).reshape(-1).view(torch.uint8)


def equal(a: Any, b: Any, what: str) -> None:
    """Raise `AssertionError` unless `a` and `b` (tensors, tuples of them, or `None`) are bitwise equal."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        assert isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b), f"{what}: tuple structure differs"
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            equal(u, v, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (
        f"{what}: {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"
    )
    if not torch.equal(raw(a), raw(b)):
        differ = (raw(a) != raw(b)).nonzero()
        element = int(differ[0]) // a.element_size()
        flat_a, flat_b = (
            torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).reshape(-1) for t in (a, b)
        )
        raise AssertionError(
            f"{what}: {differ.numel()} bytes differ, first at byte {int(differ[0])} (element {element}: "
            f"{flat_a[element].item()} vs {flat_b[element].item()}; {flat_a[:8].tolist()} vs {flat_b[:8].tolist()})"
        )


def real_rows(handle: Any) -> tuple[torch.Tensor, int, int]:
    """Rows of the expanded layout that hold data (not padding), the number of received tokens, and
    the rows the expanded layout uses with its padding."""
    num_recv = (
        int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
        if handle.psum_num_recv_tokens_per_scaleup_rank.numel()
        else 0
    )
    counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
    rows, offset = [], 0
    for count in counts:
        rows += range(offset, offset + count)
        offset += (count + handle.expert_alignment - 1) // handle.expert_alignment * handle.expert_alignment
    device = handle.psum_num_recv_tokens_per_scaleup_rank.device
    return torch.tensor(rows, dtype=torch.long, device=device), num_recv, offset


def check_dispatch(out_k: tuple, out_r: tuple, do_expand: bool, zero_padding: bool, what: str = "dispatch",
                   send_side: bool = True) -> Any:  # fmt: skip
    """Compare a kernels dispatch's return tuple with the reference's; returns the kernels' handle.
    Without `send_side`, only what this rank received (not where its own tokens went)."""
    recv_k, idx_k, w_k, h_k, _ = out_k
    recv_r, idx_r, w_r, h_r, _ = out_r
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", *(("dst_buffer_slot_idx",) if send_side else ())):  # fmt: skip
        equal(getattr(h_k, name), getattr(h_r, name), f"{what}: handle.{name}")
    assert h_k.num_recv_tokens_per_expert_list == h_r.num_recv_tokens_per_expert_list, f"{what}: per-expert list"
    assert (h_k.num_recv_tokens, h_k.num_expanded_tokens) == (h_r.num_recv_tokens, h_r.num_expanded_tokens), what
    rows, num_recv, num_rows = real_rows(h_k)
    equal(h_k.recv_src_metadata[:num_recv], h_r.recv_src_metadata[:num_recv], f"{what}: recv_src_metadata")
    data_k = recv_k if isinstance(recv_k, tuple) else (recv_k,)
    data_r = recv_r if isinstance(recv_r, tuple) else (recv_r,)
    if do_expand and zero_padding:
        pick = lambda t: t[:num_rows]  # noqa: E731
    elif do_expand:
        pick = lambda t: t[rows]  # noqa: E731
    else:
        pick = lambda t: t[:num_recv]  # noqa: E731
    for i, (a, b) in enumerate(zip(data_k, data_r, strict=True)):
        assert a.shape == b.shape and a.stride() == b.stride(), (
            f"{what}: recv_x[{i}] layout {tuple(a.shape)}/{a.stride()} vs {tuple(b.shape)}/{b.stride()}"
        )
        equal(pick(a), pick(b), f"{what}: recv_x[{i}]")
    if not do_expand:
        equal(idx_k[:num_recv], idx_r[:num_recv], f"{what}: recv_topk_idx")
    else:
        assert idx_k is None and idx_r is None, f"{what}: recv_topk_idx in expand mode"
    if w_r is not None or w_k is not None:
        assert w_r is not None and w_k is not None, f"{what}: recv_topk_weights on one side only"
        equal(pick(w_k), pick(w_r), f"{what}: recv_topk_weights")
    return h_k


def combine_input(
    handle: Any, do_expand: bool, num_topk: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random BF16 expert outputs for `handle` (its full row count) and their top-k weights."""
    num = handle.num_expanded_tokens if do_expand else handle.num_recv_tokens
    device = handle.topk_idx.device
    x = torch.randn((num, handle.hidden), generator=gen).to(torch.bfloat16).to(device)
    w = torch.rand((num,) if do_expand else (num, num_topk), generator=gen).to(device)
    return x, w
