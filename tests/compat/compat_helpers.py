"""Shared by the framework call-pattern tests: exact test data, a toy expert, independent expected results.

Values are chosen so that every sum the library or the test computes is exact in BF16 and FP32:
activations are integers in [-4, 4] (FP8 data too, with power-of-two scales 0.5 or 1), gate weights
are 0.5 or 1 (0 on masked lanes), and expert `e` multiplies each channel by an integer in {1, 2, 3}
(`diag[e]`). Then a token's output `sum_k w[k] * diag[idx[k]] * x` is a multiple of 0.25 below 64,
exact in BF16, so results can be compared bit for bit with a float64 computation done independently
from the inputs of every rank (each rank draws every rank's inputs from a shared seed).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from deep_ep.utils.routing import uniform_routing
from deep_ep.utils.spawn import spawn_ranks

# The two places a pattern runs: the reference backend on 2 CPU ranks, the kernels on 2 GPUs
BACKENDS = [
    pytest.param("reference", id="reference-gloo"),
    pytest.param(
        "kernels",
        id="kernels-nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
        ],
    ),
]

# Shapes per backend: small on CPU, DeepSeek's hidden size on GPU
SHAPES = {
    "reference": dict(hidden=256, num_experts=16, num_topk=4, num_max_tokens=32),
    "kernels": dict(hidden=7168, num_experts=16, num_topk=4, num_max_tokens=128),
}


def run_pattern(worker: Any, backend: str, extra: tuple = ()) -> list[Any]:
    """Run `worker(rank, num_ranks, seed, backend, shape, *extra)` on 2 ranks (gloo or NCCL)."""
    seed = int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))
    group_backend = "gloo" if backend == "reference" else "nccl"
    try:
        return spawn_ranks(worker, 2, backend=group_backend, args=(seed, backend, SHAPES[backend], *extra),
                           timeout_s=600)  # fmt: skip
    except Exception as error:
        raise AssertionError(f"seed {seed}: {error}") from error


def device_of_group() -> torch.device:
    """The device of the default group's tensors (the current GPU for NCCL)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def check_backend(buffer: Any, backend: str) -> None:
    """The buffer runs on the backend the test meant (frameworks pass no `backend`, so 'auto' chose)."""
    assert buffer.backend.name == backend, f"expected the {backend} backend, got {buffer.backend.name}"


@dataclass
class RankInputs:
    """One rank's tokens: `x` `[T, H]` BF16, `topk_idx` `[T, K]` int64, `topk_weights` `[T, K]` FP32."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def signed_ints(shape: tuple[int, ...], gen: torch.Generator, limit: int = 4) -> torch.Tensor:
    """Random non-zero integers in [-limit, limit] as FP32."""
    values = torch.randint(1, limit + 1, shape, generator=gen) * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    return values.float()


def make_inputs(
    gen: torch.Generator, token_counts: list[int], hidden: int, num_experts: int, num_topk: int, masked: float = 0.2
) -> list[RankInputs]:
    """Every rank's inputs (call with the same generator state on every rank)."""
    inputs = []
    for num_tokens in token_counts:
        topk_idx, _ = uniform_routing(num_tokens, num_experts, num_topk, masked_ratio=masked, generator=gen)
        weights = (torch.randint(1, 3, (num_tokens, num_topk), generator=gen) * 0.5).masked_fill(topk_idx < 0, 0.0)
        x = signed_ints((num_tokens, hidden), gen).to(torch.bfloat16)
        inputs.append(RankInputs(x, topk_idx, weights.float()))
    return inputs


def make_diag(gen: torch.Generator, num_experts: int, hidden: int) -> torch.Tensor:
    """`[E, H]` FP32: expert `e` multiplies channel `h` by `diag[e, h]` in {1, 2, 3}."""
    return torch.randint(1, 4, (num_experts, hidden), generator=gen).float()


