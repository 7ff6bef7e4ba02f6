"""Per-token FP8 casting helpers (1x128 blocks), the input format of FP8 dispatch.

Two scale formats exist:
- FP32: one `torch.float32` scale per 128-element block, `[T, ceil(H / 128)]`.
- UE8M0: one power-of-two scale per block stored as its 8-bit biased exponent; 4 consecutive blocks
  are packed into one `torch.int32` (little-endian: byte `j` of word `w` is block `4 * w + j`),
  `[T, ceil(H / 512)]`.
"""

from __future__ import annotations

import torch

from deep_ep.utils.math import align, ceil_div

# Largest finite value of `torch.float8_e4m3fn`
FP8_E4M3_MAX = 448.0

# Elements per scale block
BLOCK_SIZE = 128


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """A fresh row-major copy (`contiguous()` may keep odd strides of size-0 or size-1 dims)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    hidden = x.shape[1]
    padded_hidden = align(hidden, BLOCK_SIZE)
    if padded_hidden == hidden:
        return x
    return torch.nn.functional.pad(x, (0, padded_hidden - hidden), mode="constant", value=0)


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast BF16 tokens to FP8 E4M3 with one scale per token and 128-element block.

    A hidden size that is not a multiple of 128 is handled by zero-padding the last block.

    Arguments:
        x: `[num_tokens, hidden]` with `torch.bfloat16` (any float dtype is accepted), the tokens.
        use_ue8m0: round every scale up to a power of two and return the packed UE8M0 format.

    Returns:
        data: `[num_tokens, hidden]` with `torch.float8_e4m3fn`, contiguous.
        scales: `[num_tokens, ceil(hidden / 128)]` with `torch.float32` (`x ~= data * scale`), or with
            `use_ue8m0`, `[num_tokens, ceil(hidden / 512)]` with `torch.int32` (packed exponents).
    """
    if x.dim() != 2:
        raise ValueError(f"per_token_cast_to_fp8: `x` must be 2D [num_tokens, hidden], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    num_blocks = ceil_div(hidden, BLOCK_SIZE)
    blocks = _pad_blocks(x.float()).view(num_tokens, num_blocks, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / FP8_E4M3_MAX
    if use_ue8m0:
        # Round the scale up to a power of two (so that `|x / scale| <= 448` still holds)
        scales = torch.pow(2.0, torch.ceil(torch.log2(scales)))
    data = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    data = _row_major(data.view(num_tokens, num_blocks * BLOCK_SIZE)[:, :hidden])
    if not use_ue8m0:
        return data, _row_major(scales)

    # Pack the biased exponents, 4 blocks per int32 word
    exponents = (scales.view(torch.int32) >> 23).to(torch.uint8)
    num_words = ceil_div(num_blocks, 4)
    packed = torch.zeros((num_tokens, num_words * 4), dtype=torch.uint8, device=x.device)
    packed[:, :num_blocks] = exponents
    return data, _row_major(packed.view(torch.int32))


def unpack_ue8m0(scales: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Unpack packed UE8M0 scales into FP32 power-of-two scales.

    Arguments:
        scales: `[num_tokens, ceil(num_blocks / 4)]` with `torch.int32`, any strides.
        num_blocks: the number of 128-element blocks per token.

    Returns:
        scales: `[num_tokens, num_blocks]` with `torch.float32`.
    """
    exponents = _row_major(scales).view(torch.uint8)[:, :num_blocks].to(torch.int32)
    return (exponents << 23).view(torch.float32)


def per_token_cast_back(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Cast FP8 tokens back to BF16 (the inverse of `per_token_cast_to_fp8`, up to FP8 rounding).

    Arguments:
        data: `[num_tokens, hidden]` with `torch.float8_e4m3fn`.
        scales: `[num_tokens, ceil(hidden / 128)]` with `torch.float32`, or `[num_tokens, ceil(hidden / 512)]`
            with `torch.int32` (packed UE8M0); any strides (e.g. a column-major dispatch output).

    Returns:
        x: `[num_tokens, hidden]` with `torch.bfloat16`.
    """
    if data.dim() != 2 or scales.dim() != 2:
        raise ValueError(
            f"per_token_cast_back: `data` and `scales` must be 2D, got {tuple(data.shape)} and {tuple(scales.shape)}"
        )
    num_tokens, hidden = data.shape
    num_blocks = ceil_div(hidden, BLOCK_SIZE)
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, num_blocks)
    elif scales.dtype != torch.float32:
        raise TypeError(f"per_token_cast_back: `scales` must be torch.float32 or torch.int32, got {scales.dtype}")
    if scales.shape[1] < num_blocks:
        raise ValueError(f"per_token_cast_back: `scales` needs {num_blocks} blocks per token, got {scales.shape[1]}")
    blocks = _pad_blocks(data.float()).view(num_tokens, num_blocks, BLOCK_SIZE)
    x = blocks * scales[:, :num_blocks].unsqueeze(2)
    return _row_major(x.view(num_tokens, num_blocks * BLOCK_SIZE)[:, :hidden].to(torch.bfloat16))
