"""Differentiable dispatch and combine, and `ExpertParallelMoE`, an expert-parallel MoE layer.

`dispatch` and `combine` wrap `ElasticBuffer.dispatch` and `ElasticBuffer.combine` in autograd
functions whose backward is the reverse communication on the saved handle:

- the backward of a dispatch is a combine of the gradient of the received rows (and weights);
- the backward of a combine is a cached dispatch (`buffer.dispatch(grad, handle=handle)`) of the
  gradient of the combined tokens (and weights).

Both are exact adjoints of the forward maps (up to the BF16 rounding of the data that travels), so
every rank must run backward through the same graph: each backward step is a collective call.

Combine sums the rows of a token over its holder ranks and never applies the top-k weights (they are
transported only). An MoE therefore multiplies each (token, local expert) row by its gate weight on
the expert side, before combine; the gradient of the gate weights is then computed on the expert
side by autograd and carried home by the weight lane of the dispatch's backward combine.

Notation as in `docs/semantics.md`: `T` tokens on this rank, `H` hidden size, `K` top-k lanes, `E`
experts, `N` ranks, `L = E / N` local experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deep_ep.buffer import ElasticBuffer
from deep_ep.event import EventHandle, EventOverlap
from deep_ep.handle import EPHandle

# A grouped expert callable: `(recv_x [rows, H], handle) -> [rows, H]` over the expanded layout
GroupedExperts = Callable[[torch.Tensor, EPHandle], torch.Tensor]


class DispatchOutput(NamedTuple):
    """What `deep_ep.nn.dispatch` returns (the same tuple as `ElasticBuffer.dispatch`).

    Attributes:
        recv_x: `[rows, H]` `torch.bfloat16`, differentiable; rows that hold no token (alignment padding,
            and without CPU sync the worst-case tail) are zero.
        recv_topk_idx: non-expand `[rows, K]` `torch.int64` local expert ids (`-1`: another rank's expert,
            and every row past the received ones); `None` in expand mode.
        recv_topk_weights: non-expand `[rows, K]`, expand `[rows]` `torch.float32`, differentiable, or
            `None` without weights. Non-expand lanes of other ranks' experts hold `0`.
        handle: the `EPHandle` (saved for the backward combine).
        event: the `EventOverlap` of the communication (wait on it with `async_with_compute_stream`).
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    handle: EPHandle
    event: EventOverlap


class CombineOutput(NamedTuple):
    """What `deep_ep.nn.combine` returns (the same tuple as `ElasticBuffer.combine`).

    Attributes:
        combined_x: `[T, H]` `torch.bfloat16`, differentiable.
        combined_topk_weights: `[T, K]` `torch.float32`, differentiable, or `None` without weights.
        event: the `EventOverlap` of the communication.
    """

    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor | None
    event: EventOverlap


def _num_real_rows(handle: EPHandle) -> torch.Tensor:
    """The number of leading rows of the handle's layout that can hold data, as a 0-dim device tensor.

    Non-expand: the received tokens `R`. Expand: `offset_{L-1} + count_{L-1}` (the padding rows before
    it are zeroed by `do_zero_padding`). Read on the device, so no host synchronization.
    """
    if handle.do_expand:
        return handle.psum_num_recv_tokens_per_expert[-1]
    return handle.psum_num_recv_tokens_per_scaleup_rank[-1]


def _tail_mask(handle: EPHandle, num_rows: int, device: torch.device) -> torch.Tensor:
    """`[num_rows]` `torch.bool`: the rows past the real ones (worst-case layouts without CPU sync)."""
    return torch.arange(num_rows, device=device) >= _num_real_rows(handle).to(device=device, dtype=torch.int64)


