"""`ElasticBuffer`: the public facade (DeepEP V2's API) over a backend.

The facade validates every argument (`deep_ep.validation`), owns the communication stream and the
events, and hands normalized requests to one backend object (`deep_ep.backends.base.EPBackend`),
chosen by name through `deep_ep.backends.registry`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from deep_ep import planner
from deep_ep.agrs import AgrsMixin, AgrsState
from deep_ep.backends import registry
from deep_ep.backends.base import BufferConfig, CombineRequest, DispatchRequest, EPBackend, loopback_world_of
from deep_ep.domains import get_physical_domain_size, group_device, logical_domains
from deep_ep.engram import EngramMixin, EngramTable
from deep_ep.errors import EPError, EPTimeoutError
from deep_ep.event import CommStreamScope, EventHandle, EventOverlap, shared_comm_stream
from deep_ep.handle import BufferLifetime, BufferOrigin, EPHandle
from deep_ep.pp import PpMixin, PpState
from deep_ep.records import BUFFER_ALIGNMENT_BYTES
from deep_ep.validation import (
    MAX_RANKS,
    MAX_SCALEOUT_RANKS,
    MAX_SCALEUP_RANKS,
    MAX_TOPK,
    ValidationContext,
    as_bool,
    as_int,
    check_barrier,
    validate_combine,
    validate_dispatch,
)

# The dtype of `topk_idx` (V2's `deep_ep.topk_idx_t`)
topk_idx_t = torch.int64

_buffer_ids = itertools.count(1)


def _in_use_error(buffer: ElasticBuffer) -> RuntimeError:
    return RuntimeError(
        f"ElasticBuffer: called from thread {threading.current_thread().name!r} while thread "
        f"{buffer._user.name!r} is inside a call of the same buffer; a buffer serves one thread at a time "
        "(give each thread its own buffer)"
    )


def _handle_topk_idx(request: DispatchRequest, result: Any) -> torch.Tensor:
    """A fresh dispatch's `EPHandle.topk_idx`: with `do_handle_copy` the backend's copy (the kernels
    make it in the dispatch kernel) or else a clone, without it the request's own tensor."""
    if not request.do_handle_copy:
        return request.topk_idx
    return result.handle_topk_idx if result.handle_topk_idx is not None else request.topk_idx.clone()


def _enter(buffer: ElasticBuffer) -> None:
    """Take `buffer` for this thread's call (the caller releases `buffer._in_use`), or raise
    `RuntimeError` when another thread is inside a call of it: the calls are collective, and two
    threads would interleave their steps (validation and status exchange included)."""
    if not buffer._in_use.acquire(blocking=False):
        raise _in_use_error(buffer)
    buffer._user = threading.current_thread()  # its name only for the error (a property: costs the host)


@contextlib.contextmanager
def _the_only_thread(buffer: ElasticBuffer) -> Iterator[None]:
    """A block inside `_enter(buffer)`."""
    _enter(buffer)
    try:
        yield
    finally:
        buffer._in_use.release()


