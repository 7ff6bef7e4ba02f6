"""Hybrid mode's combine contract on the reference backend (DeepEP V2's staged reduction): with
hybrid mode allowed on a group of several nodes (here virtual nodes of CPU ranks), each node's holder
partials are summed from +0.0 in FP32 in the usual order and rounded to BF16, then the node partials
are added at home by ascending last lane, after the biases; without multiple reduction in expand
mode every lane's row still travels alone, as in direct mode. Checked bitwise against the brute-force
oracle for both modes, with values for which the two stages give other bits than one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import Routing, assert_bitwise, expected_combine, gather_to_all

import deep_ep
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.routing import uniform_routing

NUM_RANKS, NUM_RANKS_PER_NODE, NUM_LOCAL, NUM_TOPK, HIDDEN, NUM_TOKENS = 4, 2, 3, 6, 32, 40
NUM_EXPERTS = NUM_RANKS * NUM_LOCAL


def _wide(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """BF16 values over a wide exponent range: FP32 sums that cancel, so every rounding shows."""
    scale = torch.exp2(torch.randint(-14, 15, shape, generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def _hybrid_rank(rank: int, group: dist.ProcessGroup, do_expand: bool, multiple: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    topk_idx, weights = uniform_routing(NUM_TOKENS, NUM_EXPERTS, NUM_TOPK, 0.1, gen)
    x = torch.randn((NUM_TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    bias = (_wide((NUM_TOKENS, HIDDEN), gen), _wide((NUM_TOKENS, HIDDEN), gen))
    results, domains = {}, {}
    for hybrid in (True, False):
        buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=NUM_TOKENS, hidden=HIDDEN, num_topk=NUM_TOPK,
                                       allow_hybrid_mode=hybrid, allow_multiple_reduction=multiple,
                                       backend="reference", explicitly_destroy=True)  # fmt: skip
        domains[hybrid] = (buffer.get_logical_domain_size(), buffer.get_physical_domain_size())
        handle = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS,
                                 do_expand=do_expand)[3]  # fmt: skip
        num_rows = handle.num_expanded_tokens if do_expand else handle.num_recv_tokens
        rows_gen = torch.Generator().manual_seed(seed * 17 + rank)  # the same rows in both modes
        rows = _wide((num_rows, HIDDEN), rows_gen)
        row_weights = torch.rand((num_rows,) if do_expand else (num_rows, NUM_TOPK), generator=rows_gen)
        results[hybrid] = buffer.combine(rows, handle, topk_weights=row_weights, bias=bias)[:2]
        inputs = gather_to_all({"x": rows, "topk_weights": row_weights}, group)
        routing = Routing(gather_to_all(topk_idx.tolist(), group), NUM_EXPERTS, NUM_RANKS, 1)
        expected = expected_combine(rank, routing, inputs, do_expand, multiple, list(bias), HIDDEN, NUM_TOPK,
                                    num_ranks_per_node=NUM_RANKS_PER_NODE if hybrid else None)  # fmt: skip
        assert_bitwise(results[hybrid][0], expected[0], f"combined_x, hybrid={hybrid}")
        assert_bitwise(results[hybrid][1], expected[1], f"combined_topk_weights, hybrid={hybrid}")
        buffer.destroy()
    differ = (results[True][0].view(torch.int16) != results[False][0].view(torch.int16)).sum()
    return {"domains": domains, "num_differ": int(differ)}


@pytest.mark.parametrize("do_expand, multiple", [(False, True), (True, True), (True, False)])
def test_hybrid_combine_reduces_each_node_first(do_expand: bool, multiple: bool) -> None:
    seed = torch.seed() % (1 << 20)
    world = LoopbackWorld(NUM_RANKS, device="cpu", num_ranks_per_node=NUM_RANKS_PER_NODE)
    outcomes = world.run(_hybrid_rank, do_expand, multiple, seed)
    for outcome in outcomes:
        assert outcome["domains"] == {True: ((2, 2), (2, 2)), False: ((1, 4), (2, 2))}, outcome
    num_differ = sum(o["num_differ"] for o in outcomes)
    if do_expand and not multiple:
        assert num_differ == 0, (seed, outcomes)  # every lane's row alone: no node stage
    else:
        assert num_differ > 0, (seed, outcomes)  # the node stage's rounding shows


def test_the_module_level_domain_sizes_see_virtual_nodes() -> None:
    def sizes(rank: int, group: dist.ProcessGroup) -> tuple:
        return (deep_ep.get_physical_domain_size(group), deep_ep.get_logical_domain_size(group),
                deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False))  # fmt: skip

    world = LoopbackWorld(NUM_RANKS, device="cpu", num_ranks_per_node=NUM_RANKS_PER_NODE)
    assert world.run(sizes) == [((2, 2), (2, 2), (1, 4))] * NUM_RANKS
    with pytest.raises(ValueError, match="`num_ranks_per_node` must be a positive int dividing num_ranks = 4"):
        LoopbackWorld(NUM_RANKS, device="cpu", num_ranks_per_node=3)


def test_hybrid_mode_past_v2s_node_limit_is_refused() -> None:
    def make(rank: int, group: dist.ProcessGroup, hybrid: bool) -> str:
        try:
            buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=64, num_topk=2,
                                           allow_hybrid_mode=hybrid, backend="reference", explicitly_destroy=True)  # fmt: skip
        except ValueError as error:
            return str(error)
        buffer.destroy()
        return "created"

    world = LoopbackWorld(34, device="cpu", num_ranks_per_node=1)  # 34 nodes of one rank
    refused = world.run(make, True)
    assert all("hybrid mode needs <= 32 nodes of <= 64 ranks" in r and "got 34 nodes of 1 ranks" in r for r in refused)
    assert world.run(make, False) == ["created"] * 34  # direct mode has no such limit


def test_the_kernels_take_hybrid_mode_but_not_with_rank_masking() -> None:
    """Which backend a hybrid buffer gets (`ElasticBuffer` asks the backend class before it builds
    one): the kernels serve hybrid mode with or without multiple reduction, not with rank masking,
    and their runtime gets one node per scale-up domain."""
    from types import SimpleNamespace

    from deep_ep.backends.kernels.backend import NvlinkBackend, hybrid_nodes
    from deep_ep.backends.reference.backend import ReferenceBackend

    for multiple in (True, False):
        assert NvlinkBackend.hybrid_mode_unsupported_reason(multiple, False) is None
        assert "enable_rank_masking=False" in NvlinkBackend.hybrid_mode_unsupported_reason(multiple, True)
        assert ReferenceBackend.hybrid_mode_unsupported_reason(multiple, True) is None
    for num_ranks, per_node, nodes in ((16, 4, 4), (8, 4, 2), (8, 8, 0), (8, 0, 0)):
        assert hybrid_nodes(SimpleNamespace(num_ranks=num_ranks, num_scaleup_ranks=per_node)) == nodes