def _clean_dispatch_outputs(
    handle: EPHandle,
    recv_x: torch.Tensor,
    recv_topk_idx: torch.Tensor | None,
    recv_topk_weights: torch.Tensor | None,
) -> None:
    """Give the rows and lanes that carry no token defined values, in place.

    Non-expand lanes of other ranks' experts get weight `0`, so that the received weights are a
    function of the source weights whose adjoint is exactly what combine carries back (the weight of
    the lane's owner). Without CPU sync the rows past the real ones are zeroed (`recv_topk_idx = -1`),
    so experts that run over every row see zeros and their parameter gradients stay finite.
    """
    if recv_topk_idx is not None and recv_topk_weights is not None:
        recv_topk_weights.masked_fill_(recv_topk_idx < 0, 0.0)
    if handle.do_cpu_sync:
        return
    tail = _tail_mask(handle, recv_x.shape[0], recv_x.device)
    recv_x.masked_fill_(tail.unsqueeze(1), 0)
    if recv_topk_idx is not None:
        recv_topk_idx.masked_fill_(tail.unsqueeze(1), -1)
    if recv_topk_weights is not None:
        recv_topk_weights.masked_fill_(tail.view(-1, *([1] * (recv_topk_weights.dim() - 1))), 0.0)


class _DispatchFunction(torch.autograd.Function):
    """Dispatch forward; combine of the gradients backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        buffer: ElasticBuffer,
        topk_idx: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...]:
        async_with_compute_stream = kwargs["async_with_compute_stream"]
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, **kwargs
        )
        comm_stream = buffer.get_comm_stream()
        if async_with_compute_stream and comm_stream is not None:
            # The outputs are still being written on the communication stream: clean them there and
            # hand out an event that covers the cleaning too
            with torch.cuda.stream(comm_stream):
                _clean_dispatch_outputs(handle, recv_x, recv_topk_idx, recv_topk_weights)
                event = EventOverlap(EventHandle(comm_stream))
        else:
            _clean_dispatch_outputs(handle, recv_x, recv_topk_idx, recv_topk_weights)
        if recv_topk_idx is not None:
            ctx.mark_non_differentiable(recv_topk_idx)
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.num_sms = kwargs["num_sms"]
        ctx.num_qps = kwargs["num_qps"]
        ctx.has_weights = topk_weights is not None
        return recv_x, recv_topk_idx, recv_topk_weights, handle, event

    @staticmethod
    def backward(
        ctx: Any,
        grad_recv_x: torch.Tensor | None,
        grad_recv_topk_idx: Any,
        grad_recv_topk_weights: torch.Tensor | None,
        grad_handle: Any,
        grad_event: Any,
    ) -> tuple[torch.Tensor | None, ...]:
        handle: EPHandle = ctx.handle
        buffer: ElasticBuffer = ctx.buffer
        num_rows = handle.num_combine_rows
        if grad_recv_x is None:
            grad_recv_x = torch.zeros((num_rows, handle.hidden), dtype=torch.bfloat16, device=buffer.device)
        grad_weights = None
        if ctx.has_weights:
            if grad_recv_topk_weights is None:
                shape = (num_rows,) if handle.do_expand else (num_rows, handle.num_topk)
                grad_recv_topk_weights = torch.zeros(shape, dtype=torch.float32, device=buffer.device)
            grad_weights = grad_recv_topk_weights.float().contiguous()
        grad_x, grad_topk_weights, _ = buffer.combine(
            grad_recv_x.to(torch.bfloat16).contiguous(),
            handle,
            topk_weights=grad_weights,
            num_sms=ctx.num_sms,
            num_qps=ctx.num_qps,
        )
        return grad_x, grad_topk_weights, None, None, None


class _CombineFunction(torch.autograd.Function):
    """Combine forward; cached dispatch of the gradients backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor | None,
        bias_0: torch.Tensor | None,
        bias_1: torch.Tensor | None,
        buffer: ElasticBuffer,
        handle: EPHandle,
        kwargs: dict[str, Any],
    ) -> tuple[Any, ...]:
        bias: Any = None
        if bias_1 is not None:
            bias = (bias_0, bias_1)
        elif bias_0 is not None:
            bias = bias_0
        combined_x, combined_topk_weights, event = buffer.combine(
            x, handle, topk_weights=topk_weights, bias=bias, **kwargs
        )
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.num_sms = kwargs["num_sms"]
        ctx.num_qps = kwargs["num_qps"]
        ctx.has_weights = topk_weights is not None
        ctx.num_bias = 0 if bias_0 is None else (1 if bias_1 is None else 2)
        return combined_x, combined_topk_weights, event

    @staticmethod
    def backward(
        ctx: Any,
        grad_combined_x: torch.Tensor | None,
        grad_combined_topk_weights: torch.Tensor | None,
        grad_event: Any,
    ) -> tuple[torch.Tensor | None, ...]:
        handle: EPHandle = ctx.handle
        buffer: ElasticBuffer = ctx.buffer
        shape = (handle.num_tokens, handle.hidden)
        if grad_combined_x is None:
            grad_combined_x = torch.zeros(shape, dtype=torch.bfloat16, device=buffer.device)
        grad_combined_x = grad_combined_x.to(torch.bfloat16).contiguous()
        grad_weights = None
        if ctx.has_weights:
            if grad_combined_topk_weights is None:
                grad_combined_topk_weights = torch.zeros(
                    (handle.num_tokens, handle.num_topk), dtype=torch.float32, device=buffer.device
                )
            grad_weights = grad_combined_topk_weights.float().contiguous()
        grad_x, recv_topk_idx, grad_topk_weights, _, _ = buffer.dispatch(
            grad_combined_x,
            handle=handle,
            topk_weights=grad_weights,
            num_sms=ctx.num_sms,
            num_qps=ctx.num_qps,
            do_expand=handle.do_expand,
            do_zero_padding=handle.do_expand,
        )
        # Combine reads lane `k` of a token's weights from the owner of lane `k`'s expert only
        if grad_topk_weights is not None and recv_topk_idx is not None:
            grad_topk_weights.masked_fill_(recv_topk_idx < 0, 0.0)
        # Rows past the real ones were never read by combine: their gradient is zero
        if not handle.do_cpu_sync:
            tail = _tail_mask(handle, grad_x.shape[0], grad_x.device)
            grad_x.masked_fill_(tail.unsqueeze(1), 0)
            if grad_topk_weights is not None:
                grad_topk_weights.masked_fill_(tail.view(-1, *([1] * (grad_topk_weights.dim() - 1))), 0.0)
        grad_bias = [grad_combined_x if i < ctx.num_bias else None for i in range(2)]
        return grad_x, grad_topk_weights, grad_bias[0], grad_bias[1], None, None, None