def _one_thread_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` inside `_enter`, written out: a generator-based context manager costs microseconds
    per call. (`dispatch` and `combine` enter themselves: forwarding their arguments costs too.)"""

    @functools.wraps(method)
    def guarded(self: ElasticBuffer, *args: Any, **kwargs: Any) -> Any:
        _enter(self)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_use.release()

    return guarded


def select_backend_class(group: dist.ProcessGroup, backend: str, agree: bool = True) -> type[EPBackend]:
    """Choose the backend class for `group` through `deep_ep.backends.registry`.

    A registered name (`'kernels'`, `'reference'`) -> that backend's class (an error if it does not
    import or does not support the group); `'auto'` -> the first registered backend that serves the
    group's device, imports, and supports the group on every rank: the kernels (`NvlinkBackend`) when
    the group is one NVLink domain or the virtual ranks of one GPU, else the reference. With `agree`,
    the ranks of an NCCL group exchange their local answers so that all of them choose the same backend.
    """
    names = ("auto", *registry.names())
    if backend not in names:
        raise ValueError(f"ElasticBuffer: `backend` must be one of {names}, got {backend!r}")
    if backend != "auto":
        try:
            backend_class = registry.load(backend)
        except ImportError as error:
            raise ValueError(
                f"ElasticBuffer: `backend`={backend!r} needs {registry.entry(backend).module}, which failed to "
                f"import: {error}"
            ) from error
        if not backend_class.is_supported_by_name(group):
            why = backend_class.unsupported_reason(group) or f"{backend_class.__name__}.is_supported_by_name is False"
            raise ValueError(f"ElasticBuffer: `backend`={backend!r} does not support this group ({why})")
        return backend_class
    device = group_device(group)
    votes = [int(registry.supports(name, group, device.type)) for name in registry.names()]
    # Virtual ranks answer alike by construction (one process, one GPU)
    if agree and device.type == "cuda" and loopback_world_of(group) is None:
        agreed = torch.tensor(votes, dtype=torch.int32, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        votes = agreed.tolist()
    chosen = next((name for name, vote in zip(registry.names(), votes, strict=True) if vote), None)
    if chosen is None:
        raise ValueError(f"ElasticBuffer: no backend of {registry.names()} supports this group on every rank")
    return select_backend_class(group, chosen)


class ElasticBuffer(AgrsMixin, PpMixin, EngramMixin):
    """The expert-parallel communication buffer (dispatch and combine), source-compatible with DeepEP V2.

    Attributes:
        group: the communication group.
        rank_idx: this rank's index in the group.
        num_ranks: the number of ranks in the group.
        device: the device of every tensor argument and result.
        backend: the backend object (`backend.name` says which).
        num_bytes: the buffer size in bytes.
        num_max_tokens_per_rank: the default maximum number of tokens per rank.
        hidden: the hidden size the buffer was sized for (`0` = any).
        num_topk: the top-k the buffer was sized for (`0` = any).
        deterministic, allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute: V2's flags.
        num_allocated_qps: the number of RDMA queue pairs.
        num_scaleout_ranks, num_scaleup_ranks, scaleout_rank_idx, scaleup_rank_idx: the logical domains.
        num_rdma_ranks, num_nvlink_ranks: the physical domains.
        explicitly_destroy: whether `destroy()` must be called (V2).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
        *,
        backend: str = "auto",
        enable_rank_masking: bool = False,
        mask_ranks_on_timeout: bool = False,
    ) -> None:
        """Create the buffer on every rank of `group` (collective).

        Arguments:
            group: the communication group (gloo: CPU tensors; NCCL: tensors on the current CUDA device).
            num_bytes: the buffer size in bytes (a multiple of 2 MiB); `None` sizes it from the MoE shape.
            num_cpu_bytes: V2's Engram CPU buffer; must be 0 (not supported).
            num_max_tokens_per_rank: the default maximum number of tokens per rank (the same on all ranks).
            hidden: the hidden size; calls may use any hidden up to it.
            num_topk: the number of top-k lanes; calls may use up to it (`0`: any).
            use_fp8_dispatch: size the buffer for FP8 dispatch records.
            deterministic: V2's flag; our row order is always deterministic.
            allow_hybrid_mode: allow hierarchical (scale-out + scale-up) communication.
            allow_multiple_reduction: in expand-mode combine, reduce each rank's lanes before sending.
            prefer_overlap_with_compute: prefer fewer SMs.
            sl_idx: V2's RDMA service level (accepted, unused: there is no RDMA path yet).
            num_allocated_qps: RDMA queue pairs to allocate (`0`: V2's default, 129 with hybrid mode
                allowed, 65 on a ConnectX MT4131 NIC, else 17).
            num_cpu_timeout_secs: the deadline of host-side waits.
            num_gpu_timeout_secs: the deadline of device-side waits.
            explicitly_destroy: require an explicit `destroy()` (otherwise the destructor releases).
            backend: ours, keyword-only after V2's arguments: `'auto'`, `'kernels'` or `'reference'` (see
                `select_backend_class`).
            enable_rank_masking: ours: allow `mask_ranks` (dispatches drop the lanes of masked ranks;
                docs/semantics.md, "Rank masking"). Both backends have it.
            mask_ranks_on_timeout: ours, with `enable_rank_masking`: a peer whose start of an operation
                does not come within `num_gpu_timeout_secs` is masked instead of the buffer failing
                (the kernels backend only; docs/semantics.md).

        Every argument keeps V2's position, so a positional V2 call binds the same parameters.
        """
        op = "ElasticBuffer"
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{op}: `group` must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        num_max_tokens_per_rank = as_int(op, "num_max_tokens_per_rank", num_max_tokens_per_rank)
        hidden = as_int(op, "hidden", hidden)
        num_topk = as_int(op, "num_topk", num_topk)
        if not 0 <= num_topk <= MAX_TOPK:
            raise ValueError(f"{op}: `num_topk` must be in [0, {MAX_TOPK}] (0: any; DeepEP V2's limit), got {num_topk}")
        if group.size() > MAX_RANKS:
            raise ValueError(f"{op}: `group` must have <= {MAX_RANKS} ranks (DeepEP V2's limit), got {group.size()}")
        num_allocated_qps = as_int(op, "num_allocated_qps", num_allocated_qps)
        as_int(op, "sl_idx", sl_idx)
        if as_int(op, "num_cpu_bytes", num_cpu_bytes) != 0:
            raise ValueError(f"{op}: `num_cpu_bytes` must be 0 (CPU buffers are not supported), got {num_cpu_bytes}")
        flags = {
            name: as_bool(op, name, value)
            for name, value in (
                ("use_fp8_dispatch", use_fp8_dispatch),
                ("deterministic", deterministic),
                ("allow_hybrid_mode", allow_hybrid_mode),
                ("allow_multiple_reduction", allow_multiple_reduction),
                ("prefer_overlap_with_compute", prefer_overlap_with_compute),
                ("explicitly_destroy", explicitly_destroy),
            )
        }
        for name, value in (
            ("num_cpu_timeout_secs", num_cpu_timeout_secs),
            ("num_gpu_timeout_secs", num_gpu_timeout_secs),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{op}: `{name}` must be a positive number of seconds, got {value!r}")
        backend_class = select_backend_class(group, backend)
        # Physical and logical domains (the host exchange is collective on a real group)
        self.num_rdma_ranks, self.num_nvlink_ranks = get_physical_domain_size(group)
        self.num_scaleout_ranks, self.num_scaleup_ranks = logical_domains(
            (self.num_rdma_ranks, self.num_nvlink_ranks), group.size(), flags["allow_hybrid_mode"]
        )
        if self.num_scaleout_ranks > 1 and (
            self.num_scaleout_ranks > MAX_SCALEOUT_RANKS or self.num_scaleup_ranks > MAX_SCALEUP_RANKS
        ):
            raise ValueError(
                f"{op}: hybrid mode needs <= {MAX_SCALEOUT_RANKS} nodes of <= {MAX_SCALEUP_RANKS} ranks (DeepEP V2's "
                f"limits), got {self.num_scaleout_ranks} nodes of {self.num_scaleup_ranks} ranks; pass "
                "allow_hybrid_mode=False for direct mode"
            )
        hybrid_unsupported = self.num_scaleout_ranks > 1 and backend_class.hybrid_mode_unsupported_reason(
            flags["allow_multiple_reduction"], bool(enable_rank_masking)
        )
        if hybrid_unsupported:
            # Hybrid mode's combine rounds per host first: a backend without it would give other bits
            if backend != "auto":
                raise ValueError(
                    f"{op}: `backend`={backend!r} cannot serve hybrid mode here: {hybrid_unsupported} (the group "
                    f"spans {self.num_scaleout_ranks} hosts and `allow_hybrid_mode` is True); pass "
                    "allow_hybrid_mode=False for direct mode, or backend='reference'"
                )
            backend_class = select_backend_class(group, "reference")
        if num_bytes is None:
            if num_max_tokens_per_rank <= 0 or hidden <= 0:
                raise ValueError(
                    f"{op}: without `num_bytes`, `num_max_tokens_per_rank` and `hidden` must be >= 1 (they size the "
                    f"buffer; 0, no default, needs `num_bytes`), got num_max_tokens_per_rank={num_max_tokens_per_rank}, "
                    f"hidden={hidden}"
                )
            # Across domains in hybrid mode, the window also holds its combine's node partials
            num_bytes = backend_class.get_buffer_size_hint(
                group, num_max_tokens_per_rank, hidden, num_topk, flags["use_fp8_dispatch"],
                flags["allow_hybrid_mode"], flags["allow_multiple_reduction"],
                self.num_scaleup_ranks if self.num_scaleout_ranks > 1 else None,
            )  # fmt: skip
        num_bytes = as_int(op, "num_bytes", num_bytes)
        if num_bytes % BUFFER_ALIGNMENT_BYTES != 0:
            raise ValueError(
                f"{op}: `num_bytes` must be a multiple of {BUFFER_ALIGNMENT_BYTES} (2 MiB), got {num_bytes}"
            )
        if num_allocated_qps == 0:
            num_allocated_qps = planner.default_num_allocated_qps(flags["allow_hybrid_mode"])

        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.device = group_device(group)
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = flags["use_fp8_dispatch"]
        self.deterministic = flags["deterministic"]
        self.allow_hybrid_mode = flags["allow_hybrid_mode"]
        self.allow_multiple_reduction = flags["allow_multiple_reduction"]
        self.prefer_overlap_with_compute = flags["prefer_overlap_with_compute"]
        self.num_allocated_qps = num_allocated_qps
        self.explicitly_destroy = flags["explicitly_destroy"]
        self.enable_rank_masking = as_bool(op, "enable_rank_masking", enable_rank_masking)
        if self.enable_rank_masking and not backend_class.supports_rank_masking:
            raise ValueError(
                f"{op}: `enable_rank_masking`=True needs a backend that masks ranks, got the {backend_class.name!r} "
                "backend, which does not (pass backend='kernels' or 'reference')"
            )
        self.mask_ranks_on_timeout = as_bool(op, "mask_ranks_on_timeout", mask_ranks_on_timeout)
        if self.mask_ranks_on_timeout and not (self.enable_rank_masking and backend_class.supports_mask_on_timeout):
            raise ValueError(
                f"{op}: `mask_ranks_on_timeout`=True needs `enable_rank_masking`=True and a backend whose waits can "
                f"mask a peer (backend='kernels'), got enable_rank_masking={self.enable_rank_masking} and the "
                f"{backend_class.name!r} backend"
            )
        self._masked_ranks: frozenset[int] = frozenset()
        self.buffer_id = next(_buffer_ids)
        # One call at a time: a second thread inside the same buffer would interleave two operations
        # on one window, which every peer would then read as a sequence that diverged
        self._in_use = threading.Lock()
        self._num_cpu_timeout_secs = num_cpu_timeout_secs
        self._agrs = AgrsState(num_max_session_bytes=num_bytes)
        self._pp = PpState()
        self._engram: EngramTable | None = None
        self._user = threading.current_thread()  # the thread inside a call (when one is)
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        config = BufferConfig(
            rank_idx=self.rank_idx,
            num_ranks=self.num_ranks,
            device=self.device,
            num_bytes=num_bytes,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            hidden=hidden,
            num_topk=num_topk,
            use_fp8_dispatch=self.use_fp8_dispatch,
            deterministic=self.deterministic,
            allow_hybrid_mode=self.allow_hybrid_mode,
            allow_multiple_reduction=self.allow_multiple_reduction,
            prefer_overlap_with_compute=self.prefer_overlap_with_compute,
            num_allocated_qps=num_allocated_qps,
            num_cpu_timeout_secs=num_cpu_timeout_secs,
            num_gpu_timeout_secs=num_gpu_timeout_secs,
            enable_rank_masking=self.enable_rank_masking,
            mask_ranks_on_timeout=self.mask_ranks_on_timeout,
            num_scaleup_ranks=self.num_scaleup_ranks,
            physical_domain_size=(self.num_rdma_ranks, self.num_nvlink_ranks),
        )
        self._failure: str | None = None
        self._theoretical_num_sms: dict[tuple[int, int], int] = {}
        self.backend: EPBackend | None = backend_class(group, config)
        self._comm_stream = None
        world = loopback_world_of(group)
        if self.device.type == "cuda":
            # Virtual ranks must never share a stream (torch's pool hands out 32 per priority, round robin)
            self._comm_stream = (
                world.comm_stream(self.rank_idx) if world is not None else shared_comm_stream(self.device)
            )
        # Calls of shapes seen before, replayed without the Python path (the kernels backend's `steady`)
        self._steady = self.backend.steady_path(self._comm_stream, self.buffer_id)
        # Handles share it: one that outlives this buffer can say why it works nowhere
        self._lifetime = BufferLifetime()
        self._origin = BufferOrigin(
            buffer_id=self.buffer_id,
            rank_idx=self.rank_idx,
            num_ranks=self.num_ranks,
            group=weakref.ref(group),
            world=None if world is None else weakref.ref(world),
            lifetime=self._lifetime,
        )
        self._ctx = ValidationContext(
            num_ranks=self.num_ranks,
            device=self.device,
            buffer_id=self.buffer_id,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            hidden=hidden,
            num_topk=num_topk,
            num_allocated_qps=num_allocated_qps,
            deterministic=self.deterministic,
            allow_multiple_reduction=self.allow_multiple_reduction,
            device_checks_topk_values=backend_class.checks_topk_values_on_device,
            backend_name=backend_class.name,
            supports_graph_capture=backend_class.supports_graph_capture,
            origin=self._origin,
        )

        # Without `explicitly_destroy`, the backend is released with the buffer (no communication)
        if not self.explicitly_destroy:
            self._finalizer = weakref.finalize(self, self.backend.destroy)
        # Not at exit: nothing can use a handle then
        weakref.finalize(self, self._lifetime.end, "garbage collected").atexit = False
        self.backend.barrier()

    # Lifetime
    @contextlib.contextmanager
    def _exclusive_call(self, op: str) -> Iterator[float]:
        """One call of the AGRS, PP or Engram API (`deep_ep.agrs`, `.pp`, `.engram`): one thread at a
        time, on a live buffer; yields the host deadline."""
        with _the_only_thread(self):
            self._live_backend(op)
            yield float(self._num_cpu_timeout_secs)

    def _live_backend(self, op: str) -> EPBackend:
        if self.backend is None:
            raise ValueError(
                f"{op}: the buffer must be alive, got a destroyed buffer (create a new ElasticBuffer and dispatch "
                "again: its handles died with it)"
            )
        if self._failure is not None:
            raise ValueError(
                f"{op}: the buffer must be usable, got one that failed earlier ({self._failure}); destroy it"
            )
        return self.backend

    def _checked(self, op: str, backend: EPBackend, check: Callable[[], Any]) -> Any:
        """`check()` (the argument checks of `op`), then `backend.announce`: a rank that rejects its
        input tells its peers before it raises, so that they raise too instead of waiting for it."""
        try:
            request = check()
        except BaseException as error:
            backend.announce(op, error)
            raise
        try:
            backend.announce(op, None)
        except EPTimeoutError as error:  # a peer never came: out of step for good
            self._failure = str(error)
            raise
        return request

    def _run(self, op: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except BaseException as error:
            self._failed(op, error)
            raise

    def _failed(self, op: str, error: BaseException) -> None:
        """Note `error`, raised inside `op`'s backend call: a timeout or an operation left half-way
        fails the buffer."""
        if isinstance(error, EPTimeoutError):
            self._failure = str(error)
        elif self.backend is not None:
            if not isinstance(error, EPError):  # a device fault is every rank's already
                self.backend.fail(op, error)
            # An error that left the backend half-way through an operation makes it unusable
            if self.backend.dead_reason is not None:
                self._failure = self.backend.dead_reason

    def _recorded(self, call: Callable[[], Any], key: tuple | None) -> tuple[Any, Any]:
        """`call()` (the backend's dispatch or combine) and the steady path's recording of it, made
        when `key` has no program yet (else `None`)."""
        steady = self._steady
        recorder = steady.start(key) if steady is not None else None
        try:
            return call(), recorder
        finally:
            if recorder is not None:
                steady.stop()

    def _communicate(
        self,
        op: str,
        run: Callable[[], tuple[Any, tuple, tuple]],
        previous_event: EventHandle | None,
        async_with_compute_stream: Any,
        allocate_on_comm_stream: Any,
    ) -> tuple[Any, EventOverlap]:
        """Run `run` on the communication stream (V2's stream choreography, `CommStreamScope`).

        `run` returns `(value, inputs, outputs)`: the input and output tensors are kept alive on the
        streams that use them. Returns `value` and the event that marks the end of the communication.
        """
        scope = CommStreamScope(
            self._comm_stream,
            previous_event,
            as_bool(op, "async_with_compute_stream", async_with_compute_stream),
            as_bool(op, "allocate_on_comm_stream", allocate_on_comm_stream),
        )
        try:
            value, inputs, outputs = self._run(op, run)
            event = scope.finish(inputs, outputs)
        except BaseException:
            scope.abort()
            raise
        return value, EventOverlap(event)

    def destroy(self) -> None:
        """Release the backend's resources (V2: needs `explicitly_destroy=True`); calling it again is a no-op."""
        if not self.explicitly_destroy:
            raise ValueError(
                "destroy: needs a buffer created with `explicitly_destroy`=True, got explicitly_destroy=False"
            )
        if self.backend is not None:
            self._steady = None
            self.backend.destroy()
            self.backend = None
            self._lifetime.end("destroyed")

    # Rank masking
    @_one_thread_at_a_time
    def mask_ranks(self, ranks: Iterable[int]) -> None:
        """Mask `ranks` from the next dispatch on: no lane is sent to them, and a masked rank sends nothing.

        Local: every rank that goes on must mask the same ranks before its next dispatch (a masked
        rank may be gone and cannot agree). Handles made before are refused afterwards (dispatch again).
        The kernels keep the mask on the device, in stream order: work queued before this call runs
        under the old mask, CUDA-graph replays after it under the new one (no re-capture).

        Arguments:
            ranks: rank indices in `[0, num_ranks)`; added to those masked already.
        """
        if not self.enable_rank_masking:
            raise ValueError("mask_ranks: needs a buffer created with `enable_rank_masking`=True, got False")
        added = set()
        for rank in ranks:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
                raise ValueError(f"mask_ranks: `ranks` must hold rank indices in [0, {self.num_ranks}), got {rank!r}")
            added.add(rank)
        if self._comm_stream is not None and torch.cuda.is_current_stream_capturing():
            raise ValueError("mask_ranks: must be called outside CUDA-graph capture (replays read the mask on the "
                             "device), got a call while the current stream is capturing")  # fmt: skip
        backend = self._live_backend("mask_ranks")
        masked = self._masked_ranks | added
        if masked == self._masked_ranks:
            return  # masked already: no device write (a caller may repeat its set of lost ranks every step)
        self._communicate("mask_ranks", lambda: (backend.set_masked_ranks(masked), (), ()), None, False, False)
        self._masked_ranks = masked

    def get_masked_ranks(self) -> list[int]:
        """The masked ranks, ascending (empty without rank masking): those given to `mask_ranks`, and with
        `mask_ranks_on_timeout` those whose waits expired (read from the device: a host wait)."""
        timed_out = self.backend.timed_out_ranks() if self.backend is not None else frozenset()
        return sorted(self._masked_ranks | timed_out)

    def _check_handle_mask(self, op: str, handle: EPHandle | None) -> None:
        if handle is not None and self.enable_rank_masking and handle.masked_ranks != self._masked_ranks:
            raise ValueError(
                f"{op}: `handle` must come from a dispatch under the current mask ({sorted(self._masked_ranks)}), got one "
                f"made with masked ranks {sorted(handle.masked_ranks)}; dispatch again"
            )

    # Sizes and topology
    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """Return the recommended buffer size in bytes (2 MiB aligned) for the MoE shape, without communication.

        Arguments:
            group: the communication group.
            num_max_tokens_per_rank: the maximum number of tokens per rank.
            hidden: the hidden size.
            num_topk: the number of top-k lanes (`0`: the worst case).
            use_fp8_dispatch: whether dispatch sends FP8 data with scales.
            allow_hybrid_mode: whether hybrid mode may be used.
            allow_multiple_reduction: whether expand-mode combine reduces before sending.

        Returns:
            num_bytes: the size, a multiple of 2 MiB.
        """
        backend_class = select_backend_class(group, "auto", agree=False)
        return backend_class.get_buffer_size_hint(
            group,
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            use_fp8_dispatch,
            allow_hybrid_mode,
            allow_multiple_reduction,
        )

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """Return the SM count for dispatch/combine that the planner picks for this buffer (memoized).

        The planner (`deep_ep.planner`, docs/planner.md) models the time of a dispatch and a combine of
        `num_max_tokens_per_rank` tokens of `hidden` (FP8 or BF16 dispatch as the buffer was sized) on
        this group's NVLink domains from the calibrated rates of our kernels, and returns the fewest
        even SMs within a few percent of the time at half the device's SMs (at least 64 without
        `prefer_overlap_with_compute`). A buffer created without `num_max_tokens_per_rank` or `hidden`
        is planned for 4096 tokens of hidden 7168.

        Arguments:
            num_experts: the number of experts.
            num_topk: the number of top-k lanes.
            num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs: DeepEP V2's model inputs,
                accepted for its callers; our planner uses its calibrated rates instead (docs/planner.md).

        Returns:
            num_sms: the SM count, at most the device's (132 SMs are assumed without CUDA).
        """
        cache = self._theoretical_num_sms
        key = (num_experts, num_topk)
        if key not in cache:
            num_device_sms = None
            if self.device.type == "cuda":
                num_device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            try:
                cache[key] = planner.theoretical_num_sms(
                    num_tokens=self.num_max_tokens_per_rank or planner.DEFAULT_PLAN_TOKENS,
                    hidden=self.hidden or planner.DEFAULT_PLAN_HIDDEN,
                    num_topk=num_topk,
                    num_experts=num_experts,
                    use_fp8_dispatch=self.use_fp8_dispatch,
                    num_ranks=self.num_ranks,
                    num_ranks_per_domain=self.num_nvlink_ranks,
                    use_hybrid=self.allow_hybrid_mode and self.num_rdma_ranks > 1,
                    prefer_overlap_with_compute=self.prefer_overlap_with_compute,
                    num_device_sms=num_device_sms,
                )
            except ValueError as error:
                raise ValueError(f"get_theoretical_num_sms: {error}") from error
        return cache[key]

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Return the RDMA queue-pair count for `num_sms` SMs (V2's rule, `deep_ep.planner`), at most
        `num_allocated_qps`.

        Arguments:
            num_sms: the SM count of the call.

        Returns:
            num_qps: `num_sms * 16 + 1` whenever hybrid mode is allowed (as V2, even inside one
                domain), else `min(num_sms, 9)`.
        """
        return min(planner.theoretical_num_qps(num_sms, self.allow_hybrid_mode), self.num_allocated_qps)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """Return `(num_rdma_ranks, num_nvlink_ranks)`: the group's hosts and the ranks on each."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """Return `(num_scaleout_ranks, num_scaleup_ranks)`: one scale-up domain per host with hybrid mode
        allowed across hosts, else `(1, num_ranks)`."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    # Streams and events
    @staticmethod
    def capture() -> EventHandle:
        """Capture an event on the current CUDA stream (a completed placeholder without CUDA).

        Returns:
            event: the `EventHandle`.
        """
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """Return the communication stream (`None` for a CPU group)."""
        return self._comm_stream

    @_one_thread_at_a_time
    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait until every rank reached the barrier (collective, with the CPU deadline).

        Arguments:
            use_comm_stream: run on the communication stream (else the current stream).
            with_cpu_sync: synchronize the device before and after.
            sequential: V2's flag (ignored: there is one domain).
        """
        backend = self._live_backend("barrier")
        check_barrier(self._ctx)
        stream = self._comm_stream if use_comm_stream else None
        if with_cpu_sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run("barrier", backend.barrier)
            torch.cuda.current_stream().wait_stream(stream)
        else:
            self._run("barrier", backend.barrier)
        if with_cpu_sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # Communication
    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send every token to the ranks that own its experts (collective). See `docs/semantics.md`.

        Arguments:
            x: `[T, H]` of any real dtype whose row is a multiple of 16 bytes (`torch.bfloat16`,
                `torch.float8_e4m3fn`, `torch.float16`, `torch.uint8` packed FP4, ...), moved as raw bytes;
                or a tuple `(data, scales)`: data as before, scales `[T, S]` `torch.float32` or `torch.int32`
                (4-byte packs, e.g. FP32 per 128 elements `S = ceil(H / 128)`, MXFP8 per 32, packed UE8M0),
                any `S >= 1` and any strides. `recv_x` keeps the dtype.
            topk_idx: `[T, K]` `deep_ep.topk_idx_t` (`torch.int64`), global expert ids, `-1` = none; `None`
                with a cached `handle`.
            topk_weights: `[T, K]` `torch.float32`, carried unchanged, or `None`.
            cumulative_local_expert_recv_stats: `[L]` `torch.int32`, incremented in place by the per-expert
                counts, or `None`.
            num_experts: the number of experts `E` (a multiple of the number of ranks); from the handle if cached.
            num_max_tokens_per_rank: `Tmax` (default: the buffer's, or the handle's).
            expert_alignment: align each local expert's row count to this (default 1).
            num_sms: SMs to use (`0`: `get_theoretical_num_sms`).
            num_qps: queue pairs to use (`0`: `get_theoretical_num_qps`).
            previous_event: an event the communication waits for (needs `allocate_on_comm_stream`).
            previous_event_before_epilogue: an event the epilogue waits for (the writes of the outputs
                after the communication), not the communication itself (V2's rule).
            async_with_compute_stream: do not make the current stream wait; use the returned event.
            allocate_on_comm_stream: outputs belong to the communication stream's memory pool.
            handle: a cached handle of an earlier dispatch (then `topk_idx` must be `None`).
            do_handle_copy: store a clone of `topk_idx` in the handle (else the tensor itself).
            do_cpu_sync: exact output shapes (`None`: `True`, or `False` with a handle).
            do_expand: one row per (token, local expert), each expert's block aligned.
            do_zero_padding: zero the alignment padding rows (needs `do_expand`).
            use_tma_aligned_col_major_sf: return the scales column-major, strides `(1, align(rows, 4))`.

        Returns:
            recv_x: `[rows, H]` like `x` (a tuple `(data, scales)` for FP8).
            recv_topk_idx: `[rows, K]` `torch.int64` local expert ids or `-1`; `None` in expand mode.
            recv_topk_weights: `[rows, K]` (expand: `[rows]`) `torch.float32`, or `None` without weights.
            handle: the `EPHandle` (the given one for a cached dispatch).
            event: an `EventOverlap` marking the end of the communication.
        """
        _enter(self)  # not `_one_thread_at_a_time`: forwarding every argument costs the host microseconds
        try:
            steady, key = self._steady, None
            if steady is not None:
                front = steady.front
                args = (x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                        num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                        previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream, handle,
                        do_handle_copy, do_cpu_sync, do_expand, do_zero_padding, use_tma_aligned_col_major_sf)  # fmt: skip
                if self._failure is None and not self._agrs.engine_open:
                    try:  # a shape with a program: replayed by the front (steady_front.cpp)
                        done = front.dispatch(*args)
                    except BaseException as error:
                        self._failed("dispatch", error)
                        raise
                    if done is not None:
                        return done
                key = front.dispatch_key(*args)
            return self._dispatch_python(
                key, x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts, num_max_tokens_per_rank,
                expert_alignment, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                async_with_compute_stream, allocate_on_comm_stream, handle, do_handle_copy, do_cpu_sync, do_expand,
                do_zero_padding, use_tma_aligned_col_major_sf,
            )  # fmt: skip
        finally:
            self._in_use.release()

    def _dispatch_python(
        self, key: tuple | None, x: Any, topk_idx: Any, topk_weights: Any, cumulative_local_expert_recv_stats: Any,
        num_experts: Any, num_max_tokens_per_rank: Any, expert_alignment: Any, num_sms: Any, num_qps: Any,
        previous_event: Any, previous_event_before_epilogue: Any, async_with_compute_stream: Any,
        allocate_on_comm_stream: Any, handle: Any, do_handle_copy: Any, do_cpu_sync: Any, do_expand: Any,
        do_zero_padding: Any, use_tma_aligned_col_major_sf: Any,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:  # fmt: skip
        """`dispatch` on the Python path (every argument checked, the backend's launch sequence), which
        the steady path records under `key` when that shape has no program yet."""
        backend, steady = self._live_backend("dispatch"), self._steady

        def check() -> DispatchRequest:
            self._check_window_free("dispatch")
            request = validate_dispatch(
                self._ctx,
                self.get_theoretical_num_sms,
                self.get_theoretical_num_qps,
                x=x,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                num_experts=num_experts,
                num_max_tokens_per_rank=num_max_tokens_per_rank,
                expert_alignment=expert_alignment,
                num_sms=num_sms,
                num_qps=num_qps,
                previous_event=previous_event,
                previous_event_before_epilogue=previous_event_before_epilogue,
                async_with_compute_stream=async_with_compute_stream,
                allocate_on_comm_stream=allocate_on_comm_stream,
                handle=handle,
                do_cpu_sync=do_cpu_sync,
                do_expand=do_expand,
                do_zero_padding=do_zero_padding,
                use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                do_handle_copy=do_handle_copy,
            )
            self._check_handle_mask("dispatch", handle)
            if self._masked_ranks:  # a copy of the request only where a mask applies
                request = dataclasses.replace(request, masked_ranks=self._masked_ranks)
            return request

        request = self._checked("dispatch", backend, check)

        def run() -> tuple[Any, tuple, tuple]:
            result, recorder = self._recorded(lambda: backend.dispatch(request), key)
            out_handle = handle
            if out_handle is None:
                out_handle = EPHandle(
                    do_expand=request.do_expand,
                    num_experts=request.num_experts,
                    expert_alignment=request.expert_alignment,
                    num_max_tokens_per_rank=request.num_max_tokens_per_rank,
                    num_sms=request.num_sms,
                    topk_idx=_handle_topk_idx(request, result),
                    num_recv_tokens=result.num_recv_tokens,
                    num_expanded_tokens=result.num_expanded_tokens,
                    # V2: an empty list when the counts were not synchronized to the host
                    num_recv_tokens_per_expert_list=result.num_recv_tokens_per_expert_list or [],
                    psum_num_recv_tokens_per_scaleup_rank=result.psum_num_recv_tokens_per_scaleup_rank,
                    psum_num_recv_tokens_per_expert=result.psum_num_recv_tokens_per_expert,
                    num_unaligned_recv_tokens_per_expert=result.num_unaligned_recv_tokens_per_expert,
                    recv_src_metadata=result.recv_src_metadata,
                    dst_buffer_slot_idx=result.dst_buffer_slot_idx,
                    num_tokens=request.num_tokens,
                    num_topk=request.num_topk,
                    hidden=request.hidden,
                    buffer_id=self.buffer_id,
                    do_cpu_sync=request.do_cpu_sync,
                    scale_kind=request.scale_kind,
                    backend_state=result.backend_state,
                    buffer_origin=self._origin,
                    masked_ranks=request.masked_ranks,
                    num_masked_lanes=result.num_masked_lanes,
                )
            inputs = (
                request.x,
                request.scales,
                request.topk_idx,
                request.topk_weights,
                request.cumulative_local_expert_recv_stats,
            )
            outputs: tuple = (result.recv_x, result.recv_scales, result.recv_topk_idx, result.recv_topk_weights)
            if handle is None:
                # A new handle's tensors; a cached dispatch's were recorded by the dispatch that made
                # them (a tensor's streams are kept until it is freed)
                outputs += (
                    out_handle.topk_idx, out_handle.psum_num_recv_tokens_per_scaleup_rank,
                    out_handle.psum_num_recv_tokens_per_expert, out_handle.num_unaligned_recv_tokens_per_expert,
                    out_handle.recv_src_metadata, out_handle.dst_buffer_slot_idx,
                )  # fmt: skip
            if recorder is not None:
                steady.record_dispatch(key, recorder, steady.front.dispatch_inputs(x, topk_idx, topk_weights,
                                       cumulative_local_expert_recv_stats, handle), result, out_handle, handle is None,
                                       request, async_with_compute_stream,
                                       allocate_on_comm_stream)  # fmt: skip
            return (result, out_handle), inputs, outputs

        (result, handle), event = self._communicate(
            "dispatch", run, previous_event, async_with_compute_stream,
            allocate_on_comm_stream,
        )  # fmt: skip
        recv_x = result.recv_x if result.recv_scales is None else (result.recv_x, result.recv_scales)
        return recv_x, result.recv_topk_idx, result.recv_topk_weights, handle, event

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Send every received row back to its token's rank and reduce there (collective).

        Arguments:
            x: `[rows, H]` `torch.bfloat16`, rows = `handle.num_recv_tokens` (expand: `handle.num_expanded_tokens`).
            handle: the `EPHandle` of a dispatch of this buffer.
            topk_weights: `[rows, K]` (expand: `[rows]`) `torch.float32`, transported back, or `None`.
            bias: `None`, `[T, H]` `torch.bfloat16`, or a tuple of two, added after the reduction.
            num_sms: SMs to use (`0`: the handle's).
            num_qps: queue pairs to use (`0`: `get_theoretical_num_qps`).
            previous_event: an event the communication waits for (needs `allocate_on_comm_stream`).
            previous_event_before_epilogue: an event the epilogue waits for (the writes of the outputs
                after the communication), not the communication itself (V2's rule).
            async_with_compute_stream: do not make the current stream wait; use the returned event.
            allocate_on_comm_stream: outputs belong to the communication stream's memory pool.

        Returns:
            combined_x: `[T, H]` `torch.bfloat16`: from +0.0 in FP32, the biases first, then one partial per
                holder rank in ascending order of its last top-k lane (per lane without multiple
                reduction), rounded once (DeepEP V2's order, docs/semantics.md).
            combined_topk_weights: `[T, K]` `torch.float32` (the holders' weights, `0` on `-1` lanes), or `None`.
            event: an `EventOverlap` marking the end of the communication.
        """
        _enter(self)  # as dispatch
        try:
            steady, key = self._steady, None
            if steady is not None:
                front = steady.front
                args = (x, handle, topk_weights, bias, num_sms, num_qps, previous_event, previous_event_before_epilogue,
                        async_with_compute_stream, allocate_on_comm_stream)  # fmt: skip
                if self._failure is None and not self._agrs.engine_open:
                    try:  # as dispatch
                        done = front.combine(*args)
                    except BaseException as error:
                        self._failed("combine", error)
                        raise
                    if done is not None:
                        return done
                key = front.combine_key(*args)
            return self._combine_python(key, x, handle, topk_weights, bias, num_sms, num_qps, previous_event,
                                        previous_event_before_epilogue, async_with_compute_stream,
                                        allocate_on_comm_stream)  # fmt: skip
        finally:
            self._in_use.release()

    def _combine_python(
        self, key: tuple | None, x: Any, handle: Any, topk_weights: Any, bias: Any, num_sms: Any, num_qps: Any,
        previous_event: Any, previous_event_before_epilogue: Any, async_with_compute_stream: Any,
        allocate_on_comm_stream: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:  # fmt: skip
        """`combine` on the Python path, recorded for the steady path under `key` (as `_dispatch_python`)."""
        backend, steady = self._live_backend("combine"), self._steady

        def check() -> CombineRequest:
            self._check_window_free("combine")
            self._check_handle_mask("combine", handle)
            return validate_combine(
                self._ctx,
                self.get_theoretical_num_qps,
                x=x,
                handle=handle,
                topk_weights=topk_weights,
                bias=bias,
                num_sms=num_sms,
                num_qps=num_qps,
                previous_event=previous_event,
                previous_event_before_epilogue=previous_event_before_epilogue,
                async_with_compute_stream=async_with_compute_stream,
                allocate_on_comm_stream=allocate_on_comm_stream,
            )

        request = self._checked("combine", backend, check)

        def run() -> tuple[Any, tuple, tuple]:
            result, recorder = self._recorded(lambda: backend.combine(request), key)
            if recorder is not None:
                inputs = steady.front.combine_inputs(x, handle, topk_weights, bias)
                steady.record_combine(key, recorder, inputs, result, request, async_with_compute_stream,
                                      allocate_on_comm_stream)  # fmt: skip
            inputs = (request.x, request.topk_weights, request.bias_0, request.bias_1)
            return result, inputs, (result.combined_x, result.combined_topk_weights)

        result, event = self._communicate(
            "combine", run, previous_event, async_with_compute_stream,
            allocate_on_comm_stream,
        )  # fmt: skip
        return result.combined_x, result.combined_topk_weights, event
