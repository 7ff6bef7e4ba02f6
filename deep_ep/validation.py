"""Argument checks of `ElasticBuffer`: every input is checked here, before any communication.

Each check raises `TypeError` (wrong Python type or dtype) or `ValueError` (shape, device,
contiguity, value, combination of options) with a message that names the call, the argument, the
expected and the actual value, e.g. "dispatch: `topk_idx` must have dtype torch.int64, got torch.int32".

The value checks of `topk_idx` (range and repeated experts) read the tensor on the host (one
synchronization, which waits for everything queued before it). They run for a backend that cannot
check the values on the device (the reference); a backend that can (the NVLink kernels) checks them
in its dispatch kernel instead, which sends nothing when one is bad, so that a dispatch without CPU
sync never waits on the host. `EP_CHECK_VALUES=1` makes the host check every dispatch (an error at
once, at the cost of that synchronization), `EP_CHECK_VALUES=0` none; never while a CUDA graph is
being captured.

Misuse of the buffer itself is checked here too, before any kernel runs: a handle of another buffer
(another process group, `LoopbackWorld` or virtual rank, or a buffer that is gone), a current CUDA
device other than the buffer's, and, while a CUDA graph is being captured, whatever would wait on
the host (a CPU-sync dispatch, a barrier, a backend without a capturable path). The table is in
`docs/semantics.md` ("Misuse").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deep_ep.backends.base import CombineRequest, DispatchRequest, ScaleKind, check_topk_idx_values
from deep_ep.event import EventHandle
from deep_ep.handle import BufferOrigin, EPHandle
from deep_ep.records import hidden_row_error

# DeepEP V2's limits (its `elastic.py` asserts them): top-k lanes, experts, experts per rank, ranks
MAX_TOPK, MAX_EXPERTS, MAX_EXPERTS_PER_RANK, MAX_RANKS = 32, 2048, 256, 1024
# ... and in hybrid mode: scale-out domains (nodes), scale-up ranks per domain
MAX_SCALEOUT_RANKS, MAX_SCALEUP_RANKS = 32, 64


@dataclass(frozen=True)
class ValidationContext:
    """What the checks need to know about the buffer.

    Attributes:
        num_ranks: the group size `N`.
        device: where every tensor must live.
        buffer_id: the identity of the buffer (handles must come from it).
        num_max_tokens_per_rank: the buffer's default `Tmax` (`0`: none).
        hidden: the buffer's hidden size (`0`: any).
        num_topk: the buffer's top-k (`0`: any).
        num_allocated_qps: the most queue pairs a call may use.
        deterministic: the buffer's flag, copied into the requests.
        allow_multiple_reduction: the buffer's flag, copied into the requests.
        device_checks_topk_values: the backend checks `topk_idx` values on the device, sends nothing
            when they are bad and raises from its CPU-sync wait or at the rank's next call (so the host
            does not check them unless `EP_CHECK_VALUES=1`).
        backend_name: the backend's name, for messages.
        supports_graph_capture: the backend's calls without CPU sync wait for nothing on the host, so
            a CUDA graph can record them.
        origin: the buffer's `BufferOrigin`, to name the buffer a foreign handle came from.
    """

    num_ranks: int
    device: torch.device
    buffer_id: int
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    num_allocated_qps: int
    deterministic: bool
    allow_multiple_reduction: bool
    device_checks_topk_values: bool = False
    backend_name: str = "reference"
    supports_graph_capture: bool = False
    origin: BufferOrigin | None = None


def graph_capture_active() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph.

    Asks only once CUDA has started (nothing captures before), so that a CPU buffer on a machine
    with GPUs never starts CUDA (a virtual-rank world needs CUDA's settings made before it starts).
    """
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def host_checks_values(device_checks_values: bool) -> bool:
    """Whether a dispatch reads its `topk_idx` values on the host now: with `EP_CHECK_VALUES=1` always,
    with `0` never, unset only where the backend does not check them on the device
    (`device_checks_values`); never while capturing a CUDA graph."""
    mode = os.environ.get("EP_CHECK_VALUES", "")
    if mode == "0" or graph_capture_active():
        return False
    return mode == "1" or not device_checks_values