def dispatch(
    buffer: ElasticBuffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    *,
    num_experts: int,
    num_max_tokens_per_rank: int | None = None,
    expert_alignment: int = 1,
    do_expand: bool = False,
    do_cpu_sync: bool = True,
    num_sms: int = 0,
    num_qps: int = 0,
    cumulative_local_expert_recv_stats: torch.Tensor | None = None,
    async_with_compute_stream: bool = False,
) -> DispatchOutput:
    """Differentiable `ElasticBuffer.dispatch`: its backward combines the gradients (collective).

    The forward is `buffer.dispatch` with `do_zero_padding=do_expand`, then two clean-ups that make the
    outputs a well-defined function of the inputs: non-expand weights of lanes whose expert is on
    another rank become `0`, and without CPU sync every row past the real ones is zero (weights `0`,
    `recv_topk_idx` `-1`). The backward is `buffer.combine(grad_recv_x, handle,
    topk_weights=grad_recv_topk_weights)`: the exact adjoint (each token's gradient is the FP32 sum over
    its holder ranks, rounded once to BF16; each lane's weight gradient comes from the lane's owner).

    Arguments:
        buffer: the `ElasticBuffer` (every rank of its group must call, forward and backward).
        x: `[T, H]` `torch.bfloat16` (FP8 inputs have no gradient: call `buffer.dispatch` directly).
        topk_idx: `[T, K]` `torch.int64` global expert ids, `-1` = none.
        topk_weights: `[T, K]` `torch.float32`, or `None`.
        num_experts: `E`.
        num_max_tokens_per_rank: `Tmax` (default: the buffer's).
        expert_alignment: align each local expert's row count (expand mode) to this.
        do_expand: one row per (token, local expert), blocks aligned (the layout of a grouped GEMM).
        do_cpu_sync: exact row counts (`True`) or worst-case rows without a host synchronization.
        num_sms: SMs for the forward dispatch and the backward combine (`0`: the buffer's choice).
        num_qps: queue pairs (`0`: the buffer's choice).
        cumulative_local_expert_recv_stats: `[L]` `torch.int32`, incremented in place, or `None`.
        async_with_compute_stream: return before the communication finished; call
            `result.event.current_stream_wait()` before using the outputs (a no-op without CUDA).

    Returns:
        result: a `DispatchOutput` `(recv_x, recv_topk_idx, recv_topk_weights, handle, event)`, see there.
    """
    if isinstance(x, torch.Tensor) and x.dtype != torch.bfloat16:
        # The facade moves any dtype as bytes; the backward combines in BF16
        raise TypeError(f"dispatch: `x` must have dtype torch.bfloat16 (its gradient is a BF16 combine), got {x.dtype}")
    kwargs = dict(
        num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        expert_alignment=expert_alignment,
        do_expand=do_expand,
        do_zero_padding=do_expand,
        do_cpu_sync=do_cpu_sync,
        num_sms=num_sms,
        num_qps=num_qps,
        cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
        async_with_compute_stream=async_with_compute_stream,
    )
    outputs = _DispatchFunction.apply(x, topk_weights, buffer, topk_idx, kwargs)
    return DispatchOutput(*outputs)


