"""The interface between `ElasticBuffer` (the facade) and the objects that move the data.

`ElasticBuffer` validates every argument, owns the communication stream and the events, and then
hands one normalized request to a backend: `deep_ep.backends.reference` (torch collectives, any
process group) or `deep_ep.backends.kernels` (the JIT-compiled NVLink kernels). A backend
never validates user input again and never touches streams other than the current one.

Notation used below: `N` ranks, this rank `r`, `E` experts, `L = E / N` local experts (rank `r` owns
global experts `[r * L, (r + 1) * L)`), `T` tokens on this rank, `H` hidden, `K` top-k lanes,
`S` 4-byte scale packs per token (any count, e.g. `ceil(H / 128)` FP32 scales, `ceil(H / 32)` for MXFP8),
`Tmax` = `num_max_tokens_per_rank`, `a` = `expert_alignment`, `align(n, a)` = `n` rounded up to a
multiple of `a`. `R` is the number of distinct tokens this rank receives, `count_e` the number of
(token, lane) pairs routed to local expert `e`. The exact semantics are written in `docs/semantics.md`;
every backend must produce bitwise the same real rows as the reference backend.

Streams: the facade calls `dispatch`, `combine` and `barrier` with the buffer's communication stream
as the current CUDA stream (after it waited for the compute stream or `previous_event`). A backend
enqueues all its device work on the current stream and allocates its outputs with the ordinary torch
allocator while that stream is current; the facade then records events and `record_stream`s. On CPU
process groups there are no streams and the same calls simply run.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from deep_ep import planner
from deep_ep.host_reads import host_list
from deep_ep.utils.math import align

if TYPE_CHECKING:
    from deep_ep.event import EventHandle
    from deep_ep.handle import EPHandle


def loopback_world_of(group: Any) -> Any:
    """The `deep_ep.loopback.LoopbackWorld` of a group of virtual ranks, else `None` (without
    importing `deep_ep.loopback`, whose import sets CUDA environment variables for virtual ranks)."""
    return getattr(group, "loopback_world", None)


# Scale packs of the TMA-aligned column-major layout are padded to this many tokens
TMA_ALIGNED_SF_TOKENS = 4


class ScaleKind(str, enum.Enum):
    """The format of the FP8 scales that travel with the data (the library never converts them)."""

    NONE = "none"
    """No scales (data of any dtype alone)."""
    FP32 = "fp32"
    """`torch.float32` `[T, S]`: e.g. one scale per 128-element block (`S = ceil(H / 128)`) or per 32 (MXFP8)."""
    UE8M0 = "ue8m0"
    """`torch.int32` `[T, S]`: e.g. 4 biased exponents per word, byte `j` of word `w` = block `4w + j`."""


@dataclass(frozen=True)
class BufferConfig:
    """What a backend is constructed with (the facade's validated constructor arguments).

    Attributes:
        rank_idx: this rank `r` in the group.
        num_ranks: the group size `N`.
        device: the device of every tensor: `cpu` for gloo groups, the current `cuda:i` for NCCL groups.
        num_bytes: the buffer size in bytes (2 MiB aligned); `0` when the backend needs none.
        num_max_tokens_per_rank: the default `Tmax` (`0` = every call passes its own).
        hidden: the hidden size the buffer was sized for (`0` = not given); calls use at most this.
        num_topk: the top-k the buffer was sized for (`0` = not given); calls use at most this.
        use_fp8_dispatch: whether the buffer was sized for FP8 dispatch records.
        deterministic: V2's flag (our row order is always deterministic).
        allow_hybrid_mode: whether hierarchical (scale-out + scale-up) mode may be used.
        allow_multiple_reduction: the expand-mode combine rule (see `CombineRequest`).
        prefer_overlap_with_compute: prefer fewer SMs.
        num_allocated_qps: the number of RDMA queue pairs allocated.
        num_cpu_timeout_secs: the deadline of every host-side wait.
        num_gpu_timeout_secs: the deadline of every device-side wait.
        enable_rank_masking: whether dispatches honour masked ranks (`DispatchRequest.masked_ranks`).
        mask_ranks_on_timeout: rank masking's automatic mode: a peer whose wait expires is masked
            instead of the buffer failing (`EPBackend.supports_mask_on_timeout`).
        num_scaleup_ranks: ranks per logical scale-up domain (consecutive ranks); fewer than
            `num_ranks` in hybrid mode, whose combine reduces each domain's partials first (`0`: all).
        physical_domain_size: `(hosts, ranks per host)` as the facade counted them (`None`: not
            counted; a backend that needs them counts them itself, collectively).
    """

    rank_idx: int
    num_ranks: int
    device: torch.device
    num_bytes: int
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    use_fp8_dispatch: bool
    deterministic: bool
    allow_hybrid_mode: bool
    allow_multiple_reduction: bool
    prefer_overlap_with_compute: bool
    num_allocated_qps: int
    num_cpu_timeout_secs: float
    num_gpu_timeout_secs: float
    enable_rank_masking: bool = False
    mask_ranks_on_timeout: bool = False
    num_scaleup_ranks: int = 0
    physical_domain_size: tuple[int, int] | None = None


@dataclass(frozen=True)
class DispatchRequest:
    """One validated, normalized dispatch call.

    Every tensor is on the buffer's device. Input tensors are never modified, except
    `cumulative_local_expert_recv_stats`.

    Attributes:
        x: `[T, H]` data of any real dtype (moved as raw bytes, never cast), contiguous, `T <= Tmax`, `T` may
            be 0, `H * x.element_size()` a multiple of 16.
        scales: `None`, or `[T, S]` (any `S >= 1`) with `torch.float32` (`ScaleKind.FP32`) or `torch.int32`
            (`ScaleKind.UE8M0`), arbitrary strides (V2 accepts e.g. a column-major scale tensor).
        scale_kind: the format of `scales`.
        topk_idx: `[T, K]` with `torch.int64`, contiguous, values in `[-1, E)`, no repeated expert in a
            row; for a cached dispatch this is `cached_handle.topk_idx`.
        topk_weights: `[T, K]` with `torch.float32`, contiguous, or `None`.
        cumulative_local_expert_recv_stats: `[L]` with `torch.int32`, contiguous, or `None`; the backend
            adds `count_e` to element `e` (in place), also in a cached dispatch.
        num_experts: `E`, a multiple of `N`.
        num_max_tokens_per_rank: `Tmax` (the same on all ranks, by contract).
        expert_alignment: `a >= 1`.
        num_sms: the SM count to use (resolved, `> 0`).
        num_qps: the queue-pair count to use (resolved, `> 0`).
        do_cpu_sync: exact output shapes (`True`) or worst-case shapes (`False`, see `DispatchResult`).
            Always `False` for a cached dispatch (which reuses the shapes of `cached_handle`).
        do_expand: the expanded layout (one row per (token, local expert)).
        do_zero_padding: zero the alignment padding rows of the expanded layout (implies `do_expand`).
        use_tma_aligned_col_major_sf: return the scales as `[rows, S]` with strides
            `(1, align(rows, 4))` (storage `[S, align(rows, 4)]`, transposed view).
        deterministic: the buffer's flag (informational: the row order is always the one documented).
        allow_multiple_reduction: the buffer's flag (informational for dispatch).
        cached_handle: the handle of an earlier dispatch of this buffer (same routing, same mode), or
            `None`. With a handle, the backend reuses its layout and `backend_state`.
        masked_ranks: the ranks masked on this buffer (`ElasticBuffer.mask_ranks`): a fresh dispatch
            sends nothing to them (their experts' lanes count as `-1`), and a masked rank sends
            nothing itself. Empty without rank masking.
        previous_event_before_epilogue: an event the epilogue (the writes of the outputs after the
            communication) waits for, not the communication (`wait_before_epilogue`).
        do_handle_copy: a fresh dispatch's handle keeps a copy of `topk_idx`, which a backend may
            make itself (`DispatchResult.handle_topk_idx`; else the facade clones it).
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    scale_kind: ScaleKind
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor | None
    cumulative_local_expert_recv_stats: torch.Tensor | None
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    num_sms: int
    num_qps: int
    do_cpu_sync: bool
    do_expand: bool
    do_zero_padding: bool
    use_tma_aligned_col_major_sf: bool
    deterministic: bool
    allow_multiple_reduction: bool
    cached_handle: EPHandle | None
    masked_ranks: frozenset[int] = frozenset()
    previous_event_before_epilogue: EventHandle | None = None
    do_handle_copy: bool = False

    def wait_before_epilogue(self) -> None:
        """Make the current stream wait for `previous_event_before_epilogue` (a no-op without one):
        called by the backend between its communication and its epilogue (DeepEP V2's rule)."""
        if self.previous_event_before_epilogue is not None:
            self.previous_event_before_epilogue.current_stream_wait()

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def hidden(self) -> int:
        return self.x.shape[1]

    @property
    def num_topk(self) -> int:
        return self.topk_idx.shape[1]


def apply_rank_mask(
    topk_idx: torch.Tensor, masked_ranks: frozenset[int], rank_idx: int, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing a fresh dispatch sends under rank masking, and what that dropped.

    Arguments:
        topk_idx: `[T, K]` `torch.int64` global expert ids or `-1`.
        masked_ranks: the masked ranks; `rank_idx` among them masks every lane.
        rank_idx: the dispatching rank.
        num_local_experts: `L` (rank `r` owns experts `[r*L, (r+1)*L)`).

    Returns:
        routing: `[T, K]` `torch.int64`, `topk_idx` with the dropped lanes set to `-1` (a new tensor).
        num_masked_lanes: `[1]` `torch.int32`, the valid lanes dropped.
    """
    valid = topk_idx >= 0
    if rank_idx in masked_ranks:
        dropped = valid
    else:
        masked = torch.tensor(sorted(masked_ranks), dtype=torch.int64, device=topk_idx.device)
        dropped = valid & torch.isin(torch.div(topk_idx, num_local_experts, rounding_mode="floor"), masked)
    return topk_idx.masked_fill(dropped, -1), dropped.sum().reshape(1).to(torch.int32)


def check_topk_idx_values(op: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Check the values of a routing table: `-1 <= topk_idx < num_experts` and no repeated expert in
    a row (one host sync). Raises the `ValueError` that names the first bad value.

    Arguments:
        op: the call, for the message (`'dispatch'`).
        topk_idx: `[T, K]` `torch.int64`, on any device.
        num_experts: `E`.
    """
    if topk_idx.numel() == 0:
        return
    out_of_range = (topk_idx < -1) | (topk_idx >= num_experts)
    ordered = topk_idx.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    has_out_of_range, has_repeated = host_list(torch.stack([out_of_range.any(), repeated.any()]))
    if has_out_of_range:
        token, lane = (int(v) for v in out_of_range.nonzero()[0].tolist())
        raise ValueError(
            f"{op}: `topk_idx` values must be in [-1, {num_experts}) (num_experts = {num_experts}), "
            f"got {int(topk_idx[token, lane])} at [{token}, {lane}]"
        )
    if has_repeated:
        token = int(repeated.any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"{op}: `topk_idx` rows must not repeat an expert, got row {token} = {topk_idx[token].tolist()}"
        )


@dataclass(frozen=True)
class DispatchResult:
    """What a backend's dispatch returns (the facade turns it into the V2 return tuple and `EPHandle`).

    Row counts: `num_recv_tokens` rows for the non-expanded outputs and `recv_src_metadata`;
    `num_expanded_tokens` rows for the expanded outputs.
    - With CPU sync: `num_recv_tokens = R` and `num_expanded_tokens = sum_e align(count_e, a)`.
    - Without (worst case, what a kernel can allocate before the counts are known):
      `num_recv_tokens = N * Tmax` and
      `num_expanded_tokens = align(N * Tmax * min(K, L) + L * (a - 1), a)`; rows past the real ones
      (`R`, resp. `sum_e align(count_e, a)`) are unspecified.
    - A cached dispatch returns the counts (and shapes) of the dispatch that made the handle.

    Attributes:
        recv_x: non-expand `[num_recv_tokens, H]`, expand `[num_expanded_tokens, H]`, dtype of `x`.
            Non-expand rows are grouped by source rank ascending and, inside a group, in source token
            order. Expand: local expert `e`'s block starts at `offset_e = sum_{j<e} align(count_j, a)`
            and holds its (token, lane) pairs ordered by (source rank, source token); the padding rows
            after each block are zero with `do_zero_padding`, unspecified otherwise.
        recv_scales: `None` for BF16; else the scales of `recv_x`'s rows, same dtype as `scales`,
            row-major `[rows, S]` or, with `use_tma_aligned_col_major_sf`, strides `(1, align(rows, 4))`.
        recv_topk_idx: non-expand `[num_recv_tokens, K]` with `torch.int64` (local expert id for lanes whose
            expert is on this rank, `-1` otherwise); `None` in expand mode.
        recv_topk_weights: `None` if no weights were dispatched; non-expand `[num_recv_tokens, K]`
            `torch.float32` (the source row, all lanes, unchanged); expand `[num_expanded_tokens]`
            `torch.float32` (the weight of the row's lane; `0` on padding rows with `do_zero_padding`).
        num_recv_tokens: see above (`int`).
        num_expanded_tokens: see above (`int`), in both modes.
        num_recv_tokens_per_expert_list: `[align(count_e, a) for e in range(L)]` with CPU sync, else `None`.
        psum_num_recv_tokens_per_scaleup_rank: `[N]` `torch.int32`, inclusive prefix sum of the number of
            rows received from each source rank (last element = `R`), exact in both sync modes.
        psum_num_recv_tokens_per_expert: `[L]` `torch.int32`, non-expand: inclusive prefix sum of
            `align(count_e, a)`; expand: `offset_e + count_e`.
        num_unaligned_recv_tokens_per_expert: `[L]` `torch.int32`, `count_e`.
        recv_src_metadata: `[num_recv_tokens, 2 + K]` `torch.int32`, one row per received token in the
            non-expand row order: `src_rank * Tmax + src_token_idx`, `src_rank * K + master lane` (the
            token's highest lane whose expert is local), then per lane the expanded row of that (token,
            lane) if the lane's expert is local and `do_expand`, else `-1`.
        dst_buffer_slot_idx: `[T, K]` `torch.int32`: on the token's highest lane to each destination rank,
            `rank * Tmax + slot` (slot: its index among this rank's tokens sent there); `-1` on its other
            lanes to that rank and on `-1` lanes.
        backend_state: anything the backend needs later for a cached dispatch or a combine.
        num_masked_lanes: `[1]` `torch.int32`, the lanes of this rank's tokens that rank masking dropped
            (their expert is on a masked rank, or this rank is masked); `None` without rank masking.
        handle_topk_idx: `[T, K]` `torch.int64`, the copy of `topk_idx` a fresh dispatch with
            `do_handle_copy` made for its handle (the kernels make it in the dispatch kernel, which reads
            every row anyway: no copy launch of its own), or `None` (the facade clones `topk_idx`).
    """

    recv_x: torch.Tensor
    recv_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens: int
    num_expanded_tokens: int
    num_recv_tokens_per_expert_list: list[int] | None
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    num_unaligned_recv_tokens_per_expert: torch.Tensor
    recv_src_metadata: torch.Tensor
    dst_buffer_slot_idx: torch.Tensor
    backend_state: Any
    num_masked_lanes: torch.Tensor | None = None
    handle_topk_idx: torch.Tensor | None = None


def worst_case_num_recv_tokens(num_ranks: int, num_max_tokens_per_rank: int) -> int:
    """Rows of the non-expanded outputs without CPU sync: every rank sends all its tokens here."""
    return num_ranks * num_max_tokens_per_rank


def worst_case_num_expanded_tokens(
    num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_local_experts: int, expert_alignment: int
) -> int:
    """Rows of the expanded outputs without CPU sync (DeepEP V2's bound).

    Every token brings at most `min(K, L)` (token, local expert) pairs and every expert's block adds
    at most `a - 1` padding rows: `align(N * Tmax * min(K, L) + L * (a - 1), a)`.
    """
    num_rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    return align(num_rows + num_local_experts * (expert_alignment - 1), expert_alignment)


@dataclass(frozen=True)
class CombineRequest:
    """One validated, normalized combine call.

    Attributes:
        x: `[rows, H]` `torch.bfloat16`, contiguous, `rows = handle.num_recv_tokens` (non-expand) or
            `handle.num_expanded_tokens` (expand); only the real rows are read.
        handle: the handle of a dispatch of this buffer (`T = handle.num_tokens` tokens combine back).
        topk_weights: `None`; non-expand `[rows, K]` `torch.float32`; expand `[rows]` `torch.float32`.
        bias_0: `[T, H]` `torch.bfloat16`, contiguous, or `None`.
        bias_1: `[T, H]` `torch.bfloat16`, contiguous, or `None` (only given together with `bias_0`).
        num_sms: the SM count (resolved, `> 0`).
        num_qps: the queue-pair count (resolved, `> 0`).
        allow_multiple_reduction: the expand-mode rule. `True`: each holder rank first sums its local
            lanes' rows (FP32, lanes ascending) and rounds to BF16, one row per (token, holder) travels.
            `False`: every lane's row travels and only the home rank sums.
        previous_event_before_epilogue: an event the reduction into the outputs waits for.

    Result (`CombineResult`), DeepEP V2's order: `combined_x[t]` = `+0.0` (FP32), plus `fp32(bias_0[t])`,
    plus `fp32(bias_1[t])`, plus `fp32(contribution_d(t))` for the holder ranks `d` of token `t` in
    ascending order of their last top-k lane (expand without multiple reduction: each valid lane's
    row, lanes ascending), then one rounding to BF16.
    """

    x: torch.Tensor
    handle: EPHandle
    topk_weights: torch.Tensor | None
    bias_0: torch.Tensor | None
    bias_1: torch.Tensor | None
    num_sms: int
    num_qps: int
    allow_multiple_reduction: bool
    previous_event_before_epilogue: EventHandle | None = None

    def wait_before_epilogue(self) -> None:
        """As `DispatchRequest.wait_before_epilogue`: before the reduction into the outputs."""
        if self.previous_event_before_epilogue is not None:
            self.previous_event_before_epilogue.current_stream_wait()


@dataclass(frozen=True)
class CombineResult:
    """What a backend's combine returns.

    Attributes:
        combined_x: `[T, H]` `torch.bfloat16`.
        combined_topk_weights: `None` if the request had no weights; else `[T, K]` `torch.float32`: lane `k`
            holds the weight the holder rank of lane `k`'s expert gave for that lane (non-expand: its
            `topk_weights[row of t, k]`; expand: `topk_weights[expanded row of (t, k)]`), `0` on `-1` lanes.
    """

    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor | None


class EPBackend(abc.ABC):
    """The data-moving half of an `ElasticBuffer`; see the module docstring for the contract.

    A backend is constructed on every rank of the group at the same time (construction may communicate)
    and is used by one buffer only. Its methods are called collectively: every rank of the group calls
    the same method in the same order.
    """

    name: ClassVar[str] = "abstract"
    # True: a CPU-sync dispatch checks `topk_idx` values on the device, sends nothing when they are
    # bad and raises the facade's `ValueError` from its wait (the facade then skips its host check)
    checks_topk_values_on_device: ClassVar[bool] = False
    # True: dispatch without CPU sync, cached dispatch and combine wait for nothing on the host, so a
    # CUDA graph can record them (the facade refuses every call of other backends inside a capture)
    supports_graph_capture: ClassVar[bool] = False
    # True: honours `DispatchRequest.masked_ranks` (`ElasticBuffer(enable_rank_masking=True)`)
    supports_rank_masking: ClassVar[bool] = False
    supports_mask_on_timeout: ClassVar[bool] = False
    # True: serves hybrid mode (a group across hosts with `allow_hybrid_mode`: each host's partials
    # reduced first, `BufferConfig.num_scaleup_ranks`); else only direct mode
    supports_hybrid_mode: ClassVar[bool] = True

    @classmethod
    def hybrid_mode_unsupported_reason(cls, allow_multiple_reduction: bool, enable_rank_masking: bool) -> str | None:
        """Why this backend cannot serve hybrid mode with these flags, or None when it can."""
        return None if cls.supports_hybrid_mode else "it has no hybrid mode"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        self.group = group
        self.config = config

    def agrs(self) -> Any | None:
        """What moves AGRS data for this backend (`deep_ep.agrs`: `begin_session`, `all_gather`,
        `reduce_scatter`, `end_session`), or None: torch collectives over the group."""
        return None

    def pp(self) -> Any | None:
        """What moves pipeline sends for this backend (`deep_ep.pp`: `configure`, `send`, `recv`), or
        None: the group's point-to-point calls."""
        return None

    def engram(self) -> Any | None:
        """What holds Engram's table and fetches from it (`deep_ep.engram`: `write`, `fetch`), or None:
        a replicated table gathered over the group."""
        return None

    @classmethod
    def is_supported(cls, group: dist.ProcessGroup) -> bool:
        """Whether this backend can serve `group`, from this rank (local answer, no communication);
        any group by default."""
        return True

    @classmethod
    def is_supported_by_name(cls, group: dist.ProcessGroup) -> bool:
        """Whether this backend can serve `group` when asked for by name (`ElasticBuffer(backend=name)`);
        `is_supported` by default. A backend that `backend='auto'` keeps off some groups it can serve
        answers more here than there."""
        return cls.is_supported(group)

    @classmethod
    def unsupported_reason(cls, group: dist.ProcessGroup) -> str | None:
        """Why this backend cannot serve `group` (one sentence), or `None` when it can or cannot say."""
        return None

    @classmethod
    def get_buffer_size_hint(
        cls,
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        num_ranks_per_domain: int | None = None,
    ) -> int:
        """Return the buffer bytes for the MoE shape (2 MiB aligned; `deep_ep.planner.buffer_size_hint`:
        the NVLink window layout, so a buffer sized here also fits the kernels; with
        `num_ranks_per_domain`, hybrid mode's across the group's domains); no communication."""
        return planner.buffer_size_hint(
            group.size(), num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, allow_hybrid_mode,
            allow_multiple_reduction, num_ranks_per_domain,
        )  # fmt: skip

    @property
    def dead_reason(self) -> str | None:
        """Why the backend can no longer be used (a device fault, or an exception in the middle of
        an operation), or `None` while it can."""
        return None

    def announce(self, op: str, error: BaseException | None) -> None:  # noqa: B027 (optional hook)
        """Called by every rank once per `op` (dispatch or combine) after checking its arguments,
        before any communication: `error` is what rejected them, or `None`. A backend tells its peers
        of a rejection here, so that they raise at once (`EPPeerError`) instead of waiting for this
        rank until their deadline. The default does nothing."""

    def fail(self, op: str, error: BaseException) -> None:  # noqa: B027 (optional hook)
        """`op` raised `error` on this rank after `announce`: tell the peers where a backend can
        (they may wait in this operation for this rank). The default does nothing."""

    def timed_out_ranks(self) -> frozenset[int]:
        """The peers masked by rank masking's automatic mode so far (their waits expired); none by default."""
        return frozenset()

    def set_masked_ranks(self, masked_ranks: frozenset[int]) -> None:  # noqa: B027 (optional hook)
        """The mask changed (`ElasticBuffer.mask_ranks`, local): a backend that keeps it on the device
        writes it here, in stream order on the current stream, so that CUDA-graph replays see it too.
        The default does nothing (the backend reads `DispatchRequest.masked_ranks`)."""

    def steady_path(self, comm_stream: Any, buffer_id: int) -> Any:
        """The backend's steady path for calls of shapes seen before (an object with the interface of
        `deep_ep.backends.kernels.steady.SteadyPath`), or `None` (the default): every call runs
        `dispatch` and `combine` below."""
        return None

    @abc.abstractmethod
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Send every token to the ranks that own its experts (collective)."""

    @abc.abstractmethod
    def combine(self, request: CombineRequest) -> CombineResult:
        """Send every received row back to its token's rank and reduce there (collective)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reached this call (collective, with the CPU deadline)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the backend's resources; must not communicate, may be called more than once."""