def check_current_device(op: str, device: torch.device) -> None:
    """A CUDA buffer's streams, events and kernels belong to its device: the caller's current device
    must be that one (a stream of another device would order nothing against the buffer's work)."""
    if device.type != "cuda":
        return
    current = torch.cuda.current_device()
    if current != device.index:
        raise ValueError(
            f"{op}: the current CUDA device must be the buffer's ({device}), got cuda:{current}; call it inside "
            f"`with torch.cuda.device({device.index}):` (or `torch.cuda.set_device({device.index})`)"
        )


def check_capture(op: str, ctx: ValidationContext) -> None:
    """Inside CUDA-graph capture only work that waits for nothing on the host can be recorded; a
    backend whose calls always wait on the host (collectives, host reads) cannot be captured at all:
    on CUDA its wait would invalidate the capture, on CPU it would run once now and never on replay."""
    if not ctx.supports_graph_capture and graph_capture_active():
        raise ValueError(
            f"{op}: the buffer's `backend` must support CUDA-graph capture while a graph is being captured, got "
            f"backend={ctx.backend_name!r} (it waits on the host, which a replay cannot repeat); capture a buffer "
            "created with backend='kernels', or call this one outside the capture"
        )


def check_cpu_sync_in_capture(op: str, do_cpu_sync: bool, given: Any) -> None:
    """A CPU-sync dispatch waits on the host for counts that, inside a capture, no kernel has produced
    yet (they come only with each replay), so it cannot be recorded; without CPU sync it can."""
    if do_cpu_sync and graph_capture_active():
        how = "the default without a cached `handle`" if given is None else "given"
        raise ValueError(
            f"{op}: `do_cpu_sync` must be False while a CUDA graph is being captured (a CPU sync waits on the host "
            f"for counts that only a replay produces), got True ({how}); pass do_cpu_sync=False (worst-case shapes, "
            "the real counts in the handle's tensors) or a cached `handle`"
        )