def combine(
    buffer: ElasticBuffer,
    x: torch.Tensor,
    handle: EPHandle,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    num_sms: int = 0,
    num_qps: int = 0,
    async_with_compute_stream: bool = False,
) -> CombineOutput:
    """Differentiable `ElasticBuffer.combine`: its backward is a cached dispatch of the gradients (collective).

    The backward is `buffer.dispatch(grad_combined_x, handle=handle, topk_weights=grad_combined_topk_weights)`
    in the handle's layout: every row of a token gets the token's gradient, every lane's weight gradient
    goes to the lane's owner (other lanes and rows that hold no token get `0`). Biases get the gradient
    of `combined_x`.

    Arguments:
        buffer: the `ElasticBuffer` that made `handle`.
        x: `[handle.num_recv_tokens, H]` (non-expand) or `[handle.num_expanded_tokens, H]` (expand)
            `torch.bfloat16`; only the real rows are read.
        handle: the `EPHandle` of a dispatch of `buffer`.
        topk_weights: non-expand `[rows, K]`, expand `[rows]` `torch.float32` (transported back), or `None`.
        bias: `None`, `[T, H]` `torch.bfloat16`, or a tuple of two, added after the reduction.
        num_sms: SMs for the forward combine and the backward dispatch (`0`: the handle's).
        num_qps: queue pairs (`0`: the buffer's choice).
        async_with_compute_stream: return before the communication finished (see `dispatch`).

    Returns:
        result: a `CombineOutput` `(combined_x, combined_topk_weights, event)`: `[T, H]` `torch.bfloat16`,
            `[T, K]` `torch.float32` or `None`, and the event.
    """
    bias_0, bias_1 = (bias if isinstance(bias, (tuple, list)) else (bias, None)) if bias is not None else (None, None)
    kwargs = dict(num_sms=num_sms, num_qps=num_qps, async_with_compute_stream=async_with_compute_stream)
    outputs = _CombineFunction.apply(x, topk_weights, bias_0, bias_1, buffer, handle, kwargs)
    return CombineOutput(*outputs)


