"""Dispatch moves any dtype as raw bytes, with scales of any pack count and strides (v2-parity.md items
5 and 6): float16, int8, FP8 e5m2 alone, packed FP4 with 1x32 UE8M0 packs, MXFP8 with 1x32 FP32
scales given column-major; each checked bitwise against the brute-force oracle on 3 CPU virtual
ranks, in both layouts. The kernels run the same kinds in the virtual-rank sweep (tests/loopback)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from kernel_checks import RAW_KINDS, make_x
from oracle import Case, Routing, assert_bitwise, check_dispatch, gather_to_all

import deep_ep
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.routing import uniform_routing

TMAX, HIDDEN, NUM_TOPK, NUM_EXPERTS = 16, 256, 4, 12


def _raw_rank(rank: int, group: dist.ProcessGroup, kind: str, do_expand: bool, seed: int) -> str:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK,
                                   backend="reference", explicitly_destroy=True)  # fmt: skip
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    num_tokens = random.Random(seed + rank).randint(1, TMAX)
    x = make_x(kind, num_tokens, HIDDEN, gen, "cpu")
    topk_idx, topk_weights = uniform_routing(num_tokens, NUM_EXPERTS, NUM_TOPK, 0.1, gen)
    before = [t.clone() for t in (x if isinstance(x, tuple) else (x,))]
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=NUM_EXPERTS, do_expand=do_expand,
        use_tma_aligned_col_major_sf=isinstance(x, tuple),
    )  # fmt: skip
    data, scales = x if isinstance(x, tuple) else (x, None)
    inputs = gather_to_all({"x": data, "scales": scales, "topk_idx": topk_idx, "topk_weights": topk_weights}, group)
    routing = Routing([inp["topk_idx"].tolist() for inp in inputs], NUM_EXPERTS, group.size(), 1)
    case = Case(rank=rank, num_ranks=group.size(), num_experts=NUM_EXPERTS, num_topk=NUM_TOPK, hidden=data.shape[1],
                num_max_tokens_per_rank=TMAX, expert_alignment=1, do_expand=do_expand, do_cpu_sync=True,
                do_zero_padding=False, col_major=scales is not None)  # fmt: skip
    check_dispatch(case, routing, inputs, recv_x, recv_topk_idx, recv_topk_weights, handle)
    for t, copy in zip(x if isinstance(x, tuple) else (x,), before, strict=True):
        assert_bitwise(t, copy, "an input (it was modified)")
    buffer.destroy()
    return str((data.dtype, None if scales is None else (scales.dtype, scales.shape[1])))


@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.parametrize("kind", RAW_KINDS)
def test_any_dtype_travels_as_raw_bytes(kind: str, do_expand: bool) -> None:
    seed = random.randrange(1 << 30)
    described = LoopbackWorld(3, device="cpu").run(_raw_rank, kind, do_expand, seed)
    assert len(set(described)) == 1, (seed, described)


def _refused_rank(rank: int, group: dist.ProcessGroup, x: object, expected: type[Exception], match: str) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK,
                                   backend="reference", explicitly_destroy=True)  # fmt: skip
    topk_idx, _ = uniform_routing(4, NUM_EXPERTS, NUM_TOPK, 0.0, torch.Generator().manual_seed(rank))
    with pytest.raises(expected, match=match):
        buffer.dispatch(x, topk_idx=topk_idx, num_experts=NUM_EXPERTS)
    buffer.destroy()


@pytest.mark.parametrize(
    "x, expected, match",
    [
        (torch.zeros((4, 256), dtype=torch.bool), TypeError, r"`x` must be a strided tensor of a real dtype"),
        (torch.zeros((4, 4), dtype=torch.complex64), TypeError, r"`x` must be a strided tensor of a real dtype"),
        (torch.zeros((4, 20), dtype=torch.float16), ValueError, r"`x` rows must be a positive multiple of 16 bytes"),
        ((torch.zeros((4, 256), dtype=torch.uint8), torch.zeros((4, 0))), ValueError, r"`x\[1\]` \(scales\)"),
        ((torch.zeros((4, 256), dtype=torch.uint8), torch.zeros((3, 8))), ValueError, r"\[4, >= 1\], got \[3, 8\]"),
        ((torch.zeros((4, 256), dtype=torch.uint8), torch.zeros((4, 8), dtype=torch.float16)), TypeError,
         r"`x\[1\]` must have dtype torch.float32 or torch.int32"),
    ],
)  # fmt: skip
def test_what_cannot_travel_as_raw_rows_is_refused_naming_the_argument(
    x: object, expected: type[Exception], match: str
) -> None:
    LoopbackWorld(1, device="cpu").run(_refused_rank, x, expected, match)


def _disagreeing_rank(rank: int, group: dist.ProcessGroup, what: str) -> str:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK,
                                   backend="reference", explicitly_destroy=True)  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    topk_idx, _ = uniform_routing(4, NUM_EXPERTS, NUM_TOPK, 0.0, gen)
    if what == "dtype":  # the same element size, another dtype
        x = torch.randn((4, HIDDEN), generator=gen).to(torch.float16 if rank == 1 else torch.bfloat16)
    else:
        x = (torch.zeros((4, HIDDEN), dtype=torch.uint8), torch.rand((4, 8 if rank == 1 else 2), generator=gen))
    try:
        buffer.dispatch(x, topk_idx=topk_idx, num_experts=NUM_EXPERTS)
    except ValueError as error:
        return str(error)
    finally:
        buffer.destroy()
    return "no error"


@pytest.mark.parametrize(
    "what, match",
    [("dtype", "`x` dtype, got [bfloat16, float16]"), ("packs", "scale packs (x[1].shape[1]), got [2, 8]")],
)
def test_ranks_that_disagree_on_the_dtype_or_the_pack_count_all_raise(what: str, match: str) -> None:
    for error in LoopbackWorld(2, device="cpu").run(_disagreeing_rank, what):
        assert match in error, error
