"""deep_ep.utils.fp8: per-token FP8 casting, both scale formats, and the UE8M0 packing layout."""

from __future__ import annotations

import random

import pytest
import torch

from deep_ep.utils.fp8 import per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0


def random_tokens(num_tokens: int, hidden: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-8, 9, (num_tokens, 1), generator=gen).float())
    return (torch.randn((num_tokens, hidden), generator=gen) * scale).to(torch.bfloat16)


@pytest.fixture
def seed() -> int:
    value = random.SystemRandom().randrange(1 << 30)
    print(f"seed={value}")
    return value


@pytest.mark.parametrize("hidden", [128, 320, 512, 7168, 100])
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_roundtrip_shapes_and_error(hidden: int, use_ue8m0: bool, seed: int) -> None:
    x = random_tokens(17, hidden, seed)
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=use_ue8m0)
    num_blocks = -(-hidden // 128)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (17, hidden) and data.is_contiguous()
    if use_ue8m0:
        assert scales.dtype == torch.int32 and scales.shape == (17, -(-num_blocks // 4))
    else:
        assert scales.dtype == torch.float32 and scales.shape == (17, num_blocks)
    assert not data.float().isnan().any()
    y = per_token_cast_back(data, scales)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # E4M3 keeps 3 mantissa bits: error per element <= 2^-4 of its value, plus the BF16 rounding (2^-9)
    blocks = torch.nn.functional.pad(x.float(), (0, num_blocks * 128 - hidden)).view(17, num_blocks, 128)
    block_max = blocks.abs().amax(dim=2, keepdim=True).expand(-1, -1, 128).reshape(17, -1)[:, :hidden]
    err = (y.float() - x.float()).abs()
    assert (err <= block_max * (2**-4 + 2**-8)).all()


def test_ue8m0_packing_layout(seed: int) -> None:
    # 9 blocks: 3 words, the last one holding 1 block (and 3 padding bytes)
    x = random_tokens(5, 9 * 128, seed)
    _, packed = per_token_cast_to_fp8(x, use_ue8m0=True)
    fp32_scales = unpack_ue8m0(packed, 9)
    assert fp32_scales.shape == (5, 9)
    for token in range(5):
        for block in range(9):
            word = int(packed[token, block // 4]) & 0xFFFFFFFF
            exponent = (word >> (8 * (block % 4))) & 0xFF  # byte j of word w is block 4w + j
            amax = x[token, block * 128 : (block + 1) * 128].float().abs().max().clamp(min=1e-4)
            assert fp32_scales[token, block] == 2.0 ** (exponent - 127)
            # The smallest power of two with amax / scale <= 448
            assert amax / 2.0 ** (exponent - 127) <= 448 < amax / 2.0 ** (exponent - 128)


def test_fp32_scales_are_amax_over_448(seed: int) -> None:
    x = random_tokens(4, 256, seed)
    data, scales = per_token_cast_to_fp8(x)
    amax = x.float().view(4, 2, 128).abs().amax(dim=2)
    assert torch.allclose(scales, amax / 448.0)
    assert data.float().abs().max() <= 448


def test_zero_tokens_and_strided_scales() -> None:
    data, scales = per_token_cast_to_fp8(torch.empty((0, 256), dtype=torch.bfloat16))
    assert data.shape == (0, 256) and scales.shape == (0, 2) and scales.stride() == (2, 1)
    assert per_token_cast_back(data, scales).shape == (0, 256)
    x = random_tokens(6, 128, 1)
    data, scales = per_token_cast_to_fp8(x, use_ue8m0=True)
    col_major = torch.empty_strided((6, 1), (1, 8), dtype=torch.int32).copy_(scales)
    assert torch.equal(per_token_cast_back(data, col_major), per_token_cast_back(data, scales))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`x`"):
        per_token_cast_to_fp8(torch.ones(4, dtype=torch.bfloat16))
    data, _ = per_token_cast_to_fp8(torch.ones((2, 128), dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="`scales`"):
        per_token_cast_back(data, torch.ones((2, 1), dtype=torch.float64))