class ExpertParallelMoE(nn.Module):
    """An expert-parallel Mixture-of-Experts layer: router, dispatch, local experts, combine.

    Every rank of the buffer's group holds `L = num_experts / N` experts (rank `r`: global experts
    `[r*L, (r+1)*L)`) and the same router. For `x` `[T, H]`:

    1. route: `probs = softmax(x @ gate.weight.T)` in FP32, `topk_weights, topk_idx = topk(probs, K)`,
       divided by their sum when `normalize_topk`;
    2. dispatch `bf16(x)` with the weights (`deep_ep.nn.dispatch`);
    3. experts: each local expert runs on its rows (in `x`'s dtype); each (token, local expert) output
       row is multiplied in FP32 by its gate weight (non-expand: the rows of a token are summed in FP32
       over its local experts in ascending order), then rounded to BF16;
    4. combine (`deep_ep.nn.combine`): FP32 sum over the holder ranks, one rounding to BF16; the result
       is cast to `x`'s dtype, plus `shared_experts(x)` if given.

    Gradients reach `x`, the gate and the experts through the backward communication (every rank must
    run backward). The gate is replicated (its gradient on each rank covers that rank's tokens: sum it
    over the group, as data parallelism does) while each expert lives on one rank (do not all-reduce
    its gradient over the expert-parallel group). The layer keeps no state between calls, so several
    micro-batches can be in flight: each call's handle lives in its own autograd graph.

    Attributes:
        buffer: the `ElasticBuffer`.
        gate: `nn.Linear(hidden, num_experts, bias=False)`, the router (FP32 parameters).
        experts: the local experts (`nn.ModuleList` of `L` modules, or the grouped callable).
        shared_experts: a module applied to `x` and added to the output, or `None`.
    """

    def __init__(
        self,
        buffer: ElasticBuffer,
        hidden: int,
        num_experts: int,
        num_topk: int,
        experts: nn.ModuleList | GroupedExperts,
        *,
        do_expand: bool | None = None,
        expert_alignment: int = 1,
        normalize_topk: bool = True,
        shared_experts: nn.Module | None = None,
        async_with_compute_stream: bool = False,
        do_cpu_sync: bool = True,
        num_max_tokens_per_rank: int | None = None,
        num_sms: int = 0,
    ) -> None:
        """Build the layer (collective: the gate's initial weights are broadcast from the group's rank 0).

        Arguments:
            buffer: the `ElasticBuffer` of the expert-parallel group.
            hidden: `H`.
            num_experts: `E`, a multiple of the group size.
            num_topk: `K`, experts per token.
            experts: an `nn.ModuleList` of the `L` local experts (each maps `[n, H]` to `[n, H]` in `x`'s
                dtype), or a grouped callable `(recv_x, handle) -> y` over the expanded layout: `recv_x`
                `[rows, H]` in `x`'s dtype, local expert `e`'s rows start at
                `handle.psum_num_recv_tokens_per_expert[e] - handle.num_unaligned_recv_tokens_per_expert[e]`
                (padding rows are zero), `y` `[rows, H]`. A grouped callable that is an `nn.Module` is
                registered as a submodule.
            do_expand: the dispatch layout; `None`: expanded for a grouped callable, non-expanded for a
                `ModuleList` (a grouped callable needs `True`).
            expert_alignment: align each expert's block to this many rows (expand mode).
            normalize_topk: divide the top-k gate weights by their sum.
            shared_experts: a module `[T, H] -> [T, H]` added to the output; with
                `async_with_compute_stream` it runs while the dispatch is in flight.
            async_with_compute_stream: overlap the dispatch with `shared_experts` (CUDA only).
            do_cpu_sync: exact row counts; `False` (worst-case rows, no host synchronization in the
                communication) needs a grouped callable.
            num_max_tokens_per_rank: `Tmax` of the dispatches (default: the buffer's).
            num_sms: SMs of the communication (`0`: the buffer's choice).
        """
        super().__init__()
        num_ranks = buffer.num_ranks
        if num_experts % num_ranks != 0:
            raise ValueError(
                f"ExpertParallelMoE: `num_experts` must be a multiple of the group size ({num_ranks}), got {num_experts}"
            )
        if not 0 < num_topk <= num_experts:
            raise ValueError(f"ExpertParallelMoE: `num_topk` must be in [1, {num_experts}], got {num_topk}")
        num_local_experts = num_experts // num_ranks
        grouped = not isinstance(experts, nn.ModuleList)
        if grouped and not callable(experts):
            raise TypeError(
                f"ExpertParallelMoE: `experts` must be an nn.ModuleList or a callable, got {type(experts).__name__}"
            )
        if not grouped and len(experts) != num_local_experts:
            raise ValueError(
                f"ExpertParallelMoE: `experts` must hold the {num_local_experts} local experts, got {len(experts)}"
            )
        if do_expand is None:
            do_expand = grouped
        if grouped and not do_expand:
            raise ValueError("ExpertParallelMoE: a grouped `experts` callable needs `do_expand`=True, got False")
        if not grouped and not do_cpu_sync:
            raise ValueError(
                "ExpertParallelMoE: `do_cpu_sync`=False needs a grouped `experts` callable (a ModuleList slices "
                "rows on the host), got a ModuleList"
            )
        self.buffer = buffer
        self.hidden = hidden
        self.num_experts = num_experts
        self.num_topk = num_topk
        self.num_local_experts = num_local_experts
        self.do_expand = bool(do_expand)
        self.expert_alignment = expert_alignment
        self.normalize_topk = normalize_topk
        self.async_with_compute_stream = async_with_compute_stream
        self.do_cpu_sync = do_cpu_sync
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.grouped = grouped
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=torch.float32, device=buffer.device)
        # The router is replicated: every rank starts from rank 0's weights
        with torch.no_grad():
            dist.broadcast(self.gate.weight, group=buffer.group, group_src=0)
        self.experts = experts
        self.shared_experts = shared_experts

    @property
    def first_local_expert(self) -> int:
        """The global id of this rank's first expert (`r * L`)."""
        return self.buffer.rank_idx * self.num_local_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k softmax routing in FP32.

        Arguments:
            x: `[T, H]`, any float dtype.

        Returns:
            topk_idx: `[T, K]` `torch.int64` global expert ids, by descending probability.
            topk_weights: `[T, K]` `torch.float32` gate weights (normalized to sum 1 with `normalize_topk`),
                differentiable with respect to `x` and the gate.
        """
        logits = F.linear(x.float(), self.gate.weight.float())
        probs = logits.softmax(dim=-1)
        topk_weights, topk_idx = probs.topk(self.num_topk, dim=-1)
        if self.normalize_topk:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_idx.contiguous(), topk_weights.contiguous()

    def _run_experts_plain(
        self, recv_in: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Non-expanded layout: each row's weighted outputs of its local experts, summed in FP32."""
        acc = torch.zeros((recv_in.shape[0], recv_in.shape[1]), dtype=torch.float32, device=recv_in.device)
        for expert_idx, expert in enumerate(self.experts):
            # Every expert runs, even on no rows, so every rank builds the same autograd graph
            rows, lanes = (recv_topk_idx == expert_idx).nonzero(as_tuple=True)
            out = expert(recv_in[rows])
            acc = acc.index_add(0, rows, out.float() * recv_topk_weights[rows, lanes].unsqueeze(1))
        return acc

    def _run_experts_expanded(self, recv_in: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        """Expanded layout: each expert's block through its expert (ModuleList) or the grouped callable."""
        if self.grouped:
            return self.experts(recv_in, handle).float()
        counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
        aligned_counts = handle.num_recv_tokens_per_expert_list
        pieces, offset = [], 0
        for expert, count, aligned_count in zip(self.experts, counts, aligned_counts, strict=True):
            pieces.append(expert(recv_in[offset : offset + count]).float())
            if aligned_count > count:
                pieces.append(recv_in.new_zeros((aligned_count - count, recv_in.shape[1]), dtype=torch.float32))
            offset += aligned_count
        return torch.cat(pieces, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer (collective: every rank of the group calls it, with its own tokens).

        Arguments:
            x: `[T, H]` tokens, any float dtype (`T` may differ between ranks, `T <= Tmax`).

        Returns:
            y: `[T, H]` in `x`'s dtype: the gate-weighted sum of the token's experts' outputs (plus the
                shared experts), communicated in BF16.
        """
        topk_idx, topk_weights = self.route(x)
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = dispatch(
            self.buffer,
            x.to(torch.bfloat16),
            topk_idx,
            topk_weights,
            num_experts=self.num_experts,
            num_max_tokens_per_rank=self.num_max_tokens_per_rank,
            expert_alignment=self.expert_alignment,
            do_expand=self.do_expand,
            do_cpu_sync=self.do_cpu_sync,
            num_sms=self.num_sms,
            async_with_compute_stream=self.async_with_compute_stream,
        )
        shared = None
        if self.shared_experts is not None and self.async_with_compute_stream:
            shared = self.shared_experts(x)  # overlaps the dispatch
        event.current_stream_wait()
        recv_in = recv_x.to(x.dtype)
        if self.do_expand:
            weighted = self._run_experts_expanded(recv_in, handle) * recv_topk_weights.unsqueeze(1)
        else:
            weighted = self._run_experts_plain(recv_in, recv_topk_idx, recv_topk_weights)
        combined, _, _ = combine(self.buffer, weighted.to(torch.bfloat16), handle, num_sms=self.num_sms)
        y = combined.to(x.dtype)
        if self.shared_experts is not None:
            y = y + (shared if shared is not None else self.shared_experts(x))
        return y