def make_fp8(gen: torch.Generator, num_tokens: int, hidden: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 data (integers in [-4, 4], exact in E4M3) and power-of-two block scales 0.5 or 1.

    Returns `(data [T, H] float8_e4m3fn, scales)`: FP32 `[T, ceil(H / 128)]`, or with `ue8m0` the packed
    biased exponents `[T, ceil(H / 512)]` int32 (byte `j` of word `w` is block `4w + j`).
    """
    data = signed_ints((num_tokens, hidden), gen).to(torch.float8_e4m3fn)
    num_blocks = (hidden + 127) // 128
    exponents = torch.randint(-1, 1, (num_tokens, num_blocks), generator=gen)
    if not ue8m0:
        return data, torch.pow(2.0, exponents.float())
    num_words = (num_blocks + 3) // 4
    biased = torch.zeros((num_tokens, num_words * 4), dtype=torch.uint8)
    biased[:, :num_blocks] = (exponents + 127).to(torch.uint8)
    return data, biased.view(torch.int32)  # little-endian: byte j of word w is block 4w + j


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`data * scale` per 128-channel block, FP32 (FP32 or packed UE8M0 scales, any strides)."""
    num_tokens, hidden = data.shape
    num_blocks = (hidden + 127) // 128
    if scales.dtype == torch.int32:
        words = scales.contiguous().to(torch.int64) & 0xFFFFFFFF
        exps = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=2).reshape(num_tokens, -1)
        block_scales = torch.pow(2.0, (exps[:, :num_blocks] - 127).double()).float()
    else:
        block_scales = scales.contiguous().float()
    return data.float() * block_scales.repeat_interleave(128, dim=1)[:, :hidden]


def tma_col_major(scales: torch.Tensor) -> torch.Tensor:
    """The same scales in the TMA-aligned column-major layout: strides `(1, align(T, 4))`."""
    num_tokens, num_packs = scales.shape
    stride = (num_tokens + 3) // 4 * 4
    storage = torch.zeros((num_packs, stride), dtype=scales.dtype, device=scales.device)
    storage[:, :num_tokens] = scales.t()
    return storage[:, :num_tokens].t()


def expected_moe(x: torch.Tensor, inputs: RankInputs, diag: torch.Tensor) -> torch.Tensor:
    """`y[t] = sum_k w[t, k] * diag[idx[t, k]] * x[t]` in float64 (`x` `[T, H]` any dtype)."""
    x64 = x.double().cpu()
    idx = inputs.topk_idx.cpu()
    weights = inputs.topk_weights.double().cpu()
    out = torch.zeros(x64.shape, dtype=torch.float64)
    for lane in range(idx.shape[1]):
        valid = idx[:, lane] >= 0
        lane_diag = diag.double()[idx[:, lane].clamp(min=0)]
        out += torch.where(valid.unsqueeze(1), weights[:, lane : lane + 1] * lane_diag * x64, 0.0)
    return out


def expected_weight_grads(x: torch.Tensor, grad: torch.Tensor, inputs: RankInputs, diag: torch.Tensor) -> torch.Tensor:
    """`d <y, grad> / d w[t, k] = <grad[t], diag[idx[t, k]] * x[t]>` (`0` on masked lanes), float64."""
    idx = inputs.topk_idx.cpu()
    lane_diag = diag.double()[idx.clamp(min=0)]
    values = (lane_diag * x.double().cpu().unsqueeze(1) * grad.double().cpu().unsqueeze(1)).sum(dim=2)
    return torch.where(idx >= 0, values, 0.0)


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bitwise equal after conversion to float64 (the test data keeps every value exact)."""
    actual64 = actual.detach().double().cpu()
    assert actual64.shape == expected.shape, f"{what}: shape {tuple(actual64.shape)} != {tuple(expected.shape)}"
    if not torch.equal(actual64, expected):
        diff = (actual64 - expected).abs()
        worst = int(diff.argmax())
        raise AssertionError(
            f"{what}: {int((diff > 0).sum())} of {diff.numel()} values differ, e.g. element {worst}: "
            f"{float(actual64.flatten()[worst])} vs {float(expected.flatten()[worst])}"
        )
    assert expected.abs().sum() > 0 or expected.numel() == 0, f"{what}: the expected values are all zero"
