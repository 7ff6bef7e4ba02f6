"""Pipeline-parallel send/recv inside one NVLink domain on the kernels backend (pp.cuh, docs/semantics.md).

`pp_set_config` keeps a ring at the end of every rank's window (`tail.py`): for each other rank
`num_max_inflight_tensors` slots of `num_max_tensor_bytes` (32-byte aligned), after the ring's flags.
A send queues, on the current stream: a one-warp kernel that waits (device deadline) until the
receiver has freed the message's slot (only once the pair's ring has gone round), the copy-engine copy
of the tensor straight into that slot of the receiver's window, and a one-warp kernel that stores the
message's size and number into the receiver's flags. A receive queues the mirror image: wait for
the message (checking its size), the copy-engine copy out of our slot, and the store that frees the
slot in the sender's flags. So the data moves with no SM; the flag kernels take one warp for a moment.

Calls return once their work is queued: the tensor of a send may be reused in stream order, a
received tensor is there in stream order. A receive whose tensor is not the message's size is
found on the device and raised (`ValueError`) at the buffer's next call; a peer that never sends or
never receives makes the device wait expire (`EPTimeoutError`).
"""

from __future__ import annotations

import torch

from deep_ep.jit import Opaque
from deep_ep.utils.math import align

from . import specs
from .layout import MAX_RANKS
from .runtime import NvlinkRuntime, data_ptr
from .tail import REGION_ALIGNMENT_BYTES

SLOT_ALIGNMENT_BYTES = 32  # V2's: `LDG.256`


def ring_header_bytes(num_slots: int) -> int:
    """The ring's flags (pp.cuh's `PpRegion`): per rank an arrival and a free counter, per (rank, slot) a size."""
    return align(2 * MAX_RANKS * 4 + MAX_RANKS * num_slots * 8, REGION_ALIGNMENT_BYTES)


def ring_bytes(num_ranks: int, num_max_tensor_bytes: int, num_slots: int) -> int:
    """Bytes of a ring in every rank's window: its flags, then `num_slots` slots for each other rank."""
    slot_bytes = align(num_max_tensor_bytes, SLOT_ALIGNMENT_BYTES)
    return ring_header_bytes(num_slots) + (num_ranks - 1) * num_slots * slot_bytes


class NvlinkPp:
    """The pipeline sends and receives of one buffer whose peers are all reached by stores."""

    def __init__(self, runtime: NvlinkRuntime) -> None:
        self.runtime = runtime
        self.region_offset = -1  # -1: no ring configured
        self.num_slots = 0
        self.slot_bytes = 0
        self._num_sent = [0] * runtime.num_ranks  # messages to each rank so far
        self._num_received = [0] * runtime.num_ranks

    def fits(self, num_max_tensor_bytes: int, num_slots: int) -> bool:
        """Whether the window's data region can keep a ring of these sizes."""
        return self.runtime.tail.fits("pp", ring_bytes(self.runtime.num_ranks, num_max_tensor_bytes, num_slots))

    def configure(self, num_max_tensor_bytes: int, num_slots: int, stream: torch.cuda.Stream, op: str) -> None:
        """Keep the ring and start it empty on every rank (collective): unreceived messages are dropped.
        Barriers before and after the reset: no peer's earlier flag store lands after it, and no
        peer's next one before it. Loads the kernels first, where every rank is."""
        runtime = self.runtime
        offset = runtime.tail.keep("pp", ring_bytes(runtime.num_ranks, num_max_tensor_bytes, num_slots), op)
        runtime.share.load([specs.pp_spec(step) for step in specs.PP_STEPS])
        runtime.barrier(stream)
        with torch.cuda.stream(stream):
            runtime.windows.bytes[offset : offset + ring_header_bytes(num_slots)].zero_()
        runtime.barrier(stream)
        runtime.wait(stream, f"{op}'s barrier")
        self.region_offset, self.num_slots = offset, num_slots
        self.slot_bytes = align(num_max_tensor_bytes, SLOT_ALIGNMENT_BYTES)
        self._num_sent = [0] * runtime.num_ranks
        self._num_received = [0] * runtime.num_ranks

    def send(self, t: torch.Tensor, dst: int, stream: torch.cuda.Stream) -> None:
        """Queue the send of `t` (contiguous, at most a slot) to rank `dst` on `stream`."""
        runtime = self._checked_runtime("pp_send", stream)
        number = self._num_sent[dst] + 1
        num_bytes = t.numel() * t.element_size()
        if number > self.num_slots:
            self._launch("send_wait", stream, dst, number, num_bytes)
        slot = self._slot_offset(receiver=dst, source=runtime.rank, number=number)
        runtime.copy_async(stream, [(runtime.windows.peer_ptrs[dst] + slot, data_ptr(t), num_bytes)])
        self._launch("send_signal", stream, dst, number, num_bytes)
        self._num_sent[dst] = number

    def recv(self, t: torch.Tensor, src: int, stream: torch.cuda.Stream) -> None:
        """Queue the receive of rank `src`'s next message into `t` (contiguous) on `stream`."""
        runtime = self._checked_runtime("pp_recv", stream)
        number = self._num_received[src] + 1
        num_bytes = t.numel() * t.element_size()
        self._launch("recv_wait", stream, src, number, num_bytes)
        slot = self._slot_offset(receiver=runtime.rank, source=src, number=number)
        runtime.copy_async(stream, [(data_ptr(t), runtime.windows.peer_ptrs[runtime.rank] + slot, num_bytes)])
        self._launch("recv_free", stream, src, number, num_bytes)
        self._num_received[src] = number

    # ---------------------------------------------------------------- the steps of a call

    def _checked_runtime(self, op: str, stream: torch.cuda.Stream) -> NvlinkRuntime:
        """The runtime, once this call may go on: raises the buffer's failure, an earlier receive's
        size error, and refuses a CUDA graph capture (a replay would repeat the messages' numbers)."""
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{op}: PP calls cannot be captured in a CUDA graph (each message has its own number)")
        self.runtime.check_error()
        self.runtime.take_input_error()
        return self.runtime

    def _slot_offset(self, receiver: int, source: int, number: int) -> int:
        """The window offset of message `number`'s slot in `receiver`'s ring for `source` (whose
        sources are the other ranks in order, the receiver left out)."""
        position = source - (source > receiver)
        slot_idx = position * self.num_slots + (number - 1) % self.num_slots
        return self.region_offset + ring_header_bytes(self.num_slots) + slot_idx * self.slot_bytes

    def _launch(self, step: str, stream: torch.cuda.Stream, peer: int, number: int, num_bytes: int) -> None:
        runtime = self.runtime
        (kernel,) = runtime.share.load([specs.pp_spec(step)])
        # The counters are int32 words compared as differences (arrivals.cuh), so the number may wrap
        sequence = (number + 2**31) % 2**32 - 2**31
        args = specs.PpArgs(window=runtime.windows.ptr, error_block=data_ptr(runtime.error_block),
                            timeout_ns=runtime.timeout_ns, region_offset=self.region_offset, num_bytes=num_bytes,
                            sequence=sequence, num_slots=self.num_slots, slot=(number - 1) % self.num_slots,
                            rank=runtime.rank, peer=peer)  # fmt: skip
        kernel.launch(grid=(1,), block=(32,), stream=stream, args=(Opaque(bytes(args)),))
