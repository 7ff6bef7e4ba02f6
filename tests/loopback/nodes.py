"""Rank functions of the virtual-node GPU tests: a node that stalls, and a run whose emulated NIC breaks
the protocol on purpose (so that the strict NIC must expose it)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

# The hidden size of the stall and mistake tests: the 8-rank shape of the virtual-node sweep
NODE_HIDDEN = 2560


def node_buffer(group: Any, timeout_s: float, hybrid: bool = False, **kwargs: Any) -> Any:
    """A kernels buffer in direct mode, or in hybrid mode with `hybrid`."""
    import deep_ep

    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=NODE_HIDDEN, num_topk=8,
                                 explicitly_destroy=True, allow_hybrid_mode=hybrid, num_gpu_timeout_secs=timeout_s,
                                 num_cpu_timeout_secs=60, **kwargs)  # fmt: skip


def _stalled_rank(rank: int, group: dist.ProcessGroup, stalls: bool, timeout_s: float, hybrid: bool) -> dict:
    """Every rank dispatches and combines once; then the ranks where `stalls` sit out one dispatch
    (and call only after the others' deadline), the others go ahead. Returns what each rank raised
    and when."""
    from kernel_checks import make_inputs

    import deep_ep

    num_experts = 8 * group.size()
    buf = node_buffer(group, timeout_s, hybrid)
    x, topk_idx, weights, _ = make_inputs(rank, group.size(), 100, NODE_HIDDEN, "bf16", num_experts, 8, "uniform", 0.0,
                                          0, 11, "cuda")  # fmt: skip
    out = buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts)
    buf.combine(torch.ones((out[3].num_recv_tokens, NODE_HIDDEN), dtype=torch.bfloat16, device="cuda"), out[3])
    torch.cuda.current_stream().synchronize()
    dist.barrier(group=group)
    outcome: dict = {}
    started = time.monotonic()
    if stalls:
        time.sleep(3 * timeout_s)
    try:
        buf.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts)
        buf.barrier()
        outcome["error"] = None
    except deep_ep.EPTimeoutError as error:
        outcome["error"] = str(error)
    outcome["raised_s"] = time.monotonic() - started
    buf.destroy()
    return outcome


def stalled_node_rank(rank: int, group: dist.ProcessGroup, stalled_node: int, num_ranks_per_node: int,
                      timeout_s: float) -> dict:  # fmt: skip
    """Direct mode: the ranks of `stalled_node` sit out one dispatch (`_stalled_rank`)."""
    return _stalled_rank(rank, group, rank // num_ranks_per_node == stalled_node, timeout_s, False)


def stalled_forwarder_rank(rank: int, group: dist.ProcessGroup, stalled: int, timeout_s: float) -> dict:
    """Hybrid mode: rank `stalled` alone, a forwarder for the other nodes' ranks of its local index,
    sits out one dispatch (`_stalled_rank`)."""
    return _stalled_rank(rank, group, rank == stalled, timeout_s, True)


def mistake_rank(rank: int, group: dist.ProcessGroup, seed: int, num_rounds: int) -> int:
    """Dispatch (fresh and cached) and combine `num_rounds` times with new data on the kernels and
    the reference, checked bitwise (raises `AssertionError`, or the kernels' error, at the first
    difference); few SMs, so that a warp stages many rows. Returns the rounds checked."""
    from kernel_checks import check_dispatch, equal, make_inputs
    from sweep import wide_bf16

    import deep_ep

    num_ranks = group.size()
    hidden, num_topk, num_experts, num_tokens = NODE_HIDDEN, 8, 8 * num_ranks, 120
    buffers = [deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=hidden, num_topk=num_topk,
                                     allow_hybrid_mode=False, backend=backend, explicitly_destroy=True,
                                     num_gpu_timeout_secs=10) for backend in ("kernels", "reference")]  # fmt: skip
    kernels, reference = buffers
    try:
        for round_idx in range(num_rounds):
            x, topk_idx, weights, _ = make_inputs(rank, num_ranks, num_tokens, hidden, "bf16", num_experts, num_topk,
                                                  "uniform", 0.0, 0, seed + round_idx, "cuda")  # fmt: skip
            kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts)
            out_k = kernels.dispatch(x, num_sms=2, **kwargs)
            out_r = reference.dispatch(x, **kwargs)
            handle = check_dispatch(out_k, out_r, False, False, f"round {round_idx}, fresh dispatch")
            x2 = make_inputs(rank, num_ranks, num_tokens, hidden, "bf16", num_experts, num_topk, "uniform", 0.0, 0,
                             seed + 500 + round_idx, "cuda")[0]  # fmt: skip
            check_dispatch(kernels.dispatch(x2, handle=out_k[3], num_sms=2), reference.dispatch(x2, handle=out_r[3]),
                           False, False, f"round {round_idx}, cached dispatch")  # fmt: skip
            gen = torch.Generator().manual_seed(seed * 31 + round_idx * 7 + rank)
            y = wide_bf16((handle.num_recv_tokens, hidden), gen, "cuda")
            equal(kernels.combine(y, out_k[3], num_sms=2)[0], reference.combine(y, out_r[3])[0],
                  f"round {round_idx}, combined_x")  # fmt: skip
    finally:
        for buffer in buffers:
            buffer.destroy()
    return num_rounds


def node_test_specs() -> list:
    """Every kernel specialisation the virtual-node GPU tests launch, over both NIC modes: the sweep's
    (`NODE_SHAPES`: the graph replays and the stalled node use its 8-rank shape), the protocol
    mistakes' (4 ranks, hidden 2560, top-8, BF16; strict NIC) and hybrid mode's fresh dispatch."""
    from kernel_checks import row_bytes
    from sweep import NODE_LOCAL_EXPERTS, NODE_SHAPES, kernel_specs

    from deep_ep.backends.kernels import specs as kernels

    found = []
    for mode in ("eager", "strict"):
        found += [spec for n in NODE_SHAPES for spec in kernel_specs(n, f"emulated-{mode}", NODE_SHAPES,
                                                                        NODE_LOCAL_EXPERTS)]  # fmt: skip
    transport, shape = "emulated-strict", (4, *row_bytes("bf16", NODE_HIDDEN), 8)
    found += [kernels.barrier_spec(4, transport), kernels.post_fault_spec(transport)]
    found += [kernels.dispatch_spec(*shape, cached, False, transport) for cached in (False, True)]
    found += [kernels.dispatch_epilogue_spec(*shape, False, False, transport)]
    found += [kernels.combine_spec(4, NODE_HIDDEN, 8, 1, False, False, transport),
              kernels.combine_epilogue_spec(4, NODE_HIDDEN, 8, 1, False, transport)]  # fmt: skip
    # Hybrid mode's dispatches (fresh and cached), its forwarding combines (plain and expanded) and
    # node-stage epilogue, the BF16 shape of each world size, both NIC modes (the hybrid sweep's other
    # dtypes differ only in the scales' bytes; CI's time keeps them out)
    for num_ranks, ((hidden, num_topk, _),) in NODE_SHAPES.items():
        found += [kernels.dispatch_spec(num_ranks, *row_bytes("bf16", hidden), num_topk, cached, False,
                                        f"hybrid-emulated-{mode}") for mode in ("eager", "strict")
                  for cached in (False, True)]  # fmt: skip
        found += [kernels.combine_epilogue_spec(num_ranks, hidden, num_topk, 1, False, f"hybrid-emulated-{mode}")
                  for mode in ("eager", "strict")]  # fmt: skip
        found += [kernels.combine_spec(num_ranks, hidden, num_topk, 1, expand, False, f"hybrid-emulated-{mode}")
                  for mode in ("eager", "strict") for expand in (False, True)]  # fmt: skip
    # The combine's lane slots (fewer lanes than ranks per node: top-4 on 2 x 8), plain layout
    hidden = NODE_SHAPES[16][0][0]
    found += [spec for mode in ("eager", "strict") for spec in (
        kernels.combine_spec(16, hidden, 4, 1, False, False, f"hybrid-lanes-emulated-{mode}"),
        kernels.combine_epilogue_spec(16, hidden, 4, 1, False, f"hybrid-lanes-emulated-{mode}"))]  # fmt: skip
    return list(dict.fromkeys(found))


def forward_slots(topk_rows: list[list[int]], num_local_experts: int, num_ranks_per_node: int,
                  num_nodes: int) -> list[list[int]]:  # fmt: skip
    """Hybrid mode's forward slot of each token per node, by counting in token order: its index among
    the tokens with an expert on one of the node's ranks, -1 where it has none."""
    counts, slots = [0] * num_nodes, []
    for row in topk_rows:
        nodes = {e // num_local_experts // num_ranks_per_node for e in row if e >= 0}
        slots.append([counts[n] if n in nodes else -1 for n in range(num_nodes)])
        for n in nodes:
            counts[n] += 1
    return slots


def hot_node_routing(num_tokens: int, num_experts: int, num_topk: int, num_node_experts: int, hot_node: int,
                     gen: torch.Generator) -> torch.Tensor:  # fmt: skip
    """`[num_tokens, num_topk]` int64 expert ids: half the tokens (at random) take all their experts
    on `hot_node` (`num_node_experts` experts per node), the others any experts."""
    rows = []
    for _ in range(num_tokens):
        if torch.rand((), generator=gen) < 0.5:
            row = hot_node * num_node_experts + torch.randperm(num_node_experts, generator=gen)[:num_topk]
        else:
            row = torch.randperm(num_experts, generator=gen)[:num_topk]
        rows.append(row)
    return torch.stack(rows) if rows else torch.empty((0, num_topk), dtype=torch.int64)


def expected_nic_bytes(topk_rows: list[list[int]], num_local_experts: int, num_ranks: int, num_ranks_per_node: int,
                       rank: int, record_bytes: int) -> tuple[int, int]:  # fmt: skip
    """`(bytes, puts)` a hybrid fresh dispatch of `rank` hands to the NIC: per (token, remote node it
    goes to) its forward record (record and header, two puts), per remote rank its per-expert counts."""
    node = rank // num_ranks_per_node
    header = -(-4 * num_ranks_per_node // 16) * 16
    slots = forward_slots(topk_rows, num_local_experts, num_ranks_per_node, num_ranks // num_ranks_per_node)
    remote_node_hits = sum(1 for row in slots for n, slot in enumerate(row) if slot >= 0 and n != node)
    num_remote_ranks = num_ranks - num_ranks_per_node
    count_bytes = -(-4 * num_local_experts // 16) * 16
    return (remote_node_hits * (record_bytes + header) + num_remote_ranks * count_bytes,
            2 * remote_node_hits + num_remote_ranks)  # fmt: skip


def expected_partials(topk_rows_of: list[list[list[int]]], num_local_experts: int, num_ranks_per_node: int,
                      rank: int) -> int:  # fmt: skip
    """The partials a hybrid combine of `rank` puts to the NIC (`topk_rows_of`: every rank's routing of
    the dispatch): one per token of each of its rail peers in other nodes that has an expert in its node."""
    node, local = divmod(rank, num_ranks_per_node)
    num_nodes = len(topk_rows_of) // num_ranks_per_node
    return sum(
        1
        for m in range(num_nodes) if m != node
        for row in topk_rows_of[m * num_ranks_per_node + local]
        if any(e >= 0 and e // num_local_experts // num_ranks_per_node == node for e in row)
    )  # fmt: skip


def hybrid_rank(rank: int, group: dist.ProcessGroup, num_ranks_per_node: int, seed: int,
                num_topk: int | None = None) -> int:  # fmt: skip
    """Hybrid mode on the kernels (`allow_hybrid_mode`, without multiple reduction): fresh dispatches
    (CPU sync or not; uniform, masked or hot-node routing) that send each token once per remote node
    to its forwarder, each checked against the reference bitwise, its forward slots against
    `forward_slots` and what it handed to the NIC against `expected_nic_bytes`; then a cached dispatch
    and a combine of its handle, bitwise, whose NIC took one partial per (token, remote node) that
    this rank forwarded (`expected_partials`), after a second fresh dispatch of other routing (the
    forwarders' map is the handle's, not the window's), whose combine follows. `num_topk` (default:
    the sweep's shape) below the ranks per node takes the combine's lane slots (combine_forward.cuh).
    Returns the rounds checked."""
    from kernel_checks import check_dispatch, make_inputs
    from sweep import NODE_SHAPES

    import deep_ep
    from deep_ep.host_reads import wait_for_stream
    from deep_ep.records import CombineSlotLayout, DispatchRecordLayout

    num_ranks = group.size()
    num_nodes, (hidden, shape_topk, _) = num_ranks // num_ranks_per_node, NODE_SHAPES[num_ranks][0]
    num_topk = num_topk or shape_topk
    num_local_experts, num_max_tokens = 8, 128
    num_experts = num_local_experts * num_ranks
    buffers = [deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=num_max_tokens, hidden=hidden, num_topk=num_topk,
                                     allow_hybrid_mode=True, allow_multiple_reduction=False, backend=backend,
                                     explicitly_destroy=True, num_gpu_timeout_secs=10)
               for backend in ("kernels", "reference")]  # fmt: skip
    kernels, reference = buffers
    assert kernels.backend.runtime.num_hybrid_nodes == num_nodes, kernels.backend.runtime.num_hybrid_nodes
    links = kernels.backend.runtime.links
    record_bytes = DispatchRecordLayout(2 * hidden, 0, num_topk).num_bytes
    rounds = [(cpu_sync, routing, masked) for cpu_sync in (True, False) for routing, masked in
              (("uniform", 0.0), ("uniform", 0.25), ("hot node", 0.0))]  # fmt: skip
    try:
        for round_idx, (cpu_sync, routing, masked) in enumerate(rounds):
            num_tokens = [0, 1, 77, num_max_tokens][(rank + round_idx) % 4]
            x, topk_idx, weights, _ = make_inputs(rank, num_ranks, num_tokens, hidden, "bf16", num_experts, num_topk,
                                                  "uniform", masked, 0, seed + round_idx, "cuda")  # fmt: skip
            if routing == "hot node":
                gen = torch.Generator().manual_seed(seed * 31 + round_idx * 7 + rank)
                hot = hot_node_routing(num_tokens, num_experts, num_topk, num_local_experts * num_ranks_per_node,
                                       num_nodes - 1, gen)  # fmt: skip
                topk_idx = hot.to("cuda")
            kwargs = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=num_experts,
                          num_max_tokens_per_rank=num_max_tokens, do_cpu_sync=cpu_sync)  # fmt: skip
            what = f"round {round_idx} (cpu_sync={cpu_sync}, {routing}, masked {masked}, {num_tokens} tokens)"
            wait_for_stream()
            before = links.traffic()
            out_k = kernels.dispatch(x, **kwargs)
            wait_for_stream()
            after = links.traffic()
            out_r = reference.dispatch(x, **kwargs)
            handle = check_dispatch(out_k, out_r, False, False, f"{what} fresh dispatch")
            rows = topk_idx.tolist()
            got = handle.backend_state.node_slot_idx.tolist()
            expected = forward_slots(rows, num_local_experts, num_ranks_per_node, num_nodes)
            assert got == expected, f"{what}: forward slots {got[:4]}... != {expected[:4]}..."
            nic = (after["bytes"] - before["bytes"], after["puts"] - before["puts"])
            model = expected_nic_bytes(rows, num_local_experts, num_ranks, num_ranks_per_node, rank, record_bytes)
            assert nic == model, f"{what}: the NIC took (bytes, puts) {nic}, hybrid mode sends {model}"
            x2 = make_inputs(rank, num_ranks, num_tokens, hidden, "bf16", num_experts, num_topk, "uniform", 0.0, 0,
                             seed + 100 + round_idx, "cuda")[0]  # fmt: skip
            check_dispatch(kernels.dispatch(x2, handle=out_k[3]), reference.dispatch(x2, handle=out_r[3]), False,
                           False, f"{what} cached dispatch")  # fmt: skip
            gen = torch.Generator().manual_seed(seed * 13 + round_idx * 7 + rank)
            y = torch.randn((handle.num_recv_tokens, hidden), generator=gen).to(torch.bfloat16).to("cuda")
            rows_of: list = [None] * num_ranks
            dist.all_gather_object(rows_of, rows, group=group)
            # Another fresh dispatch (its own routing) before the first handle's combine
            x3, topk3, weights3, _ = make_inputs(rank, num_ranks, num_tokens, hidden, "bf16", num_experts, num_topk,
                                                 "uniform", 0.0, 0, seed + 200 + round_idx, "cuda")  # fmt: skip
            kwargs3 = dict(kwargs, topk_idx=topk3, topk_weights=weights3)
            out_k3, out_r3 = kernels.dispatch(x3, **kwargs3), reference.dispatch(x3, **kwargs3)
            handle3 = check_dispatch(out_k3, out_r3, False, False, f"{what} second fresh dispatch")
            wait_for_stream()
            before = links.traffic()
            got_y = kernels.combine(y, out_k[3])[0]
            wait_for_stream()
            after = links.traffic()
            want_y = reference.combine(y, out_r[3])[0]
            assert torch.equal(got_y.view(torch.int16), want_y.view(torch.int16)), f"{what}: combine differs"
            nic = (after["bytes"] - before["bytes"], after["puts"] - before["puts"])
            partials = expected_partials(rows_of, num_local_experts, num_ranks_per_node, rank)
            model = (partials * CombineSlotLayout(hidden, num_topk).num_bytes, partials)
            assert nic == model, f"{what}: the combine's NIC took (bytes, puts) {nic}, hybrid mode sends {model}"
            y3 = torch.randn((handle3.num_recv_tokens, hidden), generator=gen).to(torch.bfloat16).to("cuda")
            got_y3, want_y3 = kernels.combine(y3, out_k3[3])[0], reference.combine(y3, out_r3[3])[0]
            assert torch.equal(got_y3.view(torch.int16), want_y3.view(torch.int16)), f"{what}: second combine differs"
    finally:
        for buffer in buffers:
            buffer.destroy()
    return len(rounds)
