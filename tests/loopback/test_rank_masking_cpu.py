"""Rank masking on the reference backend (issue 20 #2, the model the kernels will follow), on 8 CPU
virtual ranks: with rank 5 masked, every rank's dispatch and combine are bitwise those of an unmasked
buffer given the routing with rank 5's experts' lanes set to -1 (all of rank 5's own lanes too), the
handle counts the dropped lanes, and handles made before the mask are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.routing import uniform_routing

NUM_RANKS, MASKED, NUM_LOCAL, NUM_TOPK, HIDDEN, TMAX = 8, 5, 4, 4, 128, 32
NUM_EXPERTS = NUM_RANKS * NUM_LOCAL


def _bits(t: torch.Tensor | None) -> bytes | None:
    """The raw bytes of `t` (no numpy: CPU torch comes without it)."""
    return None if t is None else bytes(t.contiguous().view(torch.uint8).flatten().tolist())


def _masking_rank(rank: int, group: dist.ProcessGroup, do_expand: bool, seed: int) -> dict:
    common = dict(num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK, backend="reference",
                  explicitly_destroy=True)  # fmt: skip
    masked = deep_ep.ElasticBuffer(group, enable_rank_masking=True, **common)
    plain = deep_ep.ElasticBuffer(group, **common)
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    num_tokens = 5 + rank * 3
    topk_idx, weights = uniform_routing(num_tokens, NUM_EXPERTS, NUM_TOPK, masked_ratio=0.1, generator=gen)
    x = (torch.randn((num_tokens, HIDDEN), generator=gen) * 8).to(torch.bfloat16)
    before = masked.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS)[3]
    masked.mask_ranks([MASKED])
    # What masking means: the lanes of the masked rank's experts are -1, and the masked rank sends nothing
    expected_routing = topk_idx.clone()
    expected_routing[(topk_idx >= 0) & (topk_idx // NUM_LOCAL == MASKED)] = -1
    if rank == MASKED:
        expected_routing[:] = -1
    kwargs = dict(topk_weights=weights, num_experts=NUM_EXPERTS, do_expand=do_expand)
    out_m = masked.dispatch(x, topk_idx=topk_idx, **kwargs)
    out_p = plain.dispatch(x, topk_idx=expected_routing, **kwargs)
    handle_m, handle_p = out_m[3], out_p[3]
    outcome = {"same": {}, "num_masked_lanes": int(handle_m.num_masked_lanes[0]), "masked": masked.get_masked_ranks()}
    outcome["expected_masked_lanes"] = int(((topk_idx >= 0) & (expected_routing < 0)).sum())
    for name, a, b in (("recv_x", out_m[0], out_p[0]), ("recv_topk_idx", out_m[1], out_p[1]),
                       ("recv_topk_weights", out_m[2], out_p[2])):  # fmt: skip
        outcome["same"][name] = _bits(a) == _bits(b)
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx"):  # fmt: skip
        outcome["same"][name] = _bits(getattr(handle_m, name)) == _bits(getattr(handle_p, name))
    rows = (torch.randn((handle_m.num_combine_rows, HIDDEN), generator=gen) * 4).to(torch.bfloat16)
    bias = (torch.randn((num_tokens, HIDDEN), generator=gen)).to(torch.bfloat16)
    comb_m = masked.combine(rows, handle_m, bias=bias)
    comb_p = plain.combine(rows, handle_p, bias=bias)
    outcome["same"]["combined_x"] = _bits(comb_m[0]) == _bits(comb_p[0])
    outcome["same"]["combined_topk_weights"] = _bits(comb_m[1]) == _bits(comb_p[1])
    cached = masked.dispatch(x, handle=handle_m, do_expand=do_expand)
    outcome["same"]["cached recv_x"] = _bits(cached[0]) == _bits(out_m[0])
    with pytest.raises(ValueError, match=r"`handle` must come from a dispatch under the current mask \(\[5\]\)"):
        masked.combine(torch.zeros((before.num_combine_rows, HIDDEN), dtype=torch.bfloat16), before)
    masked.destroy()
    plain.destroy()
    return outcome


@pytest.mark.parametrize("do_expand", [False, True])
def test_a_masked_rank_drops_out_and_the_others_match_the_reference_with_its_lanes_removed(do_expand: bool) -> None:
    seed = torch.seed() % (1 << 20)
    outcomes = LoopbackWorld(NUM_RANKS, device="cpu", timeout_s=120).run(_masking_rank, do_expand, seed)
    for rank, outcome in enumerate(outcomes):
        assert all(outcome["same"].values()), (rank, seed, outcome)
        assert outcome["num_masked_lanes"] == outcome["expected_masked_lanes"], (rank, seed, outcome)
        assert outcome["masked"] == [MASKED]
    # The masked rank drops every lane of its own; a few tokens of another rank may miss rank 5
    assert outcomes[MASKED]["num_masked_lanes"] > 0
    assert sum(o["num_masked_lanes"] for r, o in enumerate(outcomes) if r != MASKED) > 0, (seed, outcomes)


def test_mask_ranks_checks_its_arguments(group: dist.ProcessGroup) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, explicitly_destroy=True)
    with pytest.raises(ValueError, match=r"mask_ranks: needs a buffer created with `enable_rank_masking`=True"):
        buffer.mask_ranks([0])
    assert buffer.get_masked_ranks() == []
    buffer.destroy()
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, explicitly_destroy=True,
                                   enable_rank_masking=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"`ranks` must hold rank indices in \[0, 1\), got 3"):
        buffer.mask_ranks([3])
    assert buffer.get_masked_ranks() == []
    buffer.destroy()


def test_mask_ranks_on_timeout_needs_rank_masking_and_the_kernels(group: dist.ProcessGroup) -> None:
    with pytest.raises(ValueError, match=r"`mask_ranks_on_timeout`=True needs `enable_rank_masking`=True and a "
                                         r"backend .* got enable_rank_masking=False and the 'reference' backend"):  # fmt: skip
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, mask_ranks_on_timeout=True)
    with pytest.raises(ValueError, match=r"got enable_rank_masking=True and the 'reference' backend"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, enable_rank_masking=True,
                              mask_ranks_on_timeout=True)  # fmt: skip


def test_a_backend_without_rank_masking_refuses_it_at_construction(
    group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deep_ep.backends.reference.backend import ReferenceBackend

    # Both backends mask ranks; the reference backend stands in for one that does not
    monkeypatch.setattr(ReferenceBackend, "supports_rank_masking", False)
    with pytest.raises(ValueError, match=r"`enable_rank_masking`=True needs a backend that masks ranks, got the "):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, enable_rank_masking=True)
