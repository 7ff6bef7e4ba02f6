"""All-gather and reduce-scatter sessions (AGRS) on `ElasticBuffer`: DeepEP V2's experimental API, plus
the reduce-scatter V2 does not have.

A session (`with buffer.agrs_new_session(): ...`, or `create_agrs_session()` ... `destroy_agrs_session()`)
holds at most `num_max_session_bytes` of gathered data in at most `num_max_all_gathers_per_session`
calls (`agrs_set_config`; by default the buffer's bytes and 1024 calls). Every call is collective. On
torch collectives the ranks first agree on the call's shapes and dtypes (one small all-gather, with
the buffer's host deadline), so a disagreement raises the same `ValueError` on every rank instead of a
hang, and a peer that never joins raises `EPTimeoutError`. Through the backend's engine the host
agrees on nothing (V2 does not either): the device compares each call's signature with every peer's
(`EPOperationMismatchError` when they differ), a rank that rejects its arguments stops the buffer on
every rank (`EPPeerError` there), and a peer that never joins makes the device wait expire.

The data moves as the backend says (`EPBackend.agrs`): on the kernels backend inside one NVLink
domain, by the copy engines straight into the peers' windows (`deep_ep.backends.kernels.agrs`:
gathered tensors are views of the window, valid until the session ends, as V2's); elsewhere by
torch collectives over the buffer's group, the CPU path and the oracle (gathered tensors are then
ordinary tensors). An in-place tensor is an ordinary tensor that `all_gather` reads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deep_ep.errors import EPPeerError, EPTimeoutError
from deep_ep.host_reads import host_list, wait_for_stream, wait_for_work
from deep_ep.records import BUFFER_ALIGNMENT_BYTES, WORKSPACE_BYTES
from deep_ep.utils.math import align

# Every gathered tensor takes a multiple of this many bytes of a session (V2: `LDG.256`)
SESSION_ALIGNMENT_BYTES = 32
DEFAULT_MAX_ALL_GATHERS_PER_SESSION = 1024
REDUCE_SCATTER_DTYPES = (torch.bfloat16, torch.float32)

Shapes = tuple[int, ...] | torch.Size | Sequence[tuple[int, ...] | torch.Size]


def _as_shape_list(shapes: Shapes) -> tuple[list[tuple[int, ...]], bool]:
    """`(shapes, batched)`: one shape (a tuple of ints) or a sequence of shapes."""
    if len(shapes) > 0 and isinstance(shapes[0], (tuple, list, torch.Size)):
        return [tuple(int(d) for d in shape) for shape in shapes], True
    return [tuple(int(d) for d in shapes)], False


def session_bytes(num_ranks: int, shapes: Shapes, dtype: torch.dtype) -> int:
    """Bytes a session uses to gather tensors of `shapes` (local shapes) and `dtype` from `num_ranks`
    ranks: each gathered tensor rounded up to 32 bytes (DeepEP V2's rule)."""
    shape_list, _ = _as_shape_list(shapes)
    return sum(align(num_ranks * math.prod(s) * dtype.itemsize, SESSION_ALIGNMENT_BYTES) for s in shape_list)


@dataclass
class AgrsState:
    """A buffer's AGRS configuration and its open session's use of it."""

    num_max_session_bytes: int
    num_max_all_gathers_per_session: int = DEFAULT_MAX_ALL_GATHERS_PER_SESSION
    is_open: bool = False
    num_used_bytes: int = 0
    num_used_calls: int = 0
    # The backend's data path opened the session (its barrier is queued) and must close it
    engine_open: bool = False


class AgrsMixin:
    """The AGRS methods of `ElasticBuffer` (which provides `group`, `num_ranks`, `rank_idx`, `device`,
    `num_bytes`, `backend`, `_comm_stream`, `_agrs` and `_exclusive_call`)."""

    group: dist.ProcessGroup
    num_ranks: int
    rank_idx: int
    device: torch.device
    num_bytes: int
    backend: Any
    _comm_stream: torch.cuda.Stream | None
    _agrs: AgrsState
    _exclusive_call: Callable[[str], contextlib.AbstractContextManager[float]]

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup, shapes: Shapes, dtype: torch.dtype) -> int:
        """Return the bytes one session uses to gather tensors of `shapes` (one shape or several,
        the local shapes before gathering) and `dtype`: each gathered tensor rounded up to 32 bytes."""
        return session_bytes(group.size(), shapes, dtype)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """Return the buffer bytes (2 MiB aligned) for sessions of at most `num_max_session_bytes`: the
        sessions' data and the window's workspace (the kernels backend keeps a session in its window)."""
        del group  # V2's signature; the size does not depend on it
        return align(num_max_session_bytes + WORKSPACE_BYTES, BUFFER_ALIGNMENT_BYTES)

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        """Set the limits of the next sessions (collective: every rank must pass the same values).

        Arguments:
            num_max_session_bytes: the most bytes of gathered data in one session (at most the
                buffer's `num_bytes`; see `get_agrs_num_max_session_bytes`).
            num_max_all_gathers_per_session: the most `all_gather` and `reduce_scatter` calls in one session.
        """
        op = "agrs_set_config"
        with self._exclusive_call(op) as timeout_s:
            for name, value in (("num_max_session_bytes", num_max_session_bytes),
                                ("num_max_all_gathers_per_session", num_max_all_gathers_per_session)):  # fmt: skip
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{op}: `{name}` must be a positive int, got {value!r}")
            if num_max_session_bytes > self.num_bytes:
                raise ValueError(
                    f"{op}: `num_max_session_bytes` must be <= the buffer's num_bytes = {self.num_bytes}, got "
                    f"{num_max_session_bytes} (size the buffer with get_agrs_buffer_size_hint)"
                )
            if self._agrs.is_open:
                raise ValueError(f"{op}: needs no open AGRS session, got one open (destroy_agrs_session first)")
            self._agree(op, f"{num_max_session_bytes}:{num_max_all_gathers_per_session}", timeout_s)
            self._agrs = AgrsState(num_max_session_bytes, num_max_all_gathers_per_session)

    def create_agrs_session(self) -> None:
        """Begin an AGRS session; pair it with `destroy_agrs_session` (or use `agrs_new_session`)."""
        with self._exclusive_call("create_agrs_session"):
            if self._agrs.is_open:
                raise ValueError("create_agrs_session: needs no open AGRS session, got one open (sessions do not nest)")
            self._agrs.is_open, self._agrs.num_used_bytes, self._agrs.num_used_calls = True, 0, 0

    def destroy_agrs_session(self) -> None:
        """End the open AGRS session (collective: every rank ends it before any rank starts the next)."""
        op = "destroy_agrs_session"
        with self._exclusive_call(op) as timeout_s:
            if not self._agrs.is_open:
                raise ValueError(f"{op}: needs an open AGRS session, got none (create_agrs_session first)")
            self._agrs.is_open = False
            if self.backend.agrs() is None:
                self._agree(op, "", timeout_s)
            elif self._agrs.engine_open:
                # Every rank's reads of this session's blocks (queued before) end before any window is
                # written again: the barrier (device deadline) is the session's only collective step
                self._agrs.engine_open = False
                stream = torch.cuda.current_stream(self.device)
                self.backend.agrs().end_session(stream)
                if self._comm_stream is not None:
                    self._comm_stream.wait_stream(stream)

    @contextlib.contextmanager
    def agrs_new_session(self, enabled: bool = True) -> Iterator[None]:
        """A context manager around `create_agrs_session` / `destroy_agrs_session`; a no-op when not
        `enabled`. When the block raises, the session ends on this rank only (no collective, which
        could wait for a peer that failed too) and the block's exception propagates."""
        if not enabled:
            yield
            return
        self.create_agrs_session()
        try:
            yield
        except BaseException:
            self._agrs.is_open = self._agrs.engine_open = False
            raise
        self.destroy_agrs_session()

    def agrs_get_inplace_tensor(self, shapes: Shapes, dtype: torch.dtype) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Return tensor(s) to fill and then pass to `all_gather` (in an open session).

        Arguments:
            shapes: one shape, or a sequence of shapes (batched).
            dtype: their dtype.

        Returns:
            One uninitialised tensor of `shapes` on the buffer's device, or a tuple of them when batched.
        """
        with self._exclusive_call("agrs_get_inplace_tensor"):
            if not self._agrs.is_open:
                raise ValueError("agrs_get_inplace_tensor: needs an open AGRS session, got none (agrs_new_session())")
            shape_list, batched = _as_shape_list(shapes)
            tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for shape in shape_list)
        return tensors if batched else tensors[0]

    def all_gather(self, t: torch.Tensor | Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """Gather every rank's tensor(s) (collective, in an open session).

        Arguments:
            t: a contiguous tensor `[*S]` of any dtype on the buffer's device, or a sequence of them;
                every rank passes the same shapes and dtypes.

        Returns:
            `(gathered, wait)` for one tensor, `(*gathered, wait)` for a sequence: `gathered` is
            `[num_ranks, *S]`, rank `r`'s tensor at index `r`, bit for bit; `wait()` returns once the
            data is there (the host polls, with its deadline; the data is also ordered on the
            current stream).
        """
        return self._gather_or_reduce("all_gather", t)

    def reduce_scatter(self, t: torch.Tensor | Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """Sum every rank's contribution to this rank (collective, in an open session; ours, V2 has none).

        Arguments:
            t: a contiguous tensor `[num_ranks, *S]` of `torch.bfloat16` or `torch.float32` on the
                buffer's device (row `r` is this rank's contribution to rank `r`), or a sequence of them.

        Returns:
            `(reduced, wait)` for one tensor, `(*reduced, wait)` for a sequence: `reduced` is `[*S]`
            in `t`'s dtype, the sum from +0.0 in FP32 of the ranks' rows for this rank in ascending
            rank order, rounded once; bit for bit the same on every backend.
        """
        return self._gather_or_reduce("reduce_scatter", t)

    def _check_window_free(self, op: str) -> None:
        """Raise `ValueError` while an open session's data is in the buffer's window (the kernels
        backend's path): a dispatch or combine would write over it, and peers' calls into ours."""
        if self._agrs.engine_open:
            raise ValueError(
                f"{op}: needs the buffer's window, which holds the open AGRS session's data; end the session first "
                "(destroy_agrs_session, or leave agrs_new_session)"
            )

    # -------------------------------------------------------------------------------- the collectives

    def _gather_or_reduce(self, op: str, t: torch.Tensor | Sequence[torch.Tensor]) -> tuple[Any, ...]:
        with self._exclusive_call(op) as timeout_s:
            if not self._agrs.is_open:
                raise ValueError(f"{op}: needs an open AGRS session, got none (call it inside `agrs_new_session()`)")
            engine = self.backend.agrs()
            if engine is not None:
                return self._engine_call(engine, op, t)
            tensors: list[torch.Tensor] = []
            error = None
            try:
                tensors = self._checked_tensors(op, t)
            except (TypeError, ValueError) as rejected:
                error = rejected
            self._agree(op, _call_text(tensors), timeout_s, error)
            self._count(op, tensors)
            gather, reduce = self._gathered, self._reduced
            results = [(gather if op == "all_gather" else reduce)(x, timeout_s) for x in tensors]
        return (*results, _completed)

    def _engine_call(self, engine: Any, op: str, t: torch.Tensor | Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """A call through the backend's engine: no host agreement (the device compares the call's
        signature with every peer's); a rank that rejects its arguments stops the buffer on every rank."""
        try:
            tensors = self._checked_tensors(op, t)
            offsets = self._count(op, tensors)
        except (TypeError, ValueError) as rejected:
            engine.reject(op, rejected)
            raise
        signature = zlib.crc32(f"{op}:{_call_text(tensors)}".encode())
        stream = torch.cuda.current_stream(self.device)
        if not self._agrs.engine_open:
            # No peer writes into a window whose dispatch or combine may still be read
            if self._comm_stream is not None:
                stream.wait_stream(self._comm_stream)
            engine.begin_session(stream)
            self._agrs.engine_open = True
        call = engine.all_gather if op == "all_gather" else engine.reduce_scatter
        results = [call(x, offset, stream, signature) for x, offset in zip(tensors, offsets, strict=True)]
        return (*results, functools.partial(engine.wait, stream, f"{op}'s data"))

    def _checked_tensors(self, op: str, t: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        tensors = [t] if isinstance(t, torch.Tensor) else list(t)
        if not tensors:
            raise ValueError(f"{op}: `t` must be a tensor or a non-empty sequence of tensors, got an empty sequence")
        for i, x in enumerate(tensors):
            name = "t" if isinstance(t, torch.Tensor) else f"t[{i}]"
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(x).__name__}")
            if x.device != self.device:
                raise ValueError(f"{op}: `{name}` must be on device {self.device} (the buffer's), got {x.device}")
            if not x.is_contiguous():
                raise ValueError(f"{op}: `{name}` must be contiguous, got strides {list(x.stride())}")
            if op == "reduce_scatter":
                if x.dtype not in REDUCE_SCATTER_DTYPES:
                    raise TypeError(f"{op}: `{name}` must have dtype torch.bfloat16 or torch.float32, got {x.dtype}")
                if x.dim() < 1 or x.shape[0] != self.num_ranks:
                    raise ValueError(f"{op}: `{name}` must be [num_ranks = {self.num_ranks}, ...], got {list(x.shape)}")
        return tensors

    def _count(self, op: str, tensors: list[torch.Tensor]) -> list[int]:
        """Count the call against the open session's limits (the same on every rank: they agreed);
        returns where each tensor's data lands among the session's bytes."""
        # What lands here: every rank's tensor (all-gather), or every rank's row for us (reduce-scatter)
        factor = self.num_ranks if op == "all_gather" else 1
        sizes = [align(factor * x.numel() * x.element_size(), SESSION_ALIGNMENT_BYTES) for x in tensors]
        num_bytes = sum(sizes)
        state = self._agrs
        if state.num_used_bytes + num_bytes > state.num_max_session_bytes:
            raise ValueError(
                f"{op}: the session holds `num_max_session_bytes` = {state.num_max_session_bytes} bytes, "
                f"{state.num_used_bytes} are used and this call needs {num_bytes} (raise it with agrs_set_config)"
            )
        if state.num_used_calls + 1 > state.num_max_all_gathers_per_session:
            raise ValueError(
                f"{op}: the session holds `num_max_all_gathers_per_session` = "
                f"{state.num_max_all_gathers_per_session} calls, all used (raise it with agrs_set_config)"
            )
        offsets = [state.num_used_bytes + sum(sizes[:i]) for i in range(len(sizes))]
        state.num_used_bytes += num_bytes
        state.num_used_calls += 1
        return offsets

    def _agree(self, op: str, what: str, timeout_s: float, error: BaseException | None = None) -> None:
        agree_on_call(self, op, what, timeout_s, error)

    def _gathered(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.num_ranks)]
        work = dist.all_gather([p.reshape(-1).view(torch.uint8) for p in parts], x.reshape(-1).view(torch.uint8),
                               group=self.group, async_op=True)  # fmt: skip
        wait_collective(work, timeout_s, "all_gather's data", self)
        return torch.stack(parts)

    def _reduced(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor:
        chunk = x[0].numel()
        received = torch.empty_like(x)
        work = dist.all_to_all_single(received.view(-1), x.view(-1), [chunk] * self.num_ranks,
                                      [chunk] * self.num_ranks, group=self.group, async_op=True)  # fmt: skip
        wait_collective(work, timeout_s, "reduce_scatter's data", self)
        acc = torch.zeros(x.shape[1:], dtype=torch.float32, device=self.device)
        for source in range(self.num_ranks):
            acc = acc + received[source].float()
        return acc.to(x.dtype)


def _call_text(tensors: list[torch.Tensor]) -> str:
    """What a call's ranks must agree on: its tensors' dtypes and shapes."""
    return ";".join(f"{x.dtype}{tuple(x.shape)}" for x in tensors)


def agree_on_call(buffer: Any, op: str, what: str, timeout_s: float, error: BaseException | None = None) -> None:
    """Every rank of `buffer`'s group checks that every peer makes the same call `op` with the same
    `what`, and that none rejected its arguments (`error`: it raises its own, the others
    `EPPeerError`); one all-gather with the host deadline `timeout_s`."""
    code = zlib.crc32(what.encode()) if error is None else -1
    if buffer.device.type == "cuda":
        # Copying the row to the device waits in the driver for the stream, which may hold an earlier
        # call's wait for the peers: drain it by polling first (deep_ep.host_reads, virtual ranks)
        wait_for_stream()
    row = torch.tensor([zlib.crc32(op.encode()), code], dtype=torch.int64, device=buffer.device)
    rows = [torch.empty_like(row) for _ in range(buffer.num_ranks)]
    wait_collective(
        dist.all_gather(rows, row, group=buffer.group, async_op=True), timeout_s, f"{op}'s agreement", buffer
    )
    table = host_list(torch.stack(rows))
    if error is not None:
        raise error
    rejected = [rank for rank, (_, c) in enumerate(table) if c == -1]
    if rejected:
        raise EPPeerError(f"{op}: rank(s) {rejected} rejected their arguments (see their errors); nothing moved")
    if any(r != table[0] for r in table):
        differ = [rank for rank, r in enumerate(table) if r != table[buffer.rank_idx]]
        raise ValueError(
            f"{op}: every rank must make the same call with the same shapes and dtypes; ranks {differ} "
            f"differ from rank {buffer.rank_idx}'s ({what or op})"
        )


def _completed() -> None:
    """The wait of a call whose data is already in place."""


def wait_collective(work: dist.Work, timeout_s: float, what: str, buffer: Any) -> None:
    """Wait for `work` with the host deadline `timeout_s`; `EPTimeoutError` naming `buffer`'s rank past it."""
    if not wait_for_work(work, timeout_s):
        raise EPTimeoutError(
            f"rank {buffer.rank_idx} of {buffer.num_ranks} waited more than {timeout_s:g} s for {what}; "
            "a peer did not join (it failed, hangs, or called a different method)"
        )
