"""Pipeline-parallel send/recv on `ElasticBuffer`: DeepEP V2's experimental API, to any rank of the group
(V2: the previous and next rank of the ring only).

`pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)` sets the largest tensor and how many
sends to one rank may be unreceived at once; `pp_send(t, dst)` returns once `t` is copied (the caller
may reuse it at once), waiting first, with the host deadline, while `num_max_inflight_tensors` sends
to `dst` are still unreceived (back-pressure); `pp_recv(t, src)` fills `t` with `src`'s next tensor
(messages of one pair arrive in order). A tensor whose size differs from the sender's raises
`ValueError` on the receiver; no message by the deadline raises `EPTimeoutError`.

On the kernels backend inside one NVLink domain the tensors move with the copy engines through a ring
of slots in the windows, to any rank (`deep_ep.backends.kernels.pp`): calls return once queued on
the current stream, and a receive of the wrong size raises at the buffer's next call. Elsewhere, and
where the window cannot hold a ring for every peer, they move over the group's own point-to-point
calls: the CPU path and the oracle. V2's `num_sms` is accepted and unused (no SM copies).
"""

from __future__ import annotations

import contextlib
import datetime
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from deep_ep.agrs import agree_on_call
from deep_ep.errors import EPTimeoutError
from deep_ep.host_reads import host_list
from deep_ep.records import BUFFER_ALIGNMENT_BYTES
from deep_ep.utils.math import align

# A tensor takes a multiple of this many bytes of a slot (V2: `LDG.256`)
SLOT_ALIGNMENT_BYTES = 32


@dataclass
class PpState:
    """A buffer's PP configuration and its unreceived sends per destination."""

    num_max_tensor_bytes: int = 0  # 0: not configured
    num_max_inflight_tensors: int = 0
    pending: dict[int, deque[tuple[Any, torch.Tensor]]] = field(default_factory=dict)
    engine: Any = None  # the backend's ring (`EPBackend.pp`), or None: the group's point-to-point calls


