"""Property-based fuzzing of the reference backend against the brute-force oracle (`tests/oracle.py`),
on CPU virtual ranks (`LoopbackWorld(device="cpu")`, one process, so hypothesis can shrink a failure).

Each example draws the world size, the expert layout, every rank's routing (uniform, everything to
one rank, all `-1`, one hot expert, zero tokens on some ranks), the options (expanded layout,
alignment, CPU sync or not, weights, multiple reduction) and then runs two dispatch + combine rounds
with different token counts on the same buffer. A failing example is printed by hypothesis with the
seed to replay it (`EP_FUZZ_EXAMPLES` raises the count; CI keeps it bounded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import Case, Routing, assert_bitwise, check_dispatch, expected_combine, gather_to_all

import deep_ep
from deep_ep.loopback import LoopbackWorld

NUM_EXAMPLES = int(os.environ.get("EP_FUZZ_EXAMPLES", "40"))
NUM_MAX_TOKENS = 12
HIDDEN = (64, 128, 192)
ROUTINGS = ("uniform", "one_rank", "all_masked", "hot_expert")


@dataclass(frozen=True)
class FuzzCase:
    num_ranks: int
    num_local_experts: int
    num_topk: int
    hidden: int
    expand: bool
    alignment: int
    cpu_sync: bool
    weights: bool
    multiple_reduction: bool
    routing: str
    # [round][rank] -> [token][lane] expert ids
    topk_idx: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    seed: int


def _lanes(draw, kind: str, num_experts: int, num_topk: int, hot: int) -> tuple[int, ...]:
    """One token's top-k experts out of `[0, num_experts)` for routing `kind` (`uniform`,
    `all_masked`, `hot_expert`): distinct ids, `-1` for unused lanes."""
    if kind == "all_masked":
        return (-1,) * num_topk
    chosen = draw(st.lists(st.integers(0, num_experts - 1), min_size=num_topk, max_size=num_topk))
    if kind == "hot_expert":
        chosen[0] = hot
    lanes, seen = [], set()
    for expert in chosen:
        masked = draw(st.booleans()) and draw(st.booleans())  # about a quarter of the lanes
        lanes.append(-1 if masked or expert in seen else expert)
        seen.add(expert)
    return tuple(lanes)


@st.composite
def fuzz_cases(draw) -> FuzzCase:
    num_ranks = draw(st.integers(1, 4))
    num_local_experts = draw(st.integers(1, 4))
    num_experts = num_ranks * num_local_experts
    num_topk = draw(st.integers(1, min(4, num_experts)))
    routing = draw(st.sampled_from(ROUTINGS))
    target = draw(st.integers(0, num_ranks - 1))
    hot = draw(st.integers(0, num_experts - 1))
    rounds = []
    for _ in range(2):  # the token count changes between rounds on the same buffer
        ranks = []
        for _ in range(num_ranks):
            num_tokens = draw(st.integers(0, NUM_MAX_TOKENS))
            if routing == "one_rank":  # every lane on rank `target`'s experts
                base, width = target * num_local_experts, min(num_topk, num_local_experts)
                local = [_lanes(draw, "uniform", num_local_experts, width, 0) for _ in range(num_tokens)]
                table = tuple(tuple(-1 if e < 0 else e + base for e in lanes) + (-1,) * (num_topk - width)
                              for lanes in local)  # fmt: skip
            else:
                table = tuple(_lanes(draw, routing, num_experts, num_topk, hot) for _ in range(num_tokens))
            ranks.append(table)
        rounds.append(tuple(ranks))
    return FuzzCase(num_ranks, num_local_experts, num_topk, draw(st.sampled_from(HIDDEN)), draw(st.booleans()),
                    draw(st.sampled_from((1, 4))), draw(st.booleans()), draw(st.booleans()), draw(st.booleans()),
                    routing, tuple(rounds), draw(st.integers(0, 2**31 - 1)))  # fmt: skip


def _fuzz_rank(rank: int, group, case: FuzzCase) -> int:
    num_experts = case.num_ranks * case.num_local_experts
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=NUM_MAX_TOKENS, hidden=case.hidden,
                                   num_topk=case.num_topk, allow_multiple_reduction=case.multiple_reduction,
                                   explicitly_destroy=True)  # fmt: skip
    try:
        for round_idx, tables in enumerate(case.topk_idx):
            gen = torch.Generator().manual_seed(case.seed * 31 + round_idx * 7 + rank)
            table = tables[rank]
            topk_idx = torch.tensor(table, dtype=torch.int64).reshape(len(table), case.num_topk)
            weights = torch.rand((len(table), case.num_topk), generator=gen) if case.weights else None
            x = torch.randn((len(table), case.hidden), generator=gen).to(torch.bfloat16)
            recv_x, recv_topk, recv_w, handle, _ = buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts,
                num_max_tokens_per_rank=NUM_MAX_TOKENS, expert_alignment=case.alignment, do_expand=case.expand,
                do_cpu_sync=case.cpu_sync)  # fmt: skip
            inputs = gather_to_all({"x": x, "scales": None, "topk_idx": topk_idx, "topk_weights": weights}, group)
            routing = Routing([list(map(list, t)) for t in tables], num_experts, case.num_ranks, case.alignment)
            oracle_case = Case(rank=rank, num_ranks=case.num_ranks, num_experts=num_experts, num_topk=case.num_topk,
                               hidden=case.hidden, num_max_tokens_per_rank=NUM_MAX_TOKENS,
                               expert_alignment=case.alignment, do_expand=case.expand, do_cpu_sync=case.cpu_sync,
                               do_zero_padding=False, col_major=False)  # fmt: skip
            check_dispatch(oracle_case, routing, inputs, recv_x, recv_topk, recv_w, handle)
            rows = torch.randn((handle.num_combine_rows, case.hidden), generator=gen).to(torch.bfloat16)
            combined = buffer.combine(rows, handle)[0]
            everyone = gather_to_all({"x": rows, "topk_weights": None}, group)
            expected = expected_combine(rank, routing, everyone, case.expand, case.multiple_reduction, [],
                                        case.hidden, case.num_topk)[0]  # fmt: skip
            assert_bitwise(combined, expected, f"round {round_idx}: combine")
    finally:
        buffer.destroy()
    return len(case.topk_idx)


@settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(fuzz_cases())
def test_reference_backend_matches_the_oracle_on_fuzzed_routings_and_options(case: FuzzCase):
    world = LoopbackWorld(case.num_ranks, device="cpu", timeout_s=60)
    try:
        assert world.run(_fuzz_rank, case) == [2] * case.num_ranks
    finally:
        world.close()
