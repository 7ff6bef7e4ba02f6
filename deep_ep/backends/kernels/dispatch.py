"""The launch sequence of one dispatch on the kernels backend:

    fresh:  dispatch (layout + NVLink + counts) -> [expand ranks] -> [host waits for counts] -> epilogue
    cached: dispatch (NVLink) -> epilogue            (slots and counts from the handle)

The epilogue is launched with programmatic dependent launch and follows the senders' arrival
counters, so it runs while the data is still on the wire. Without CPU sync nothing waits on the
host, so the sequence can be captured in a CUDA graph. Every kernel is loaded, and every output
whose shape is known allocated, before the first launch (see `deep_ep.backends.kernels.runtime`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deep_ep.backends.base import check_topk_idx_values, worst_case_num_expanded_tokens
from deep_ep.jit import I32, U64, Opaque
from deep_ep.records import DispatchRecordLayout, dispatch_region_bytes, forward_region_bytes
from deep_ep.utils.math import align

from . import specs
from .layout import arrival_block, tokens_per_group
from .runtime import LaunchPlan, NvlinkRuntime, data_ptr, rows_per_task
from .scaleout import check_staging, dispatch_staging_bytes


@dataclass
class NvlinkDispatchState:
    """What a handle keeps for combine and cached dispatch (device tensors, no host sync needed)."""

    slot_idx: torch.Tensor  # [num_tokens, num_ranks] int32, -1 where the token skips a rank
    num_tokens_per_rank: torch.Tensor  # [num_ranks] int32, tokens sent to each rank
    num_out_rows: int  # rows of recv_x (exact with CPU sync, worst case without)
    num_meta_rows: int  # rows of recv_src_metadata
    num_expanded_rows: int  # rows of the expanded layout (reported in both modes)
    # Hybrid mode: [num_tokens, num_nodes] int32, each token's forward slot per node (-1: none), and
    # [num_nodes] int32, the tokens sent to each node; else None
    node_slot_idx: torch.Tensor | None = None
    num_tokens_per_node: torch.Tensor | None = None
    # Hybrid mode, what this rank relayed as a forwarder (combine_forward.cuh), for the combine's
    # partials: [num_nodes, num_max_tokens_per_rank, num_topk + 1] int32, per forwarded token and lane
    # the local holder and its slot, then the token's index at its source, and [num_nodes,
    # num_ranks_per_node + 1] int32, the sources' token counts for our node's ranks and their forward
    # records; else None
    forward_map: torch.Tensor | None = None
    forward_counts: torch.Tensor | None = None


def _dispatch_outputs(
    runtime: NvlinkRuntime, num_out_rows: int, x: torch.Tensor, x_scales: torch.Tensor | None, num_topk: int,
    has_weights: bool, do_expand: bool, col_major_scales: bool, num_local_experts: int, fresh: bool,
) -> dict:  # fmt: skip
    """The output tensors of one dispatch with `num_out_rows` rows (exact or worst case); the handle's
    prefix sums only in a fresh dispatch (a cached one has its handle's)."""
    empty, device = runtime.empty, x.device
    out: dict[str, Any] = {"recv_x": empty((num_out_rows, x.shape[1]), dtype=x.dtype, device=device, rows="out")}
    out["recv_scales"], out["scale_col_stride"] = None, 0
    if x_scales is not None:
        num_scales = x_scales.shape[1]
        if col_major_scales:
            out["scale_col_stride"] = align(num_out_rows, 4)
            storage = empty((num_scales * out["scale_col_stride"],), dtype=x_scales.dtype, device=device)
            out["recv_scales"] = storage.as_strided((num_out_rows, num_scales), (1, out["scale_col_stride"]))
        else:
            out["recv_scales"] = empty((num_out_rows, num_scales), dtype=x_scales.dtype, device=device, rows="out")
    out["recv_topk_idx"] = (
        None if do_expand else empty((num_out_rows, num_topk), dtype=torch.int64, device=device, rows="out")
    )
    out["recv_topk_weights"] = None
    if has_weights:
        shape = (num_out_rows,) if do_expand else (num_out_rows, num_topk)
        out["recv_topk_weights"] = empty(shape, dtype=torch.float32, device=device, rows="out")
    out["psum_num_recv_tokens_per_rank"] = out["psum_num_recv_tokens_per_expert"] = None
    if fresh:
        out["psum_num_recv_tokens_per_rank"] = empty((runtime.num_ranks,), dtype=torch.int32, device=device)
        out["psum_num_recv_tokens_per_expert"] = empty((num_local_experts,), dtype=torch.int32, device=device)
    return out


def _dispatch_plan(runtime: NvlinkRuntime, hidden_bytes: int, scale_bytes: int, num_topk: int,
                   num_max_tokens_per_rank: int, fresh: bool, do_expand: bool, num_sms: int) -> LaunchPlan:  # fmt: skip
    """The plan of a dispatch shape, made (capacity checked, kernels loaded) the first time it runs."""
    hybrid = runtime.num_hybrid_nodes > 0
    key = ("dispatch", hidden_bytes, scale_bytes, num_topk, num_max_tokens_per_rank, fresh, do_expand, num_sms, hybrid)
    plan = runtime.plans.get(key)
    if plan is not None:
        return plan
    record = DispatchRecordLayout(hidden_bytes, scale_bytes, num_topk)
    region_bytes = dispatch_region_bytes(runtime.num_ranks, num_max_tokens_per_rank, record.num_bytes)
    num_nodes = runtime.num_hybrid_nodes
    forwarded = ""
    if hybrid:  # the forward records of the other nodes' sources follow the records (forward.cuh)
        region_bytes += forward_region_bytes(num_nodes, runtime.num_scaleup_ranks, num_max_tokens_per_rank,
                                             record.num_bytes)  # fmt: skip
        forwarded = f" + {num_max_tokens_per_rank} tokens x {num_nodes - 1} nodes x (record + header) forwarded"
    runtime.check_capacity(
        region_bytes,
        "dispatch",
        lambda: f"{num_max_tokens_per_rank} tokens x {runtime.num_ranks} ranks x {record.num_bytes} bytes{forwarded}",
    )
    args_common = (runtime.num_ranks, hidden_bytes, scale_bytes, num_topk)
    masking, transport = runtime.rank_masking, runtime.transport_kind
    grid = runtime.comm_grid(num_sms)
    if runtime.scaleout is not None:  # every token's record staged at its own place for remote destinations
        staged = dispatch_staging_bytes(num_max_tokens_per_rank, record.num_bytes, num_nodes, runtime.num_scaleup_ranks)
        check_staging(runtime.scaleout.ring_bytes, staged, "dispatch (hybrid mode)" if hybrid else "dispatch")
    kernel_specs = [
        specs.dispatch_spec(*args_common, not fresh, masking, f"hybrid-{transport}" if hybrid else transport)
    ]
    if fresh and do_expand:
        kernel_specs.append(specs.dispatch_expand_rank_spec(*args_common, masking, transport))
    kernel_specs.append(specs.dispatch_epilogue_spec(*args_common, do_expand, masking, transport))
    plan = LaunchPlan(runtime.share.load(kernel_specs), grid,
                      specs.op_hash("dispatch", num_max_tokens_per_rank, record.num_bytes, num_topk),
                      arrival_block(num_max_tokens_per_rank))  # fmt: skip
    runtime.plans[key] = plan
    return plan


def run_dispatch(
    runtime: NvlinkRuntime,
    stream: torch.cuda.Stream,
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_experts: int,
    num_max_tokens_per_rank: int,
    expert_alignment: int,
    num_sms: int,
    do_cpu_sync: bool,
    do_expand: bool,
    do_zero_padding: bool,
    use_tma_aligned_col_major_sf: bool,
    cumulative_stats: torch.Tensor | None,
    cached: NvlinkDispatchState | None,
    cached_num_recv_tokens_per_expert: torch.Tensor | None = None,
    cached_recv_src_metadata: torch.Tensor | None = None,
    before_epilogue: Callable[[], None] | None = None,
    num_qps: int = 0,
    do_handle_copy: bool = False,
) -> dict:
    """Run one dispatch of `runtime`'s buffer on `stream`; returns the output tensors and the new handle state.

    Arguments:
        runtime: the buffer's runtime (windows, error block, count blocks, share of the GPU).
        stream: the stream every kernel of the dispatch goes on (the current one).
        x: `[num_tokens, hidden]` of any dtype (raw bytes, rows a multiple of 16 bytes), with or without `x_scales`.
        x_scales: `[num_tokens, num_scales]` float32 or int32 (any pack count and strides), or None.
        topk_idx: `[num_tokens, num_topk]` int64 global expert ids, -1 for none.
        topk_weights: `[num_tokens, num_topk]` float32, or None.
        cumulative_stats: `[num_local_experts]` int32, incremented in place, or None.
        cached: the state of a previous dispatch with the same routing, or None.
        before_epilogue: called right before the epilogue is launched (it may make `stream` wait).
        num_qps: the queue pairs (GIN contexts) the kernels' warps take in turn (`0`: every one the
            buffer has); other transports have none.
        do_handle_copy: a fresh dispatch's kernel also copies `topk_idx` for the handle (`topk_idx_copy`).

    Returns:
        A dict of `recv_x`, `recv_scales`, `recv_topk_idx`, `recv_topk_weights`,
        `recv_src_metadata`, `psum_num_recv_tokens_per_rank`, `num_recv_tokens_per_expert`,
        `psum_num_recv_tokens_per_expert` (both prefix sums None in a cached dispatch: the handle has
        them), `num_recv_tokens_per_expert_host` (list or None),
        `num_recv_tokens` (int), `num_out_rows` (int), `dst_slot_idx`, `num_masked_lanes` (`[1]` int32,
        fresh dispatches of a buffer with rank masking, else None), `topk_idx_copy` (`[num_tokens, num_topk]`
        int64 with `do_handle_copy` in a fresh dispatch, else None) and `state`.
    """
    runtime.check_error()
    num_tokens, num_topk = topk_idx.shape
    hidden_bytes = x.shape[1] * x.element_size()
    scale_bytes = 0 if x_scales is None else x_scales.shape[1] * 4
    num_local_experts = num_experts // runtime.num_ranks
    device = x.device
    fresh = cached is None
    expand_ranks = fresh and do_expand
    masking = runtime.rank_masking
    plan = _dispatch_plan(runtime, hidden_bytes, scale_bytes, num_topk, num_max_tokens_per_rank, fresh, do_expand,
                          num_sms)  # fmt: skip
    loaded, num_sms, op_hash, arrival_slots = plan.kernels, plan.num_sms, plan.op_hash, plan.arrival_slots
    dispatch_kernel, epilogue_kernel = loaded[0], loaded[-1]
    max_recv = runtime.num_ranks * num_max_tokens_per_rank
    empty = runtime.empty

    counts_list, expand_scratch, dst_slot_idx, num_masked_lanes, topk_idx_copy = None, None, None, None, None
    node_slot_idx = num_tokens_per_node = forward_map = forward_counts = None
    num_nodes = runtime.num_hybrid_nodes
    if fresh and masking:
        num_masked_lanes = empty((1,), dtype=torch.int32, device=device)  # written by the dispatch kernel
    if fresh:
        slot_idx = empty((num_tokens, runtime.num_ranks), dtype=torch.int32, device=device)
        dst_slot_idx = empty((num_tokens, num_topk), dtype=torch.int32, device=device)
        if do_handle_copy:  # written by the dispatch kernel, which reads every row anyway
            topk_idx_copy = empty((num_tokens, num_topk), dtype=torch.int64, device=device)
        num_tokens_per_rank = empty((runtime.num_ranks,), dtype=torch.int32, device=device)
        num_recv_per_expert = empty((num_local_experts,), dtype=torch.int32, device=device)
        if num_nodes:
            node_slot_idx = empty((num_tokens, num_nodes), dtype=torch.int32, device=device)
            num_tokens_per_node = empty((num_nodes,), dtype=torch.int32, device=device)
            forward_map = empty((num_nodes, num_max_tokens_per_rank, num_topk + 1), dtype=torch.int32, device=device)
            forward_counts = empty((num_nodes, runtime.num_scaleup_ranks + 1), dtype=torch.int32, device=device)
        if expand_ranks:
            expand_scratch = runtime.expand_rank_scratch(max_recv * num_topk)
        runtime.num_experts_checked = num_experts
    else:
        slot_idx, num_tokens_per_rank = cached.slot_idx, cached.num_tokens_per_rank
        node_slot_idx, num_tokens_per_node = cached.node_slot_idx, cached.num_tokens_per_node
        forward_map, forward_counts = cached.forward_map, cached.forward_counts
        num_recv_per_expert = cached_num_recv_tokens_per_expert
        if cumulative_stats is not None:
            cumulative_stats.add_(num_recv_per_expert)

    # Without a host wait every shape is known now: allocate before the first launch
    state = outputs = recv_src_metadata = None
    if not fresh:
        state, recv_src_metadata = cached, cached_recv_src_metadata
    elif not do_cpu_sync:
        num_expanded_rows = worst_case_num_expanded_tokens(
            runtime.num_ranks, num_max_tokens_per_rank, num_topk, num_local_experts, expert_alignment
        )
        num_out_rows = num_expanded_rows if do_expand else max_recv
        state = NvlinkDispatchState(slot_idx, num_tokens_per_rank, num_out_rows, max_recv, num_expanded_rows,
                                    node_slot_idx, num_tokens_per_node, forward_map, forward_counts)  # fmt: skip
        recv_src_metadata = empty((max_recv, 2 + num_topk), dtype=torch.int32, device=device)
    if state is not None:
        outputs = _dispatch_outputs(runtime, state.num_out_rows, x, x_scales, num_topk, topk_weights is not None,
                                    do_expand, use_tma_aligned_col_major_sf, num_local_experts, fresh)  # fmt: skip

    counts_sequence = runtime.next_counts_sequence() if state is None else 0  # CPU sync: counts to the host
    dispatch_args = specs.DispatchArgs(
        window_base=runtime.windows.ptr, x=data_ptr(x), x_scales=data_ptr(x_scales), topk_idx=data_ptr(topk_idx),
        topk_idx_copy=data_ptr(topk_idx_copy), topk_weights=data_ptr(topk_weights), slot_idx=data_ptr(slot_idx),
        dst_slot_idx=data_ptr(dst_slot_idx),
        layout_scratch=data_ptr(runtime.dispatch_scratch), num_tokens_per_rank=data_ptr(num_tokens_per_rank),
        num_recv_tokens_per_expert=data_ptr(num_recv_per_expert),
        counts_out=data_ptr(runtime.host_counts) if counts_sequence else 0,
        cumulative_stats=data_ptr(cumulative_stats) if fresh else 0, num_masked_lanes=data_ptr(num_masked_lanes),
        num_tokens=num_tokens,
        num_max_tokens_per_rank=num_max_tokens_per_rank, rank=runtime.rank, num_experts_per_rank=num_local_experts,
        tokens_per_group=tokens_per_group(num_tokens, runtime.num_ranks + num_nodes),
        tokens_per_task=rows_per_task(num_tokens, num_sms, 4), arrival_block=arrival_slots, op_hash=op_hash,
        error_block=data_ptr(runtime.error_block), timeout_ns=runtime.timeout_ns,
        counts_ready=data_ptr(runtime.counts_ready) if counts_sequence else 0,
        counts_sequence=counts_sequence, counts_before_sends=int(not runtime.mask_on_timeout),
        node_slot_idx=data_ptr(node_slot_idx), num_hybrid_nodes=num_nodes,
        num_tokens_per_node=data_ptr(num_tokens_per_node), forward_map=data_ptr(forward_map) if fresh else 0,
        forward_counts=data_ptr(forward_counts) if fresh else 0)  # fmt: skip
    # A fresh dispatch's grid barrier needs every CTA resident at once: a cooperative launch
    # makes the driver guarantee it (or refuse), whatever else holds SMs (an emulated NIC's CTA too)
    runtime.launch(dispatch_kernel, grid=(num_sms + runtime.nic_ctas,), block=(specs.NUM_THREADS,), stream=stream,
                   args=(Opaque(bytes(dispatch_args)), Opaque(runtime.links.args("comm", num_qps))),
                   cooperative=fresh)  # fmt: skip

    rejected = False
    try:
        if expand_ranks:
            num_grid_sms = num_sms if runtime.share.exclusive else runtime.num_device_sms
            expand_grid = max(1, min(num_local_experts, num_grid_sms))
            runtime.launch(
                loaded[1],
                grid=(expand_grid,), block=(specs.NUM_EXPAND_RANK_THREADS,), stream=stream,
                args=(U64(runtime.windows.ptr), I32(num_max_tokens_per_rank), I32(runtime.rank),
                      I32(num_local_experts), U64(data_ptr(expand_scratch)), I32(arrival_slots), I32(op_hash),
                      U64(data_ptr(runtime.error_block)), U64(runtime.timeout_ns)))  # fmt: skip
        if state is None:
            num_words = runtime.num_ranks + num_local_experts + 1
            if runtime.recorder is not None:  # what a replay does with rejected routing
                runtime.recorder.drain = functools.partial(_drain_dispatch, runtime, epilogue_kernel, stream,
                                                           num_max_tokens_per_rank, num_local_experts, arrival_slots,
                                                           op_hash)  # fmt: skip
            runtime.wait_counts(stream, counts_sequence)
            counts = runtime.read_counts(num_words)
            if counts[-1]:
                # Our routing was rejected on the device (nothing sent), but peers sent us theirs
                _drain_dispatch(runtime, epilogue_kernel, stream, num_max_tokens_per_rank, num_local_experts,
                                arrival_slots, op_hash)  # fmt: skip
                rejected = True
            else:
                num_recv_tokens = sum(counts[: runtime.num_ranks])
                counts_list = counts[runtime.num_ranks : -1]
                if expert_alignment > 1:  # up to 256 experts: one expression per count, not a call
                    counts_list = [-(-c // expert_alignment) * expert_alignment for c in counts_list]
                num_expanded_rows = sum(counts_list)
                num_out_rows = num_expanded_rows if do_expand else num_recv_tokens
                state = NvlinkDispatchState(slot_idx, num_tokens_per_rank, num_out_rows, num_recv_tokens,
                                            num_expanded_rows, node_slot_idx, num_tokens_per_node, forward_map,
                                            forward_counts)  # fmt: skip
                recv_src_metadata = empty((num_recv_tokens, 2 + num_topk), dtype=torch.int32, device=device,
                                          rows="meta")  # fmt: skip
                outputs = _dispatch_outputs(runtime, num_out_rows, x, x_scales, num_topk, topk_weights is not None,
                                            do_expand, use_tma_aligned_col_major_sf, num_local_experts, fresh)  # fmt: skip
        if not rejected:
            # The epilogue runs next to the dispatch kernel, also after a CPU sync (the host waited
            # for the counts only, which come before the kernel's sends, or with rank masking on
            # timeout right after its own)
            if before_epilogue is not None:
                before_epilogue()
            _launch_dispatch_epilogue(runtime, epilogue_kernel, stream, x, x_scales, state, outputs,
                                      recv_src_metadata, num_recv_per_expert, expand_scratch, cached,
                                      num_max_tokens_per_rank, num_local_experts, expert_alignment,
                                      do_zero_padding, arrival_slots, op_hash, num_sms, num_qps)  # fmt: skip
    except BaseException as error:
        runtime.fail_between_launches("dispatch", error)
        raise
    if rejected:
        raise_rejected_routing(runtime, topk_idx, num_experts)
    runtime.take_input_error()
    return {
        **{name: outputs[name] for name in ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights")},
        "recv_src_metadata": recv_src_metadata,
        "psum_num_recv_tokens_per_rank": outputs["psum_num_recv_tokens_per_rank"],
        "num_recv_tokens_per_expert": num_recv_per_expert,
        "psum_num_recv_tokens_per_expert": outputs["psum_num_recv_tokens_per_expert"],
        "num_recv_tokens_per_expert_host": counts_list,
        "num_recv_tokens": state.num_meta_rows,
        "num_out_rows": state.num_out_rows,
        "dst_slot_idx": dst_slot_idx,
        "num_masked_lanes": num_masked_lanes,
        "topk_idx_copy": topk_idx_copy,
        "state": state,
    }


def raise_rejected_routing(runtime: NvlinkRuntime, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Raise the `ValueError` of a CPU-sync dispatch whose routing the device rejected (it sent nothing):
    the device's record of the first bad value, else the one the host finds."""
    runtime.take_input_error()
    check_topk_idx_values("dispatch", topk_idx, num_experts)
    raise ValueError(f"dispatch: `topk_idx` must hold distinct expert ids in [-1, {num_experts}) per row")


def _launch_dispatch_epilogue(
    runtime: NvlinkRuntime, kernel: Any, stream: torch.cuda.Stream, x: torch.Tensor,
    x_scales: torch.Tensor | None, state: NvlinkDispatchState, outputs: dict, recv_src_metadata: torch.Tensor,
    num_recv_per_expert: torch.Tensor, expand_scratch: torch.Tensor | None, cached: NvlinkDispatchState | None,
    num_max_tokens_per_rank: int, num_local_experts: int, expert_alignment: int, do_zero_padding: bool,
    arrival_slots: int, op_hash: int, num_busy_sms: int, num_qps: int,
) -> None:  # fmt: skip
    """Launch the dispatch epilogue: received records into the outputs in the requested layout."""
    epilogue_args = specs.DispatchEpilogueArgs(
        window_base=runtime.windows.ptr, x=data_ptr(x), x_scales=data_ptr(x_scales),
        num_max_tokens_per_rank=num_max_tokens_per_rank, rank=runtime.rank,
        num_experts_per_rank=num_local_experts, expert_alignment=expert_alignment,
        num_out_rows=state.num_out_rows, num_meta_rows=state.num_meta_rows,
        scale_col_stride=outputs["scale_col_stride"], recv_x=data_ptr(outputs["recv_x"]),
        recv_scales=data_ptr(outputs["recv_scales"]), recv_topk_idx=data_ptr(outputs["recv_topk_idx"]),
        recv_topk_weights=data_ptr(outputs["recv_topk_weights"]), recv_src_metadata=data_ptr(recv_src_metadata),
        psum_num_recv_tokens_per_rank=data_ptr(outputs["psum_num_recv_tokens_per_rank"]),
        num_recv_tokens_per_expert=data_ptr(num_recv_per_expert),
        psum_num_recv_tokens_per_expert=data_ptr(outputs["psum_num_recv_tokens_per_expert"]),
        expand_rank_in_expert=data_ptr(expand_scratch), is_cached=int(cached is not None),
        do_zero_padding=int(do_zero_padding), arrival_block=arrival_slots, op_hash=op_hash,
        error_block=data_ptr(runtime.error_block), timeout_ns=runtime.timeout_ns)  # fmt: skip
    grid = runtime.grid_for_rows(state.num_meta_rows, num_busy_sms) + runtime.nic_ctas
    runtime.launch(kernel, grid=(grid,), block=(specs.NUM_THREADS,), stream=stream,
                   args=(Opaque(bytes(epilogue_args)), Opaque(runtime.links.args("epilogue", num_qps))), pdl=True)  # fmt: skip


def _drain_dispatch(
    runtime: NvlinkRuntime, kernel: Any, stream: torch.cuda.Stream, num_max_tokens_per_rank: int,
    num_local_experts: int, arrival_slots: int, op_hash: int,
) -> None:  # fmt: skip
    """Our input was rejected, but peers sent us their records: wait for them all and return the
    arrival counters to zero (the epilogue with no outputs), so the buffer stays usable."""
    drain_args = specs.DispatchEpilogueArgs(
        window_base=runtime.windows.ptr, num_max_tokens_per_rank=num_max_tokens_per_rank, rank=runtime.rank,
        num_experts_per_rank=num_local_experts, expert_alignment=1, drain_only=1, arrival_block=arrival_slots,
        op_hash=op_hash, error_block=data_ptr(runtime.error_block), timeout_ns=runtime.timeout_ns)  # fmt: skip
    runtime.launch(kernel, grid=(1 + runtime.nic_ctas,), block=(specs.NUM_THREADS,), stream=stream,
                   args=(Opaque(bytes(drain_args)), Opaque(runtime.links.args("epilogue"))), pdl=True)  # fmt: skip