def check_barrier(ctx: ValidationContext) -> None:
    """A barrier waits on the host until every rank arrived: it cannot be recorded in a CUDA graph."""
    op = "barrier"
    check_current_device(op, ctx.device)
    if graph_capture_active():
        raise ValueError(
            f"{op}: the current stream must not be capturing a CUDA graph (a barrier waits on the host for every "
            "rank, which a replay cannot repeat), got a capturing stream; call it before or after the capture"
        )


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def as_bool(op: str, name: str, value: Any) -> bool:
    """Accept `bool` and the ints `0`/`1` (V2's tests pass ints)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{op}: `{name}` must be a bool, got {value!r}")


def as_int(op: str, name: str, value: Any, minimum: int = 0) -> int:
    """Accept a non-bool integer `>= minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: `{name}` must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{op}: `{name}` must be >= {minimum}, got {value}")
    return value


def check_tensor(
    op: str,
    name: str,
    t: Any,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    shape: list[int | None] | None,
    device: torch.device,
    contiguous: bool = True,
) -> torch.Tensor:
    """Check type, dtype, rank and shape (`None` = any size), device and contiguity of one tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{op}: `{name}` must have dtype {expected}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape):
            raise ValueError(f"{op}: `{name}` must be {len(shape)}D {shape}, got shape {_shape(t)}")
        for expected_size, size in zip(shape, t.shape, strict=True):
            if expected_size is not None and expected_size != size:
                raise ValueError(f"{op}: `{name}` must have shape {shape}, got {_shape(t)}")
    if t.device != device:
        raise ValueError(f"{op}: `{name}` must be on device {device} (the buffer's), got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: `{name}` must be contiguous, got strides {list(t.stride())}")
    return t


def check_event(op: str, name: str, event: Any) -> EventHandle | None:
    if event is not None and not isinstance(event, EventHandle):
        raise TypeError(
            f"{op}: `{name}` must be a deep_ep EventHandle (from `ElasticBuffer.capture()`), got {type(event).__name__}"
        )
    return event


def check_stream_args(
    op: str,
    previous_event: Any,
    previous_event_before_epilogue: Any,
    async_with_compute_stream: Any,
    allocate_on_comm_stream: Any,
) -> bool:
    """Check the stream options of dispatch and combine; return `allocate_on_comm_stream` as a bool.

    V2's rule: waiting on a previous event needs the outputs allocated on the communication stream.
    """
    allocate_on_comm_stream = as_bool(op, "allocate_on_comm_stream", allocate_on_comm_stream)
    as_bool(op, "async_with_compute_stream", async_with_compute_stream)
    check_event(op, "previous_event", previous_event)
    check_event(op, "previous_event_before_epilogue", previous_event_before_epilogue)
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError(
            f"{op}: `previous_event` needs `allocate_on_comm_stream`=True, got allocate_on_comm_stream=False"
        )
    return allocate_on_comm_stream


def describe_origin(origin: BufferOrigin, here: BufferOrigin) -> str:
    """Where a foreign handle's buffer lives, seen from the buffer `here` it was passed to."""
    where = f"virtual rank {origin.rank_idx} of {origin.num_ranks}"
    world = origin.world() if origin.world is not None else None
    here_world = here.world() if here.world is not None else None
    if origin.world is not None or here.world is not None:
        if origin.world is None:
            return f"a buffer of a torch.distributed process group (rank {origin.rank_idx} of {origin.num_ranks}), not of this LoopbackWorld"
        if here.world is None:
            return f"a buffer of a LoopbackWorld ({where}), not of this process group"
        if world is not here_world:
            return f"a buffer of another LoopbackWorld ({where})"
        if origin.rank_idx != here.rank_idx:
            return f"the buffer of another rank of this LoopbackWorld ({where}; this buffer is rank {here.rank_idx})"
        return "another buffer of this group"
    if origin.group() is not here.group():
        return f"a buffer of another process group (rank {origin.rank_idx} of {origin.num_ranks})"
    return "another buffer of this process group"


def check_handle(op: str, ctx: ValidationContext, handle: Any) -> EPHandle:
    """A handle's state (slots, counts, the backend's layout) describes the windows of the buffer that
    made it, and of no other: it is valid with that buffer only."""
    if not isinstance(handle, EPHandle):
        raise TypeError(
            f"{op}: `handle` must be an EPHandle (from `ElasticBuffer.dispatch`), got {type(handle).__name__}"
        )
    if handle.buffer_id != ctx.buffer_id:
        origin = handle.buffer_origin
        if origin is None or ctx.origin is None:
            source = f"buffer_id {handle.buffer_id}"
        else:
            source = f"{describe_origin(origin, ctx.origin)}, buffer_id {handle.buffer_id}"
            if origin.lifetime.ended is not None:
                source += f", which was {origin.lifetime.ended} (its handles died with it)"
        raise ValueError(
            f"{op}: `handle` must come from a dispatch of this buffer (buffer_id {ctx.buffer_id}), got one from "
            f"{source}; a handle works only with the buffer that made it"
        )
    return handle


def check_hidden(op: str, name: str, ctx: ValidationContext, hidden: int, element_size: int) -> None:
    error = hidden_row_error(hidden, element_size)
    if error is not None:
        raise ValueError(f"{op}: `{name}` {error}")
    if ctx.hidden > 0 and hidden > ctx.hidden:
        raise ValueError(f"{op}: `{name}` hidden must be <= {ctx.hidden} (the buffer's `hidden`), got {hidden}")


def _check_raw_rows(op: str, name: str, ctx: ValidationContext, data: Any) -> torch.Tensor:
    """Dispatch moves `x` as raw bytes (V2): any dtype, 2-D, contiguous, rows a multiple of 16 bytes."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(data).__name__}")
    if data.is_complex() or data.dtype == torch.bool or data.layout != torch.strided:
        raise TypeError(f"{op}: `{name}` must be a strided tensor of a real dtype, got {data.dtype} ({data.layout})")
    check_tensor(op, name, data, data.dtype, [None, None], ctx.device)
    check_hidden(op, name, ctx, data.shape[1], data.element_size())
    return data


def parse_dispatch_x(op: str, ctx: ValidationContext, x: Any) -> tuple[torch.Tensor, torch.Tensor | None, ScaleKind]:
    """Split `x` into (data, scales, scale kind) and check both tensors.

    The data may have any dtype (moved as raw bytes, never cast); the scales are 4-byte elements
    (`torch.float32`, or `torch.int32` packs such as UE8M0 exponents) with any number of packs per
    token (1x128 or 1x32 blocks, ...) and any strides, as in DeepEP V2."""
    if isinstance(x, torch.Tensor):
        return _check_raw_rows(op, "x", ctx, x), None, ScaleKind.NONE
    if not isinstance(x, (tuple, list)):
        raise TypeError(f"{op}: `x` must be a torch.Tensor or a tuple (data, scales), got {type(x).__name__}")
    if len(x) != 2:
        raise TypeError(f"{op}: `x` as a tuple must be (data, scales), got {len(x)} elements")
    data, scales = x
    num_tokens = _check_raw_rows(op, "x[0]", ctx, data).shape[0]
    check_tensor(op, "x[1]", scales, (torch.float32, torch.int32), [None, None], ctx.device, contiguous=False)
    if scales.shape[0] != num_tokens or scales.shape[1] < 1:
        raise ValueError(
            f"{op}: `x[1]` (scales) must have shape [num_tokens, num_packs] = [{num_tokens}, >= 1], got {_shape(scales)}"
        )
    kind = ScaleKind.FP32 if scales.dtype == torch.float32 else ScaleKind.UE8M0
    return data, scales, kind


def validate_dispatch(
    ctx: ValidationContext,
    resolve_num_sms: Callable[[int, int], int],
    resolve_num_qps: Callable[[int], int],
    *,
    x: Any,
    topk_idx: Any,
    topk_weights: Any,
    cumulative_local_expert_recv_stats: Any,
    num_experts: Any,
    num_max_tokens_per_rank: Any,
    expert_alignment: Any,
    num_sms: Any,
    num_qps: Any,
    previous_event: Any,
    previous_event_before_epilogue: Any,
    async_with_compute_stream: Any,
    allocate_on_comm_stream: Any,
    handle: Any,
    do_cpu_sync: Any,
    do_expand: Any,
    do_zero_padding: Any,
    use_tma_aligned_col_major_sf: Any,
    do_handle_copy: Any = True,
) -> DispatchRequest:
    """Check every argument of `ElasticBuffer.dispatch` and return the normalized request."""
    op = "dispatch"
    check_current_device(op, ctx.device)
    check_capture(op, ctx)
    allocate_on_comm_stream = check_stream_args(
        op, previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream
    )
    do_expand = as_bool(op, "do_expand", do_expand)
    do_zero_padding = as_bool(op, "do_zero_padding", do_zero_padding)
    use_tma_aligned_col_major_sf = as_bool(op, "use_tma_aligned_col_major_sf", use_tma_aligned_col_major_sf)
    if do_zero_padding and not do_expand:
        raise ValueError(f"{op}: `do_zero_padding`=True needs `do_expand`=True, got do_expand=False")
    num_sms = as_int(op, "num_sms", num_sms)
    num_qps = as_int(op, "num_qps", num_qps)
    data, scales, scale_kind = parse_dispatch_x(op, ctx, x)
    num_tokens = data.shape[0]

    # Routing: from the handle (cached dispatch) or from `topk_idx`
    if handle is not None:
        handle = check_handle(op, ctx, handle)
        if topk_idx is not None:
            raise ValueError(
                f"{op}: `topk_idx` must be None with a cached `handle` (the handle's routing is used), got a tensor"
            )
        if do_cpu_sync is not None and as_bool(op, "do_cpu_sync", do_cpu_sync):
            raise ValueError(f"{op}: `do_cpu_sync` must be None or False with a cached `handle`, got True")
        do_cpu_sync = False
        if do_expand != handle.do_expand:
            raise ValueError(f"{op}: `do_expand` must match the handle's mode ({handle.do_expand}), got {do_expand}")
        for name, value, expected in (
            ("num_experts", num_experts, handle.num_experts),
            ("expert_alignment", expert_alignment, handle.expert_alignment),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
        ):
            if value is not None and value != expected:
                raise ValueError(f"{op}: `{name}` must match the handle's ({expected}) or be None, got {value!r}")
        if num_tokens != handle.num_tokens:
            raise ValueError(f"{op}: `x` must have the handle's {handle.num_tokens} tokens (rows), got {num_tokens}")
        topk_idx = handle.topk_idx
        num_experts = handle.num_experts
        expert_alignment = handle.expert_alignment
        num_max_tokens_per_rank = handle.num_max_tokens_per_rank
    else:
        if topk_idx is None:
            raise ValueError(f"{op}: `topk_idx` is required without a cached `handle`, got None")
        check_tensor(op, "topk_idx", topk_idx, torch.int64, [num_tokens, None], ctx.device)
        if topk_idx.shape[1] < 1:
            raise ValueError(f"{op}: `topk_idx` must have at least one lane, got shape {_shape(topk_idx)}")
        if topk_idx.shape[1] > MAX_TOPK:
            raise ValueError(
                f"{op}: `topk_idx` must have <= {MAX_TOPK} lanes (DeepEP V2's limit), got {topk_idx.shape[1]}"
            )
        if ctx.num_topk > 0 and topk_idx.shape[1] > ctx.num_topk:
            raise ValueError(
                f"{op}: `topk_idx` must have <= {ctx.num_topk} lanes (the buffer's `num_topk`), got {topk_idx.shape[1]}"
            )
        if num_experts is None:
            raise ValueError(f"{op}: `num_experts` is required without a cached `handle`, got None")
        num_experts = as_int(op, "num_experts", num_experts, minimum=1)
        if num_experts % ctx.num_ranks != 0:
            raise ValueError(
                f"{op}: `num_experts` must be a multiple of the number of ranks ({ctx.num_ranks}), got {num_experts}"
            )
        if num_experts > MAX_EXPERTS or num_experts // ctx.num_ranks > MAX_EXPERTS_PER_RANK:
            raise ValueError(
                f"{op}: `num_experts` must be <= {MAX_EXPERTS} and <= {MAX_EXPERTS_PER_RANK} per rank (DeepEP V2's "
                f"limits), got {num_experts} ({num_experts // ctx.num_ranks} per rank over {ctx.num_ranks} ranks)"
            )
        expert_alignment = as_int(
            op, "expert_alignment", 1 if expert_alignment is None else expert_alignment, minimum=1
        )
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = ctx.num_max_tokens_per_rank
            if num_max_tokens_per_rank == 0:
                raise ValueError(f"{op}: `num_max_tokens_per_rank` is required (the buffer has no default), got None")
        num_max_tokens_per_rank = as_int(op, "num_max_tokens_per_rank", num_max_tokens_per_rank, minimum=1)
        if num_tokens > num_max_tokens_per_rank:
            raise ValueError(
                f"{op}: `x` must have at most `num_max_tokens_per_rank` = {num_max_tokens_per_rank} tokens (rows), got {num_tokens}"
            )
        given_cpu_sync = do_cpu_sync
        do_cpu_sync = True if do_cpu_sync is None else as_bool(op, "do_cpu_sync", do_cpu_sync)
        check_cpu_sync_in_capture(op, do_cpu_sync, given_cpu_sync)
        # A backend that validates on the device sends nothing when a value is bad and raises from
        # its CPU-sync wait, or without one at the rank's next call
        if host_checks_values(ctx.device_checks_topk_values):
            check_topk_idx_values(op, topk_idx, num_experts)
    num_topk = topk_idx.shape[1]

    if topk_weights is not None:
        check_tensor(op, "topk_weights", topk_weights, torch.float32, [num_tokens, num_topk], ctx.device)
    num_local_experts = num_experts // ctx.num_ranks
    stats = cumulative_local_expert_recv_stats
    if stats is not None:
        check_tensor(op, "cumulative_local_expert_recv_stats", stats, torch.int32, [num_local_experts], ctx.device)

    num_sms = num_sms if num_sms > 0 else resolve_num_sms(num_experts, num_topk)
    num_qps = num_qps if num_qps > 0 else resolve_num_qps(num_sms)
    if num_qps > ctx.num_allocated_qps:
        raise ValueError(f"{op}: `num_qps` must be <= {ctx.num_allocated_qps} (the allocated QPs), got {num_qps}")
    return DispatchRequest(
        x=data,
        scales=scales,
        scale_kind=scale_kind,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        cumulative_local_expert_recv_stats=stats,
        num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        expert_alignment=expert_alignment,
        num_sms=num_sms,
        num_qps=num_qps,
        do_cpu_sync=do_cpu_sync,
        do_expand=do_expand,
        do_zero_padding=do_zero_padding,
        use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
        deterministic=ctx.deterministic,
        allow_multiple_reduction=ctx.allow_multiple_reduction,
        cached_handle=handle,
        previous_event_before_epilogue=previous_event_before_epilogue,
        do_handle_copy=as_bool(op, "do_handle_copy", do_handle_copy),
    )


def parse_bias(op: str, bias: Any) -> tuple[Any, Any]:
    """Split `bias` (None, a tensor, or a tuple of two tensors) into `(bias_0, bias_1)`."""
    if bias is None or isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2:
            raise TypeError(f"{op}: `bias` as a tuple must hold 2 tensors, got {len(bias)} elements")
        return bias[0], bias[1]
    raise TypeError(f"{op}: `bias` must be None, a torch.Tensor or a tuple of 2 tensors, got {type(bias).__name__}")


def validate_combine(
    ctx: ValidationContext,
    resolve_num_qps: Callable[[int], int],
    *,
    x: Any,
    handle: Any,
    topk_weights: Any,
    bias: Any,
    num_sms: Any,
    num_qps: Any,
    previous_event: Any,
    previous_event_before_epilogue: Any,
    async_with_compute_stream: Any,
    allocate_on_comm_stream: Any,
) -> CombineRequest:
    """Check every argument of `ElasticBuffer.combine` and return the normalized request."""
    op = "combine"
    check_current_device(op, ctx.device)
    check_capture(op, ctx)
    allocate_on_comm_stream = check_stream_args(
        op, previous_event, previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream
    )
    num_sms = as_int(op, "num_sms", num_sms)
    num_qps = as_int(op, "num_qps", num_qps)
    handle = check_handle(op, ctx, handle)
    num_rows = handle.num_combine_rows
    check_tensor(op, "x", x, torch.bfloat16, [None, None], ctx.device)
    if x.shape[0] != num_rows:
        what = "num_expanded_tokens (expand mode)" if handle.do_expand else "num_recv_tokens"
        raise ValueError(f"{op}: `x` must have the handle's {what} = {num_rows} rows, got {x.shape[0]}")
    hidden = x.shape[1]
    check_hidden(op, "x", ctx, hidden, x.element_size())
    if topk_weights is not None:
        shape: list[int | None] = [num_rows] if handle.do_expand else [num_rows, handle.num_topk]
        check_tensor(op, "topk_weights", topk_weights, torch.float32, shape, ctx.device)
    bias_0, bias_1 = parse_bias(op, bias)
    for name, b in (("bias[0]" if bias_1 is not None else "bias", bias_0), ("bias[1]", bias_1)):
        if b is not None:
            check_tensor(op, name, b, torch.bfloat16, [handle.num_tokens, hidden], ctx.device)
    if bias_0 is None and bias_1 is not None:
        raise TypeError(f"{op}: `bias[0]` must be a torch.Tensor when `bias[1]` is given, got None")

    num_sms = num_sms if num_sms > 0 else handle.num_sms
    num_qps = num_qps if num_qps > 0 else resolve_num_qps(num_sms)
    if num_qps > ctx.num_allocated_qps:
        raise ValueError(f"{op}: `num_qps` must be <= {ctx.num_allocated_qps} (the allocated QPs), got {num_qps}")
    return CombineRequest(
        x=x,
        handle=handle,
        topk_weights=topk_weights,
        bias_0=bias_0,
        bias_1=bias_1,
        num_sms=num_sms,
        num_qps=num_qps,
        allow_multiple_reduction=ctx.allow_multiple_reduction,
        previous_event_before_epilogue=previous_event_before_epilogue,
    )
