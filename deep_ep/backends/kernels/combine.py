"""The launch sequence of one combine on the kernels backend:

    combine (NVLink) -> combine epilogue

The epilogue is launched with programmatic dependent launch, follows the holders' arrival counters
and reduces what has landed while the rest is still on the wire; it always runs, even on a rank
with no tokens, because it posts this rank's window credit (credits.cuh). In hybrid mode with one
row per holder both kernels run over `hybrid-<transport>`: a remote node's holders send one partial
per token through their forwarder (combine_forward.cuh).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deep_ep.jit import Opaque
from deep_ep.records import (
    CombineSlotLayout,
    combine_region_bytes,
    combine_uses_lane_slots,
    hybrid_combine_region_bytes,
    hybrid_combine_uses_lane_slots,
)

from . import specs
from .dispatch import NvlinkDispatchState
from .layout import arrival_block
from .runtime import LaunchPlan, NvlinkRuntime, data_ptr, rows_per_task
from .scaleout import check_ring


def _combine_plan(runtime: NvlinkRuntime, hidden: int, num_topk: int, num_rows: int, do_expand: bool,
                  num_max_tokens_per_rank: int, num_sms: int, node_stage: bool) -> LaunchPlan:  # fmt: skip
    """The plan of a combine shape (its kernels: combine, epilogue; with `node_stage`, hybrid mode's
    forwarding combine and epilogue), made the first time it runs."""
    key = ("combine", hidden, num_topk, num_rows, do_expand, num_max_tokens_per_rank, num_sms, node_stage)
    plan = runtime.plans.get(key)
    if plan is not None:
        return plan
    slot = CombineSlotLayout(hidden, num_topk)
    transport = runtime.transport_kind
    if node_stage:
        num_nodes = runtime.num_hybrid_nodes
        lane_slots = hybrid_combine_uses_lane_slots(runtime.num_ranks, num_nodes, num_topk)
        region_bytes = hybrid_combine_region_bytes(runtime.num_ranks, num_nodes, num_max_tokens_per_rank, hidden,
                                                   num_topk)  # fmt: skip
        per_token = f"{num_topk} lanes x {num_nodes} nodes" if lane_slots else f"{runtime.num_ranks} ranks"
        slots = f"({per_token} + {num_nodes} node partials)"
        transport = f"hybrid-{'lanes-' if lane_slots else ''}{transport}"
    else:
        lane_slots = combine_uses_lane_slots(runtime.num_ranks, num_topk, num_rows)
        region_bytes = combine_region_bytes(runtime.num_ranks, num_max_tokens_per_rank, hidden, num_topk, num_rows)
        slots = f"{num_topk} lanes" if lane_slots else f"{runtime.num_ranks} ranks"
    runtime.check_capacity(region_bytes, "combine",
                           lambda: f"{num_max_tokens_per_rank} tokens x {slots} x {slot.num_bytes} bytes")  # fmt: skip
    grid = runtime.comm_grid(num_sms)
    if runtime.scaleout is not None:  # staging entries for a slot's rows to a remote source
        check_ring(runtime.scaleout.ring_bytes, grid, slot.num_bytes, num_rows if do_expand else 1, "combine")
    masking = runtime.rank_masking
    kernels = runtime.share.load([
        specs.combine_spec(runtime.num_ranks, hidden, num_topk, num_rows, do_expand, masking, transport),
        specs.combine_epilogue_spec(runtime.num_ranks, hidden, num_topk, num_rows, masking, transport),
    ])  # fmt: skip
    plan = LaunchPlan(kernels, grid,
                      specs.op_hash("combine", num_max_tokens_per_rank, slot.num_bytes, num_topk),
                      arrival_block(num_max_tokens_per_rank))  # fmt: skip
    runtime.plans[key] = plan
    return plan


def run_combine(
    runtime: NvlinkRuntime,
    stream: torch.cuda.Stream,
    x: torch.Tensor,
    topk_weights: torch.Tensor | None,
    bias_0: torch.Tensor | None,
    bias_1: torch.Tensor | None,
    topk_idx: torch.Tensor,
    recv_src_metadata: torch.Tensor,
    psum_num_recv_tokens_per_rank: torch.Tensor,
    state: NvlinkDispatchState,
    num_experts: int,
    num_max_tokens_per_rank: int,
    num_sms: int,
    do_expand: bool,
    allow_multiple_reduction: bool,
    before_epilogue: Callable[[], None] | None = None,
    num_qps: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run one combine of `runtime`'s buffer on `stream`.

    Arguments:
        runtime: the buffer's runtime (windows, error block, share of the GPU).
        stream: the stream both kernels go on (the current one).
        x: `[rows, hidden]` BF16 (rows of the dispatch's `recv_x`).
        topk_weights: `[rows, num_topk]` (plain) or `[rows]` (expanded) float32, or None.
        bias_0, bias_1: `[num_tokens, hidden]` BF16, or None.
        topk_idx: the dispatching rank's `[num_tokens, num_topk]` int64 routing (from the handle).
        recv_src_metadata: `[meta rows, 2 + num_topk]` int32 (from the handle).
        psum_num_recv_tokens_per_rank: `[num_ranks]` int32 (from the handle).
        before_epilogue: called right before the epilogue is launched (it may make `stream` wait).
        num_qps: the queue pairs (GIN contexts) the kernels' warps take in turn (`0`: every one the
            buffer has); other transports have none.

    Returns:
        combined_x: `[num_tokens, hidden]` BF16.
        combined_topk_weights: `[num_tokens, num_topk]` float32, or None.
    """
    runtime.check_error()
    num_tokens, num_topk = topk_idx.shape
    hidden = x.shape[1]
    num_local_experts = num_experts // runtime.num_ranks
    per_lane = do_expand and not allow_multiple_reduction
    num_rows = min(num_topk, num_local_experts) if per_lane else 1
    # Hybrid mode's node stage, but where every lane's row travels alone (docs/semantics.md: also with
    # one local expert, whose single row per holder is still a lane's)
    node_stage = runtime.num_hybrid_nodes > 0 and not per_lane
    plan = _combine_plan(runtime, hidden, num_topk, num_rows, do_expand, num_max_tokens_per_rank, num_sms,
                         node_stage)  # fmt: skip
    (combine_kernel, epilogue_kernel), num_sms = plan.kernels, plan.num_sms
    op_hash, arrival_slots = plan.op_hash, plan.arrival_slots
    empty = runtime.empty
    combined_x = empty((num_tokens, hidden), dtype=torch.bfloat16, device=x.device)
    combined_w = None
    if topk_weights is not None:
        combined_w = empty((num_tokens, num_topk), dtype=torch.float32, device=x.device)

    combine_args = specs.CombineArgs(
        window_base=runtime.windows.ptr, x=data_ptr(x), topk_weights=data_ptr(topk_weights),
        recv_src_metadata=data_ptr(recv_src_metadata),
        psum_num_recv_tokens_per_rank=data_ptr(psum_num_recv_tokens_per_rank), num_x_rows=x.shape[0],
        num_meta_rows=recv_src_metadata.shape[0], num_max_tokens_per_rank=num_max_tokens_per_rank,
        rank=runtime.rank, rows_per_task=rows_per_task(num_tokens * runtime.num_ranks, num_sms, 2),
        arrival_block=arrival_slots, op_hash=op_hash, error_block=data_ptr(runtime.error_block),
        timeout_ns=runtime.timeout_ns, forward_map=data_ptr(state.forward_map) if node_stage else 0,
        forward_counts=data_ptr(state.forward_counts) if node_stage else 0)  # fmt: skip
    runtime.launch(combine_kernel, grid=(num_sms + runtime.nic_ctas,), block=(specs.NUM_THREADS,), stream=stream,
                   args=(Opaque(bytes(combine_args)), Opaque(runtime.links.args("comm", num_qps))))  # fmt: skip
    try:
        # Always, even with no tokens here: the epilogue posts our window credit (credits.cuh)
        epilogue_args = specs.CombineEpilogueArgs(
            window_base=runtime.windows.ptr, topk_idx=data_ptr(topk_idx), slot_idx=data_ptr(state.slot_idx),
            bias_0=data_ptr(bias_0), bias_1=data_ptr(bias_1), combined_x=data_ptr(combined_x),
            combined_topk_weights=data_ptr(combined_w), local_x=0 if do_expand else data_ptr(x),
            local_topk_weights=0 if do_expand else data_ptr(topk_weights),
            psum_num_recv_tokens_per_rank=data_ptr(psum_num_recv_tokens_per_rank),
            num_tokens_per_rank=data_ptr(state.num_tokens_per_rank), num_local_rows=x.shape[0],
            num_tokens=num_tokens, num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_experts_per_rank=num_local_experts, rank=runtime.rank, arrival_block=arrival_slots, op_hash=op_hash,
            error_block=data_ptr(runtime.error_block), timeout_ns=runtime.timeout_ns,
            num_ranks_per_node=runtime.num_scaleup_ranks,
            node_slot_idx=data_ptr(state.node_slot_idx) if node_stage else 0,
            num_tokens_per_node=data_ptr(state.num_tokens_per_node) if node_stage else 0,
            forward_counts=data_ptr(state.forward_counts) if node_stage else 0)  # fmt: skip
        grid = runtime.grid_for_rows(num_tokens * ((hidden + 1023) // 1024), num_sms)  # (token, 1024-wide part) items
        if before_epilogue is not None:
            before_epilogue()
        runtime.launch(epilogue_kernel, grid=(grid + runtime.nic_ctas,), block=(specs.NUM_THREADS,), stream=stream,
                       args=(Opaque(bytes(epilogue_args)), Opaque(runtime.links.args("epilogue", num_qps))),
                       pdl=True)  # fmt: skip
    except BaseException as error:
        runtime.fail_between_launches("combine", error)
        raise
    runtime.take_input_error()
    return combined_x, combined_w