class PpMixin:
    """The PP methods of `ElasticBuffer` (which provides `group`, `num_ranks`, `rank_idx`, `device`,
    `num_bytes`, `backend`, `_comm_stream`, `_pp`, `_check_window_free` and `_exclusive_call`, its
    guard of one call)."""

    group: dist.ProcessGroup
    num_ranks: int
    rank_idx: int
    device: torch.device
    num_bytes: int
    backend: Any
    _comm_stream: torch.cuda.Stream | None
    _pp: PpState
    _check_window_free: Callable[[str], None]
    _exclusive_call: Callable[[str], contextlib.AbstractContextManager[float]]

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """Return the buffer bytes (2 MiB aligned) for PP: V2's ring of send and receive slots for the
        previous and next rank, `num_max_inflight_tensors` of `num_max_tensor_bytes` (32-byte aligned) each."""
        return align(align(num_max_tensor_bytes, SLOT_ALIGNMENT_BYTES) * num_max_inflight_tensors * 2 * 2,
                     BUFFER_ALIGNMENT_BYTES)  # fmt: skip

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> None:
        """Set the largest tensor and the sends in flight per destination (collective: every rank the
        same values). Over the group's calls, every rank's earlier sends are received first; through
        the window's ring, unreceived ones are dropped.

        Arguments:
            num_max_tensor_bytes: the most bytes of one tensor.
            num_max_inflight_tensors: the most unreceived sends to one rank.
        """
        op = "pp_set_config"
        with self._exclusive_call(op) as timeout_s:
            for name, value in (("num_max_tensor_bytes", num_max_tensor_bytes),
                                ("num_max_inflight_tensors", num_max_inflight_tensors)):  # fmt: skip
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{op}: `{name}` must be a positive int, got {value!r}")
            needed = self.get_pp_buffer_size_hint(num_max_tensor_bytes, num_max_inflight_tensors)
            if needed > self.num_bytes:
                raise ValueError(
                    f"{op}: the buffer holds {self.num_bytes} bytes, these limits need {needed} "
                    "(get_pp_buffer_size_hint)"
                )
            self._check_window_free(op)
            agree_on_call(self, op, f"{num_max_tensor_bytes}:{num_max_inflight_tensors}", timeout_s)
            for dst in list(self._pp.pending):
                self._drain(dst, 0, timeout_s, op)
            engine = self.backend.pp()
            if engine is not None and not engine.fits(num_max_tensor_bytes, num_max_inflight_tensors):
                engine = None  # V2's hint holds two neighbours' rings; ours keeps one for every peer
            if engine is None:
                _wait(self.group.barrier(), timeout_s, f"{op}'s barrier", self.rank_idx)
            else:
                stream = torch.cuda.current_stream(self.device)
                if self._comm_stream is not None:
                    stream.wait_stream(self._comm_stream)  # no peer writes where a dispatch may still read
                engine.configure(num_max_tensor_bytes, num_max_inflight_tensors, stream, op)
            self._pp = PpState(num_max_tensor_bytes, num_max_inflight_tensors, engine=engine)

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        """Send `t` to rank `dst_rank_idx` (any other rank of the group).

        Arguments:
            t: a contiguous tensor of any dtype on the buffer's device, at most `num_max_tensor_bytes`.
            dst_rank_idx: the receiving rank.
            num_sms: V2's; unused (no SM copies here).
        """
        op = "pp_send"
        with self._exclusive_call(op) as timeout_s:
            self._check(op, t, "dst_rank_idx", dst_rank_idx)
            if self._pp.engine is not None:
                self._pp.engine.send(t, dst_rank_idx, torch.cuda.current_stream(self.device))
                return
            self._drain(dst_rank_idx, 2 * (self._pp.num_max_inflight_tensors - 1), timeout_s, op)
            staged = t.detach().reshape(-1).view(torch.uint8).clone()  # the caller may reuse `t` at once
            header = torch.tensor([staged.numel()], dtype=torch.int64, device=self.device)
            # Both works and tensors stay alive until the send completes (gloo aborts a dropped send)
            pending = self._pp.pending.setdefault(dst_rank_idx, deque())
            pending.append((self.group.send([header], dst_rank_idx, 0), header))
            pending.append((self.group.send([staged], dst_rank_idx, 0), staged))

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        """Fill `t` with the next tensor rank `src_rank_idx` sent us.

        Arguments:
            t: a contiguous tensor of the sent tensor's size in bytes, on the buffer's device (written in place).
            src_rank_idx: the sending rank.
            num_sms: V2's; unused.
        """
        op = "pp_recv"
        with self._exclusive_call(op) as timeout_s:
            self._check(op, t, "src_rank_idx", src_rank_idx)
            if self._pp.engine is not None:
                self._pp.engine.recv(t, src_rank_idx, torch.cuda.current_stream(self.device))
                return
            header = torch.empty(1, dtype=torch.int64, device=self.device)
            _wait(self.group.recv([header], src_rank_idx, 0), timeout_s, f"{op} from rank {src_rank_idx}",
                  self.rank_idx)  # fmt: skip
            num_sent = host_list(header)[0]
            target = t.reshape(-1).view(torch.uint8)
            received = target if num_sent == target.numel() else torch.empty(num_sent, dtype=torch.uint8,
                                                                              device=self.device)  # fmt: skip
            _wait(self.group.recv([received], src_rank_idx, 0), timeout_s, f"{op} from rank {src_rank_idx}",
                  self.rank_idx)  # fmt: skip
            if received is not target:
                raise ValueError(
                    f"{op}: `t` must hold the {num_sent} bytes rank {src_rank_idx} sent, got {target.numel()} "
                    "(the message was consumed)"
                )

    def _check(self, op: str, t: Any, peer_name: str, peer: Any) -> None:
        if self._pp.num_max_tensor_bytes == 0:
            raise ValueError(f"{op}: needs `pp_set_config(num_max_tensor_bytes, num_max_inflight_tensors)` first")
        if (
            isinstance(peer, bool)
            or not isinstance(peer, int)
            or not 0 <= peer < self.num_ranks
            or peer == self.rank_idx
        ):
            raise ValueError(
                f"{op}: `{peer_name}` must be another rank in [0, {self.num_ranks}) than {self.rank_idx}, got {peer!r}"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `t` must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device or not t.is_contiguous():
            raise ValueError(
                f"{op}: `t` must be contiguous on {self.device}, got {t.device} strides {list(t.stride())}"
            )
        if t.numel() * t.element_size() > self._pp.num_max_tensor_bytes:
            raise ValueError(
                f"{op}: `t` must have at most `num_max_tensor_bytes` = {self._pp.num_max_tensor_bytes} bytes, got "
                f"{t.numel() * t.element_size()}"
            )

    def _drain(self, dst: int, keep: int, timeout_s: float, op: str) -> None:
        """Wait (with the deadline) until at most `keep` works (a header and a tensor per send) to `dst` are pending."""
        pending = self._pp.pending.get(dst, deque())
        while len(pending) > keep:
            work, _ = pending.popleft()
            _wait(work, timeout_s, f"{op}: rank {dst} to receive an earlier tensor", self.rank_idx)


def _wait(work: Any, timeout_s: float, what: str, rank: int) -> None:
    # NOTES: gloo's point-to-point work never reports completion to a poll: it waits with a timeout
    # (which completed work of virtual ranks does not take)
    if work.is_completed():
        work.wait()
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as error:
        if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
            raise
        raise EPTimeoutError(
            f"PP: rank {rank} waited more than {timeout_s:g} s for {what}; the peer did not take part "
            "(it failed, hangs, or called a different method)"
        ) from error
