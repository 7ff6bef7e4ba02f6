"""Brute-force oracle of dispatch/combine, independent of deep_ep.reference (plain loops, per-row ops).

Every rank all-gathers every rank's inputs to the CPU, then derives with Python loops what this rank
must receive (rows, order, every metadata field, expanded layout, counts) and what combine must
return (per-token FP32 loops in the contract's order). Comparisons are bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def gather_to_all(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """All-gather a picklable object (tensors moved to the CPU first) from every rank."""

    # NOTES: FP8 tensors do not survive pickling, so tensors travel as raw bytes plus dtype and shape
    def encode(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
            return (
                "tensor",
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.view(torch.uint8).flatten().clone(),
            )
        if isinstance(value, dict):
            return {k: encode(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(encode(v) for v in value)
        return value

    def decode(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 4 and value[0] == "tensor":
            _, dtype, shape, data = value
            return data.view(getattr(torch, dtype)).reshape(shape)
        if isinstance(value, dict):
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(decode(v) for v in value)
        return value

    result: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(result, encode(obj), group=group)
    return [decode(value) for value in result]


def ceil_to(n: int, a: int) -> int:
    return -(-n // a) * a


def raw(t: torch.Tensor) -> torch.Tensor:
    """A bitwise view (uint8 bytes per row) of a tensor on the CPU, for exact comparison."""
    # NOTES: `contiguous()` keeps odd strides of size-1 dims, which `view(torch.uint8)` rejects
    t = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format).copy_(t).reshape(-1)
    if t.dtype in (torch.int64, torch.int32, torch.bool):
        return t
    return t.view(torch.uint8)


def assert_bitwise(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    assert tuple(got.shape) == tuple(expected.shape), f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    a, b = raw(got), raw(expected)
    if not torch.equal(a, b):
        diff = (a != b).nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: values differ at {diff}\n got={got.flatten()[:16]}\n expected={expected.flatten()[:16]}"
        )


@dataclass
class Routing:
    """Every rank's routing and the layout each rank must receive, by brute force."""

    topk_idx: list[list[list[int]]]  # [rank][token][lane]
    num_experts: int
    num_ranks: int
    expert_alignment: int
    rows: list[list[tuple[int, int]]] = field(default_factory=list)  # [rank] -> received (src, token)
    counts: list[list[int]] = field(default_factory=list)  # [rank][local expert]
    expanded: list[dict[tuple[int, int, int], int]] = field(default_factory=list)  # [rank] (src, token, lane) -> row

    def __post_init__(self) -> None:
        num_local = self.num_experts // self.num_ranks
        for rank in range(self.num_ranks):
            rows = []
            for src, table in enumerate(self.topk_idx):
                for token, lanes in enumerate(table):
                    if any(e >= 0 and e // num_local == rank for e in lanes):
                        rows.append((src, token))
            self.rows.append(rows)
            counts = [0] * num_local
            for src, token in rows:
                for e in self.topk_idx[src][token]:
                    if e >= 0 and e // num_local == rank:
                        counts[e - rank * num_local] += 1
            self.counts.append(counts)
            expanded = {}
            start = 0
            for local in range(num_local):
                position = start
                for src, token in rows:
                    for lane, e in enumerate(self.topk_idx[src][token]):
                        if e == rank * num_local + local:
                            expanded[(src, token, lane)] = position
                            position += 1
                start += ceil_to(counts[local], self.expert_alignment)
            self.expanded.append(expanded)

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    def aligned(self, rank: int) -> list[int]:
        return [ceil_to(c, self.expert_alignment) for c in self.counts[rank]]

    def offsets(self, rank: int) -> list[int]:
        aligned = self.aligned(rank)
        return [sum(aligned[:e]) for e in range(self.num_local)]

    def holder(self, expert: int) -> int:
        return expert // self.num_local


@dataclass
class Case:
    """The options of one dispatch as the oracle needs them."""

    rank: int
    num_ranks: int
    num_experts: int
    num_topk: int
    hidden: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    do_expand: bool
    do_cpu_sync: bool
    do_zero_padding: bool
    col_major: bool


def worst_rows(case: Case) -> tuple[int, int]:
    """(non-expanded, expanded) worst-case row counts, restated from the contract."""
    n, tmax, k, a = case.num_ranks, case.num_max_tokens_per_rank, case.num_topk, case.expert_alignment
    num_local = case.num_experts // n
    return n * tmax, ceil_to(n * tmax * min(k, num_local) + num_local * (a - 1), a)


def check_dispatch(
    case: Case,
    routing: Routing,
    inputs: list[dict[str, Any]],
    recv_x: Any,
    recv_topk_idx: torch.Tensor | None,
    recv_topk_weights: torch.Tensor | None,
    handle: Any,
    shapes_of: Any = None,
) -> None:
    """Check one dispatch's outputs and handle on this rank against the brute force.

    `inputs[src]` holds `x` (bf16 or fp8), `scales` (or None), `topk_weights` (or None) of rank `src`.
    `shapes_of` is the handle whose row counts a cached dispatch must reproduce (else the case's rule).
    """
    rank, num_topk = case.rank, case.num_topk
    num_local = routing.num_local
    rows = routing.rows[rank]
    num_recv = len(rows)
    aligned = routing.aligned(rank)
    offsets = routing.offsets(rank)
    counts = routing.counts[rank]
    if shapes_of is not None:
        exp_recv_rows, exp_expanded_rows = shapes_of
    elif case.do_cpu_sync:
        exp_recv_rows, exp_expanded_rows = num_recv, sum(aligned)
    else:
        exp_recv_rows, exp_expanded_rows = worst_rows(case)
    has_scales = inputs[rank]["scales"] is not None
    data, scales = recv_x if has_scales else (recv_x, None)
    has_weights = inputs[rank]["topk_weights"] is not None
    num_rows = exp_expanded_rows if case.do_expand else exp_recv_rows

    # Shapes and layouts
    assert data.shape == (num_rows, case.hidden), (
        f"recv_x shape {tuple(data.shape)}, expected {(num_rows, case.hidden)}"
    )
    assert data.dtype == inputs[rank]["x"].dtype
    if has_scales:
        num_packs = inputs[rank]["scales"].shape[1]
        assert scales.shape == (num_rows, num_packs), f"scales shape {tuple(scales.shape)}"
        assert scales.dtype == inputs[rank]["scales"].dtype
        if case.col_major:
            assert scales.stride() == (1, ceil_to(num_rows, 4)), f"col-major scales strides {scales.stride()}"
        else:
            assert scales.is_contiguous()
    else:
        assert not isinstance(recv_x, tuple)
    assert (recv_topk_weights is not None) == has_weights, "recv_topk_weights presence"
    if case.do_expand:
        assert recv_topk_idx is None, "recv_topk_idx must be None in expand mode"
        if has_weights:
            assert recv_topk_weights.shape == (num_rows,)
    else:
        assert recv_topk_idx.shape == (num_rows, num_topk) and recv_topk_idx.dtype == torch.int64
        if has_weights:
            assert recv_topk_weights.shape == (num_rows, num_topk) and recv_topk_weights.dtype == torch.float32

    # Row by row
    data_c = data.cpu()
    scales_c = scales.cpu() if has_scales else None
    weights_c = recv_topk_weights.cpu() if has_weights else None
    topk_c = recv_topk_idx.cpu() if recv_topk_idx is not None else None
    for i, (src, token) in enumerate(rows):
        source = inputs[src]
        lanes = routing.topk_idx[src][token]
        if not case.do_expand:
            assert_bitwise(data_c[i], source["x"][token], f"recv_x row {i} (src {src}, token {token})")
            if has_scales:
                assert_bitwise(scales_c[i], source["scales"][token], f"scales row {i}")
            if has_weights:
                assert_bitwise(weights_c[i], source["topk_weights"][token], f"recv_topk_weights row {i}")
            local = [e - rank * num_local if e >= 0 and routing.holder(e) == rank else -1 for e in lanes]
            assert topk_c[i].tolist() == local, f"recv_topk_idx row {i}: {topk_c[i].tolist()} != {local}"
        else:
            for lane, e in enumerate(lanes):
                if e >= 0 and routing.holder(e) == rank:
                    row = routing.expanded[rank][(src, token, lane)]
                    assert_bitwise(
                        data_c[row],
                        source["x"][token],
                        f"expanded recv_x row {row} (src {src}, token {token}, lane {lane})",
                    )
                    if has_scales:
                        assert_bitwise(scales_c[row], source["scales"][token], f"expanded scales row {row}")
                    if has_weights:
                        assert_bitwise(
                            weights_c[row], source["topk_weights"][token][lane], f"expanded weight row {row}"
                        )
    if case.do_expand and case.do_zero_padding:
        for e in range(num_local):
            pad = slice(offsets[e] + counts[e], offsets[e] + aligned[e])
            assert not raw(data_c[pad]).any(), f"padding rows of expert {e} must be zero"
            if has_scales:
                assert not raw(scales_c[pad]).any(), f"padding scales of expert {e} must be zero"
            if has_weights:
                assert not raw(weights_c[pad]).any(), f"padding weights of expert {e} must be zero"

    # Handle
    assert handle.do_expand == case.do_expand and handle.num_topk == num_topk and handle.hidden == case.hidden
    assert handle.num_experts == case.num_experts and handle.expert_alignment == case.expert_alignment
    assert handle.num_max_tokens_per_rank == case.num_max_tokens_per_rank
    assert handle.num_tokens == len(routing.topk_idx[rank])
    assert handle.num_recv_tokens == exp_recv_rows, f"num_recv_tokens {handle.num_recv_tokens} != {exp_recv_rows}"
    assert handle.num_expanded_tokens == exp_expanded_rows, (
        f"num_expanded_tokens {handle.num_expanded_tokens} != {exp_expanded_rows}"
    )
    expected_list = aligned if handle.do_cpu_sync else []  # V2: empty without CPU sync
    assert handle.num_recv_tokens_per_expert_list == expected_list, (
        f"list {handle.num_recv_tokens_per_expert_list} != {expected_list}"
    )
    per_src = [sum(1 for s, _ in rows if s == src) for src in range(case.num_ranks)]
    psum_ranks = [sum(per_src[: i + 1]) for i in range(case.num_ranks)]
    assert_bitwise(
        handle.psum_num_recv_tokens_per_scaleup_rank, torch.tensor(psum_ranks, dtype=torch.int32), "psum per rank"
    )
    if case.do_expand:
        psum_experts = [offsets[e] + counts[e] for e in range(num_local)]
    else:
        psum_experts = [sum(aligned[: e + 1]) for e in range(num_local)]
    assert_bitwise(
        handle.psum_num_recv_tokens_per_expert, torch.tensor(psum_experts, dtype=torch.int32), "psum per expert"
    )
    assert_bitwise(
        handle.num_unaligned_recv_tokens_per_expert, torch.tensor(counts, dtype=torch.int32), "unaligned counts"
    )
    metadata = []
    for src, token in rows:
        lanes = routing.topk_idx[src][token]
        expanded = [
            routing.expanded[rank][(src, token, lane)]
            if case.do_expand and e >= 0 and routing.holder(e) == rank
            else -1
            for lane, e in enumerate(lanes)
        ]
        # Column 1, V2's: the source rank times K plus the token's highest lane to this rank
        master_lane = max(lane for lane, e in enumerate(lanes) if e >= 0 and routing.holder(e) == rank)
        metadata.append([src * case.num_max_tokens_per_rank + token, src * num_topk + master_lane, *expanded])
    got_metadata = handle.recv_src_metadata
    assert tuple(got_metadata.shape) == (exp_recv_rows, 2 + num_topk), (
        f"recv_src_metadata shape {tuple(got_metadata.shape)}"
    )
    expected_metadata = torch.tensor(metadata, dtype=torch.int32).reshape(num_recv, 2 + num_topk)
    assert_bitwise(got_metadata[:num_recv], expected_metadata, "recv_src_metadata")
    slots = []
    mine = routing.topk_idx[rank]
    for token, lanes in enumerate(mine):
        row = []
        for lane, e in enumerate(lanes):
            d = routing.holder(e) if e >= 0 else -1
            # V2's: `rank * Tmax + slot` on the token's highest lane to `d` only
            if e < 0 or any(f >= 0 and routing.holder(f) == d for f in lanes[lane + 1 :]):
                row.append(-1)
            else:
                slot = sum(1 for t in range(token) if any(f >= 0 and routing.holder(f) == d for f in mine[t]))
                row.append(rank * case.num_max_tokens_per_rank + slot)
        slots.append(row)
    expected_slots = torch.tensor(slots, dtype=torch.int32).reshape(len(mine), num_topk)
    assert_bitwise(handle.dst_buffer_slot_idx, expected_slots, "dst_buffer_slot_idx")


def expected_combine(
    rank: int,
    routing: Routing,
    combine_inputs: list[dict[str, Any]],
    do_expand: bool,
    allow_multiple_reduction: bool,
    bias: list[torch.Tensor],
    hidden: int,
    num_topk: int,
    num_ranks_per_node: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Combine by brute force: per token, an FP32 loop in DeepEP V2's order (its `refs.combine`): from
    +0.0, the biases, then one partial per holder rank, holders by ascending last lane; without
    multiple reduction in expand mode, every lane's row, lanes ascending. With `num_ranks_per_node`
    (hybrid mode) the holder partials of each node are first summed the same way from +0.0 and rounded
    to BF16, and the node partials are added by ascending last lane of each node.

    `combine_inputs[d]` holds rank `d`'s combine `x` and `topk_weights` (or None), both on the CPU.
    """
    table = routing.topk_idx[rank]
    num_tokens = len(table)
    has_weights = combine_inputs[rank]["topk_weights"] is not None
    out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
    weights = torch.zeros((num_tokens, num_topk), dtype=torch.float32) if has_weights else None
    for token, lanes in enumerate(table):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for b in bias:
            acc = acc + b[token].float()
        valid = [(lane, routing.holder(e)) for lane, e in enumerate(lanes) if e >= 0]
        last_lane = {d: lane for lane, d in valid}  # the highest lane of each holder
        if do_expand and not allow_multiple_reduction:
            for lane, d in valid:
                acc = acc + combine_inputs[d]["x"][routing.expanded[d][(rank, token, lane)]].float()
        staged = num_ranks_per_node is not None and not (do_expand and not allow_multiple_reduction)
        node_acc: dict[int, torch.Tensor] = {}
        node_last = {d // num_ranks_per_node: lane for lane, d in valid} if staged else {}
        for d in sorted(last_lane, key=last_lane.get):
            x_d = combine_inputs[d]["x"]
            w_d = combine_inputs[d]["topk_weights"]
            my_lanes = [lane for lane, holder in valid if holder == d]
            partial = None
            if not do_expand:
                row = routing.rows[d].index((rank, token))
                partial = x_d[row]
                for lane in my_lanes:
                    if has_weights:
                        weights[token, lane] = w_d[row, lane]
            else:
                expanded = [routing.expanded[d][(rank, token, lane)] for lane in my_lanes]
                if allow_multiple_reduction:
                    summed = torch.zeros(hidden, dtype=torch.float32)
                    for row in expanded:
                        summed = summed + x_d[row].float()
                    partial = summed.to(torch.bfloat16)
                if has_weights:
                    for lane, row in zip(my_lanes, expanded, strict=True):
                        weights[token, lane] = w_d[row]
            if partial is None:
                continue
            if not staged:
                acc = acc + partial.float()
                continue
            node = d // num_ranks_per_node
            node_acc[node] = node_acc.get(node, torch.zeros(hidden, dtype=torch.float32)) + partial.float()
        for node in sorted(node_acc, key=node_last.get):
            acc = acc + node_acc[node].to(torch.bfloat16).float()
        out[token] = acc.to(torch.bfloat16)
    return out, weights
