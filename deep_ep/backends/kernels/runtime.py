"""The runtime of one buffer on the kernels backend: its resources, host waits and device faults.

One `NvlinkRuntime` per `ElasticBuffer` on the kernels backend (`deep_ep.backends.kernels.transport`).
It takes the windows (`PeerWindows`), the part of the GPU the rank's kernels may use (`DeviceShare`)
and its kernels' transport arguments (`links.KernelLinks`; with peers outside the scale-up domain the
window gets a scale-out region, `scaleout`), owns the host-mapped error block, the count blocks and
the dispatch scratch, waits on the host with a deadline, turns what a kernel recorded in the error
block into exceptions, and runs the barrier. The launch sequences of dispatch and combine are
`deep_ep.backends.kernels.dispatch` and `deep_ep.backends.kernels.combine`.

Epilogues end by posting this rank's window credit, which the peers' next communication kernel
waits for instead of an entry barrier. Every kernel of an operation is loaded, and every output
whose shape is known allocated, before its first launch: an exception after it would leave the
window half-way through an operation, so one marks the buffer dead (`dead_reason`) instead of
letting a retry run at the same epoch.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deep_ep.errors import EPError, EPOperationMismatchError, EPPeerError, EPTimeoutError
from deep_ep.host_reads import poll_pause, wait_for_stream
from deep_ep.jit import I32, U64, Opaque
from deep_ep.records import WORKSPACE_BYTES

from . import specs
from .layout import (
    DISPATCH_SCRATCH_INTS,
    ERROR_REPORTED_BY_PEER,
    ERROR_WORDS,
    HOST_ERROR_PHASE,
    INPUT_OUT_OF_RANGE,
    INPUT_PP_SIZE,
    MASK_ON_TIMEOUT_OFFSET,
    MASKED_RANKS_OFFSET,
    MAX_LOCAL_EXPERTS,
    MAX_RANKS,
    NUM_RANKS_OFFSET,
    NUM_SCALEUP_RANKS_OFFSET,
    PEER_MESSAGE_BYTES,
    PEER_MESSAGE_OFFSET,
    PEER_WINDOWS_OFFSET,
    PHASES,
    RANK_OFFSET,
    SCALEOUT_REGION_OFFSET,
    STAGING_ENTRIES_CAP_OFFSET,
    TIMED_OUT_RANKS_OFFSET,
)
from .scaleout import ScaleoutRegion, buffer_scaleout_region
from .tail import TailRegions
from .transport import Transport

# How long a host wait busy-polls before it starts sleeping between polls
_SPIN_S = 0.05
# The error block words of an input error (`report_input_error` in fault.cuh)
_INPUT_WORDS = slice(ERROR_WORDS.index("input_status"), len(ERROR_WORDS))
# The word of `error_words` that is non-zero once a dispatch found an invalid `topk_idx` on the device
INPUT_ERROR_WORD = _INPUT_WORDS.start
_OP_MISMATCH_PHASE = 8
# Hybrid mode: a dispatch's waits on what a source of another node sends (its counts and records reach
# us through its forwarder)
_FORWARDED_PHASES = (3, 7)


# While a call is recorded (`deep_ep.backends.kernels.steady`), the tensors whose addresses went
# into kernel arguments on this thread (virtual ranks record on their own threads)
_recording = threading.local()


def data_ptr(tensor: torch.Tensor | None) -> int:
    """The device address of `tensor` (`0` for `None`), as a kernel argument."""
    if tensor is None:
        return 0
    seen = getattr(_recording, "tensors", None)
    if seen is not None:
        seen.append(tensor)
    return tensor.data_ptr()


def track_pointers(tensors: list[torch.Tensor] | None) -> None:
    """Append to `tensors` every tensor `data_ptr` gives the address of on this thread (`None`: stop)."""
    _recording.tensors = tensors


def rows_per_task(num_rows: int, num_sms: int, max_rows: int) -> int:
    """Rows (or tokens) a communication warp sends between two releases: one when there are few
    per warp (decode: spread them over every warp), up to `max_rows` when there are many (each
    release fence stalls its warp for about one NVLink round trip)."""
    num_warps = num_sms * (specs.NUM_THREADS // 32)
    rows = 1
    while rows < max_rows and num_rows >= 8 * rows * num_warps:
        rows *= 2
    return rows


@dataclass(frozen=True)
class LaunchPlan:
    """What one operation shape needs besides its tensors, worked out the first time it runs
    (`NvlinkRuntime.plans`): its kernels, loaded, in launch order; its communication grid; the
    signature its peers check (`op_hash`); its arrival block."""

    kernels: list[Any]
    num_sms: int
    op_hash: int
    arrival_slots: int


def describe_fault(words: dict[str, int], timeout_s: float, num_ranks_per_node: int | None = None,
                   hybrid: bool = False) -> str:  # fmt: skip
    """The text of a device-side failure recorded in an error block (fault.cuh); with nodes of
    `num_ranks_per_node` ranks (a group across scale-up domains) it says whose node each rank is, and
    in `hybrid` mode, for a dispatch's wait on a source of another node, which forwarder it came through."""

    def who(rank: int) -> str:
        if num_ranks_per_node is None or rank < 0:
            return f"rank {rank}"
        return f"rank {rank} (node {rank // num_ranks_per_node}, local rank {rank % num_ranks_per_node})"

    phase = PHASES.get(words["phase"], f"phase {words['phase']}")
    rank, peer = words["rank"], words["peer"]
    if words["phase"] == _OP_MISMATCH_PHASE:
        text = f"{who(peer)} ran a different operation than rank {rank}"
        if words["channel"] >= 0:  # recorded where it was found (a peer's posted fault carries no words)
            text += f" (signature {words['observed'] & 0xFFFFFFFF:#x}, expected {words['expected'] & 0xFFFFFFFF:#x})"
        text += ": the ranks' sequences of operations (dispatches, combines, AGRS calls and their shapes) diverged"
    elif rank == peer and words["phase"] != HOST_ERROR_PHASE:
        text = f"{phase} timed out on {who(rank)} after {timeout_s:g} s"
    else:
        text = f"{phase} timed out on {who(rank)} waiting for {who(peer)}"
        forwarded = hybrid and num_ranks_per_node and words["phase"] in _FORWARDED_PHASES
        if forwarded and rank >= 0 and peer >= 0 and rank // num_ranks_per_node != peer // num_ranks_per_node:
            # What a source of another node sends reaches us through its forwarder (forward.cuh)
            forwarder = rank - rank % num_ranks_per_node + peer % num_ranks_per_node
            text += f" through its forwarder {who(forwarder)}"
        text += f" after {timeout_s:g} s"
        if words["channel"] >= 0:
            text += f" (channel {words['channel']}, counter {words['observed']}, expected >= {words['expected']})"
    if words["status"] == ERROR_REPORTED_BY_PEER:
        text += f"; rank {rank} told rank {words['reporter']}"
    return text + "; the buffer is unusable: destroy it and create a new one"


def describe_input_error(words: dict[str, int], num_experts: int) -> str:
    """The text of an invalid `topk_idx` value that a dispatch found on the device, or of a pipeline
    receive whose tensor was not the size of the message (pp.cuh)."""
    if words["input_reason"] == INPUT_PP_SIZE:
        return (
            f"pp_recv: `t` must hold the {words['input_value']} bytes rank {words['input_row']} sent, got "
            f"{words['input_lane']} (found on the device by that receive; the message was consumed and `t` holds its "
            "first bytes)"
        )
    where = f"at [{words['input_row']}, {words['input_lane']}]"
    if words["input_reason"] == INPUT_OUT_OF_RANGE:
        what = (
            f"values must be in [-1, {num_experts}) (num_experts = {num_experts}), got {words['input_value']} {where}"
        )
    else:
        what = f"rows must not repeat an expert, got {words['input_value']} again {where}"
    return (
        f"dispatch: `topk_idx` {what}; found on the device by a dispatch without CPU sync, "
        "which sent nothing (its handle routes nothing)"
    )


def describe_host_error(rank: int, message: str) -> str:
    """The text of a peer's fault posted by its host (`NvlinkRuntime.post_fault`)."""
    what = message or "an error (its text did not arrive)"
    return (
        f"rank {rank} stopped the buffer: it raised {what}; the buffer is unusable on every rank: destroy it and "
        "create a new one (on the same group)"
    )


def _own_stream() -> tuple[torch.cuda.Stream, Any]:
    """A non-blocking stream of the current device that no other rank gets (torch's pool hands its
    streams out round robin, so virtual ranks of one process could share one), and its handle."""
    from cuda.bindings import driver as cuda

    from deep_ep.jit import driver as jit_driver

    device = torch.cuda.current_device()
    with jit_driver.current_context(device):
        handle = jit_driver.check(cuda.cuStreamCreate(cuda.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    return torch.cuda.get_stream_from_external(int(handle), torch.device("cuda", device)), handle


class NvlinkRuntime:
    """The windows, error block, count blocks and waits of one buffer.

    Arguments:
        transport: how this rank reaches its peers: its share of the GPU, its kernels' transport
            arguments, and the collective call that opens the windows (made once this rank's own
            memory is allocated: an allocation of pinned or device memory while a peer's kernel runs
            would keep them apart, see `deep_ep.loopback`).
        num_bytes: the window's workspace and data region (the buffer size); with remote peers the
            window also holds a scale-out region.
        num_gpu_timeout_secs: deadline of every device-side wait.
        num_cpu_timeout_secs: deadline of every host-side wait.
        rank_masking: whether the kernels are the ones that honour masked ranks (rank_mask.cuh).
        mask_on_timeout: rank masking's automatic mode: a peer whose wait expires is masked.
        hidden, num_topk, num_max_tokens_per_rank, use_fp8_dispatch, allow_multiple_reduction: the
            shape the buffer was sized for (0: not given), which sizes the staging for remote peers
            (`scaleout.buffer_scaleout_region`).
        ring_entries_per_warp: the combine ring's entries per warp (default: one with multiple
            reduction, else the top-k), and the most a warp takes.
    """

    def __init__(
        self, transport: Transport, num_bytes: int, num_gpu_timeout_secs: float, num_cpu_timeout_secs: float,
        rank_masking: bool = False, mask_on_timeout: bool = False, hidden: int = 0, num_topk: int = 0,
        num_max_tokens_per_rank: int = 0, use_fp8_dispatch: bool = False, allow_multiple_reduction: bool = True,
        ring_entries_per_warp: int | None = None, num_hybrid_nodes: int = 0,
    ) -> None:  # fmt: skip
        share = transport.share
        self.share = share
        self.data_bytes = num_bytes
        # The pipeline ring and Engram's table, kept at the end of the data region once configured
        self.tail = TailRegions(num_bytes)
        self.rank_masking = rank_masking
        self.mask_on_timeout = mask_on_timeout
        self._mask_words: list[torch.Tensor] = []  # pinned sources of mask writes, alive until copied
        self.num_device_sms = share.num_sms
        self.timeout_ns = int(num_gpu_timeout_secs * 1e9)
        self.cpu_timeout_s = float(num_cpu_timeout_secs)
        self.error_block = torch.zeros(len(ERROR_WORDS), dtype=torch.int64, pin_memory=True)
        # The same words read in place: every call reads two of them, and indexing the tensor costs
        # microseconds (the block is pinned, so the device's writes land there)
        self.error_words = (ctypes.c_int64 * len(ERROR_WORDS)).from_address(self.error_block.data_ptr())
        # Received counts per source rank, then per local expert, then the invalid-input flag: a
        # CPU-sync dispatch kernel writes them into pinned (mapped) host memory as soon as it has them,
        # then sets the ready word to that dispatch's sequence number, which the host polls
        # (`wait_counts`) while the kernel goes on sending; the kernel only writes host memory
        num_count_words = MAX_RANKS + MAX_LOCAL_EXPERTS + 1
        self.host_counts = torch.zeros(num_count_words, dtype=torch.int32, pin_memory=True)
        self.counts_ready = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._counts_ready_word = ctypes.c_uint64.from_address(self.counts_ready.data_ptr())
        words = (ctypes.c_int32 * num_count_words).from_address(self.host_counts.data_ptr())
        self._count_words = memoryview(words).cast("B").cast("i")
        self._counts_sequence = 0
        # The host's waits for counts so far, and their nanoseconds (the bench's count phase as the
        # host sees it: the kernel's launch latency and its count exchange)
        self.num_counts_waits = 0
        self.counts_wait_ns = 0
        # One event, recorded by the waits that pass a first check
        self._counts_launched: torch.cuda.Event | None = None
        self.dispatch_scratch = torch.zeros(DISPATCH_SCRATCH_INTS, dtype=torch.int32, device="cuda")
        self._expand_scratch: torch.Tensor | None = None
        # What a failing rank posts to its peers, and the stream it posts on; made before the windows
        # open, like all of this rank's memory (see `open_windows`)
        self._fault_message = torch.zeros(PEER_MESSAGE_BYTES, dtype=torch.uint8, pin_memory=True)
        self._timed_out_word = torch.zeros(8, dtype=torch.uint8, pin_memory=True)
        self._fault_stream, self._fault_stream_handle = _own_stream()
        self.num_experts_checked = 0  # of the last dispatch that validated routing on the device
        # Per operation shape, what does not change between its calls (kernels, grid, signature)
        self.plans: dict[tuple, LaunchPlan] = {}
        # Set while a call is recorded for the steady path: sees every allocation and launch
        self.recorder: Any = None
        self.dead_reason: str | None = None
        self._dead_error: type[EPError] = EPError
        if transport.num_ranks > MAX_RANKS:
            raise ValueError(f"NVLink kernels support at most {MAX_RANKS} ranks, the group has {transport.num_ranks}")
        # Peers outside the scale-up domain: a scale-out region after the data region (scaleout.cuh),
        # whose staging ring gives each warp of the largest grid its entries
        self.num_scaleup_ranks = transport.num_scaleup_ranks
        # Hybrid mode's nodes (0: direct mode): a dispatch (its kernel over `hybrid-<transport>`) sends
        # each token once per remote node, to its forwarder there (forward.cuh); a combine with one row
        # per holder sends one partial per (token, remote node), summed by the forwarders
        # (combine_forward.cuh, docs/hybrid.md)
        if num_hybrid_nodes and not transport.has_remote_peers:
            raise ValueError(f"hybrid mode ({num_hybrid_nodes} nodes) needs a transport with remote peers")
        self.num_hybrid_nodes = num_hybrid_nodes
        self.scaleout: ScaleoutRegion | None = None
        window_bytes = num_bytes
        self._ring_entries_cap = ring_entries_per_warp or 0
        if transport.has_remote_peers:
            self.scaleout = buffer_scaleout_region(num_bytes, transport.num_ranks, share.num_sms, hidden, num_topk,
                                                   num_max_tokens_per_rank, use_fp8_dispatch,
                                                   allow_multiple_reduction, num_hybrid_nodes,
                                                   ring_entries_per_warp)  # fmt: skip
            window_bytes = self.scaleout.offset + self.scaleout.num_bytes
        # The emulated NIC drains after every wait of its kernel: its deadline is longer than theirs
        self.links = transport.make_links(4 * self.timeout_ns + 10**10)
        self.windows = transport.open_windows(window_bytes)
        self.rank, self.num_ranks = self.windows.rank, self.windows.num_ranks
        self.links.attach(self.windows)
        self.transport_kind = self.links.kind
        self.nic_ctas = self.links.nic_ctas
        self._write_workspace()
        # Loaded with the buffer, on every rank at once (the last step before its barrier): loading
        # it when a rank fails could wait for the peers' kernels, which wait for that rank
        (self._post_fault,) = share.load([specs.post_fault_spec(self.transport_kind)])

    def is_remote(self, peer: int) -> bool:
        """Whether `peer` is outside this rank's scale-up domain (reached through the transport)."""
        return peer // self.num_scaleup_ranks != self.rank // self.num_scaleup_ranks

    def _write_workspace(self) -> None:
        """This rank, the number of ranks, every rank's window base (none for a remote peer: the
        kernels reach it only through the transport) and the scale-out region, into our window's
        workspace (fault.cuh, comm.cuh and scaleout.cuh read them there)."""
        world = torch.tensor([self.rank, self.num_ranks], dtype=torch.int32).view(torch.uint8)
        bases = [0 if self.is_remote(peer) else ptr for peer, ptr in enumerate(self.windows.peer_ptrs)]
        peers = torch.tensor(bases, dtype=torch.int64).view(torch.uint8)
        window = self.windows.bytes
        window[RANK_OFFSET : NUM_RANKS_OFFSET + 4].copy_(world)
        window[PEER_WINDOWS_OFFSET : PEER_WINDOWS_OFFSET + peers.numel()].copy_(peers)
        if self.mask_on_timeout:
            window[MASK_ON_TIMEOUT_OFFSET : MASK_ON_TIMEOUT_OFFSET + 4].copy_(
                torch.tensor([1], dtype=torch.int32).view(torch.uint8)
            )
        if self.scaleout is not None:
            region = torch.tensor([self.scaleout.offset, self.scaleout.ring_bytes], dtype=torch.int64)
            window[SCALEOUT_REGION_OFFSET : SCALEOUT_REGION_OFFSET + 16].copy_(region.view(torch.uint8))
            for offset, value in ((NUM_SCALEUP_RANKS_OFFSET, self.num_scaleup_ranks),
                                  (STAGING_ENTRIES_CAP_OFFSET, self._ring_entries_cap)):  # fmt: skip
                window[offset : offset + 4].copy_(torch.tensor([value], dtype=torch.int32).view(torch.uint8))
        torch.cuda.current_stream().synchronize()

    # ---------------------------------------------------------------- faults

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: Any, rows: str | None = None) -> torch.Tensor:
        """An output or handle tensor of the running call (the share's allocation, recorded when a
        recorder is set; `rows` names what its first dimension counts when that is learnt during
        the call, see `steady.Recorder`)."""
        tensor = self.share.empty(shape, dtype=dtype, device=device)
        if self.recorder is not None:
            self.recorder.allocated(tensor, rows)
        return tensor

    def launch(self, kernel: Any, **launch: Any) -> None:
        """`kernel.launch(**launch)`, recorded when a recorder is set."""
        kernel.launch(**launch)
        if self.recorder is not None:
            self.recorder.launched(kernel, launch)

    def check_error(self) -> None:
        """Raise if this buffer failed: `EPTimeoutError` for a device wait that expired here or on a
        peer, `EPOperationMismatchError` when the ranks ran different operations, `EPError` after an
        exception between two launches of one operation."""
        if self.dead_reason is None and self.error_words[0] != 0:
            words = dict(zip(ERROR_WORDS, self.error_block.tolist(), strict=True))
            if words["phase"] == HOST_ERROR_PHASE:
                self.dead_reason = describe_host_error(words["rank"], self._peer_message(words["rank"]))
                self._dead_error = EPPeerError
            else:
                per_node = self.num_scaleup_ranks if self.scaleout is not None else None
                self.dead_reason = describe_fault(words, self.timeout_ns / 1e9, per_node, self.num_hybrid_nodes > 0)
                self._dead_error = EPOperationMismatchError if words["phase"] == _OP_MISMATCH_PHASE else EPTimeoutError
        if self.dead_reason is not None:
            raise self._dead_error(self.dead_reason)

    def take_input_error(self) -> None:
        """Raise the `ValueError` of an invalid `topk_idx` that an earlier dispatch found on the
        device (once; the buffer stays usable: that dispatch sent nothing). Called at the end of a
        call, once its own work is enqueued: raising before it would leave the peers waiting."""
        if self.error_words[INPUT_ERROR_WORD] == 0:
            return
        words = dict(zip(ERROR_WORDS, self.error_block.tolist(), strict=True))
        self.error_block[_INPUT_WORDS] = 0
        raise ValueError(describe_input_error(words, self.num_experts_checked))

    def post_fault(self, op: str, error: BaseException) -> None:
        """This rank rejected its input of `op` or raised inside it: stop the buffer on every rank
        now, with `error`'s text for the peers' exceptions (post_fault.cuh), rather than let the peers
        wait for this rank until their deadline. A buffer that failed already keeps its first fault
        (the device's compare-and-swap); a buffer of one rank has nobody to tell and stays usable."""
        if self.num_ranks == 1 or self.dead_reason is not None:
            return
        text = f"{type(error).__name__} in {op}: {error}"
        encoded = text.encode()[: PEER_MESSAGE_BYTES - 1].decode(errors="ignore").encode()
        self._fault_message.zero_()
        self._fault_message[: len(encoded)].copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
        # Its own stream: the current one may hold work that waits for the peers
        self._post_fault.launch(grid=(1 + self.nic_ctas,), block=(32,), stream=self._fault_stream, args=(
            U64(self.windows.ptr), U64(data_ptr(self.error_block)), U64(data_ptr(self._fault_message)),
            U64(self.timeout_ns), Opaque(self.links.args("fault"))))  # fmt: skip
        self.dead_reason = (
            f"this rank raised {text}, and stopped the buffer on every rank; the buffer is unusable: destroy it "
            "and create a new one"
        )
        self._dead_error = EPError

    def _peer_message(self, rank: int) -> str:
        """The error text `rank` left in our window when it stopped the buffer (post_fault.cuh)."""
        start = PEER_MESSAGE_OFFSET + rank * PEER_MESSAGE_BYTES
        # Staged in our own message buffer: a rank that read a peer's fault never posts its own, and
        # pinned memory allocated now could wait for the device. Copied by the driver, not by torch:
        # torch's pinned allocator would remember our stream and record an event on it when the
        # block is freed, after `destroy` has destroyed the stream (a segfault)
        self._read_window(start, self._fault_message)
        return bytes(self._fault_message.tolist()).split(b"\0", 1)[0].decode(errors="replace")

    def _read_window(self, offset: int, staged: torch.Tensor) -> None:
        """Copy `staged.numel()` bytes of our window at `offset` into the pinned `staged` on our own
        stream, now, whatever the buffer's streams have queued."""
        from cuda.bindings import driver as cuda

        from deep_ep.jit import driver as jit_driver

        source = data_ptr(self.windows.bytes) + offset
        with jit_driver.current_context(self.windows.bytes.device.index):
            copied = cuda.cuMemcpyDtoHAsync(data_ptr(staged), source, staged.numel(), self._fault_stream_handle)
        jit_driver.check(copied, "cuMemcpyDtoHAsync")
        wait_for_stream(self._fault_stream, timeout_s=self.cpu_timeout_s)

    def copy_async(self, stream: torch.cuda.Stream, copies: Iterable[tuple[int, int, int]]) -> None:
        """Queue copy-engine copies `(dst, src, num_bytes)` between device addresses (our window, a
        peer's, a tensor) on `stream`; empty ones are skipped. AGRS and PP move their data so, no SM."""
        from cuda.bindings import driver as cuda

        from deep_ep.jit import driver as jit_driver

        handle = cuda.CUstream(stream.cuda_stream)
        with jit_driver.current_context(self.windows.bytes.device.index):
            for dst, src, num_bytes in copies:
                if num_bytes:
                    jit_driver.check(cuda.cuMemcpyAsync(dst, src, num_bytes, handle), "cuMemcpyAsync")

    def fail_between_launches(self, op: str, error: BaseException) -> None:
        """Mark the buffer dead: `op` raised `error` after its first kernel was launched."""
        if self.dead_reason is None:
            self.dead_reason = (
                f"{op} raised {type(error).__name__} ({error}) after its first kernel was launched, which leaves "
                "the window half-way through an operation; the buffer is unusable: destroy it and create a new one"
            )

    def wait(self, stream: torch.cuda.Stream, what: str) -> None:
        """Wait on the host, with a deadline, for everything queued on `stream`.

        Busy-polls first: a sleep costs at least a scheduler tick (milliseconds in a VM), far more
        than a dispatch; only waits longer than `_SPIN_S` back off to short sleeps.
        """
        if not wait_for_stream(stream, timeout_s=self.cpu_timeout_s, spin_s=_SPIN_S):
            self.dead_reason = f"host wait for {what} on rank {self.rank} passed {self.cpu_timeout_s:g} s"
            self._dead_error = EPTimeoutError
            raise EPTimeoutError(self.dead_reason)
        self.check_error()

    def next_counts_sequence(self) -> int:
        """The number a CPU-sync dispatch's kernel sets the ready word to (never 0, never repeated)."""
        self._counts_sequence += 1
        return self._counts_sequence

    def wait_counts(self, stream: torch.cuda.Stream, sequence: int) -> None:
        """Wait on the host, with the CPU deadline, until the dispatch kernel numbered `sequence` has
        written its counts (`host_counts`), without waiting for the rest of the kernel.

        Polls the ready word (a read of host memory, no CUDA call), busy for `_SPIN_S`, then in short
        sleeps; every poll yields the interpreter (virtual ranks launch from other threads). A kernel
        that stopped before its counts (a device fault) leaves the word unset: then the stream is
        drained and the fault raised (`wait`).
        """
        if self.recorder is not None:
            self.recorder.waiting_for_counts()
        started_ns = time.perf_counter_ns()
        try:
            self._wait_counts(stream, sequence)
        finally:
            self.num_counts_waits += 1
            self.counts_wait_ns += time.perf_counter_ns() - started_ns

    def read_counts(self, num_words: int) -> list[int]:
        """The first `num_words` words of `host_counts` (read in place: a tensor's `tolist` costs
        microseconds, a ctypes slice a few)."""
        return self._count_words[:num_words].tolist()

    def _wait_counts(self, stream: torch.cuda.Stream, sequence: int) -> None:
        ready = self._counts_ready_word
        if ready.value == sequence:
            return
        # The event that tells a kernel done without its counts is recorded at the first check, not
        # before the first poll: most waits end sooner, and a record costs the host a microsecond or
        # two (recorded later it covers at least the kernel: no work of this call follows it yet)
        launched = None
        started = time.monotonic()
        num_polls = 0
        while ready.value != sequence:
            num_polls += 1
            if self.error_words[0] != 0:
                break  # a fault
            if num_polls % 64 == 0:
                if launched is None:
                    if self._counts_launched is None:
                        self._counts_launched = torch.cuda.Event()
                    launched = self._counts_launched
                    launched.record(stream)
                elif launched.query() and ready.value != sequence:
                    break  # the kernel is done without its counts
            elapsed = time.monotonic() - started
            if elapsed > self.cpu_timeout_s:
                self.dead_reason = f"host wait for dispatch counts on rank {self.rank} passed {self.cpu_timeout_s:g} s"
                self._dead_error = EPTimeoutError
                raise EPTimeoutError(self.dead_reason)
            poll_pause(elapsed < _SPIN_S)
        if ready.value == sequence:
            return
        self.wait(stream, "dispatch counts")  # raises the device's fault
        if ready.value != sequence:
            raise EPError(f"dispatch counts: the dispatch kernel of rank {self.rank} ended without its counts")

    # ---------------------------------------------------------------- grids

    def comm_grid(self, num_sms: int) -> int:
        """Working CTAs of a communication kernel: at most the share, less one SM for the epilogue
        when the two must fit it together (and less their emulated NICs' CTAs, which each launch
        adds: `nic_ctas`)."""
        limit = self.num_device_sms - 1 - 2 * self.nic_ctas if self.share.exclusive else self.num_device_sms
        return max(1, min(num_sms, limit))

    def grid_for_rows(self, num_rows: int, num_busy_sms: int) -> int:
        """Working CTAs for an epilogue over `num_rows` rows: one warp per row, at most one CTA per
        SM, and only the SMs the running communication kernel (`num_busy_sms` working CTAs, and its
        NIC's) leaves free. An epilogue CTA cannot share an SM with a communication CTA
        (registers), so one placed behind it would hold its rows, spread over the whole batch, until
        the transfer ends. With an exclusive share, the free SMs are all there is."""
        num_sms, rows_per_cta, _ = self.epilogue_terms(num_busy_sms)
        return max(1, min(num_sms, (num_rows + rows_per_cta - 1) // rows_per_cta))

    def epilogue_terms(self, num_busy_sms: int) -> tuple[int, int, int]:
        """What an epilogue's grid next to a communication kernel of `num_busy_sms` working CTAs is
        made of: the most working CTAs, the rows per CTA, and the NIC's CTAs launched besides them
        (`grid_for_rows`; the steady path's front computes a replay's grid from them)."""
        num_free_sms = self.num_device_sms - num_busy_sms - 2 * self.nic_ctas
        if self.share.exclusive or num_free_sms >= self.num_device_sms // 4:
            num_sms = max(1, num_free_sms)
        else:
            num_sms = self.num_device_sms
        return num_sms, specs.NUM_THREADS // 32, self.nic_ctas

    # ---------------------------------------------------------------- rank masking

    def set_masked_ranks(self, masked_ranks: frozenset[int], stream: torch.cuda.Stream) -> None:
        """Write the mask into our workspace on `stream` (rank_mask.cuh): every kernel enqueued after it
        honours it, graph replays included. No host wait: a queued kernel may wait for a peer."""
        bits = sum(1 << rank for rank in masked_ranks)
        word = torch.tensor([bits - (1 << 64) if bits >> 63 else bits], dtype=torch.int64).pin_memory()
        # One source per write (a mask is set a few times at most): a reused one could change under
        # a copy still in the queue
        self._mask_words.append(word)
        with torch.cuda.stream(stream):
            self.windows.bytes[MASKED_RANKS_OFFSET : MASKED_RANKS_OFFSET + 8].copy_(
                word.view(torch.uint8), non_blocking=True
            )

    def timed_out_ranks(self) -> frozenset[int]:
        """The peers that automatic masking masked so far (their waits expired), read from the device now."""
        if not self.mask_on_timeout:
            return frozenset()
        self._read_window(TIMED_OUT_RANKS_OFFSET, self._timed_out_word)
        bits = int.from_bytes(bytes(self._timed_out_word.tolist()), "little")
        return frozenset(rank for rank in range(self.num_ranks) if bits >> rank & 1)

    # ---------------------------------------------------------------- barrier

    def barrier(self, stream: torch.cuda.Stream) -> None:
        self.check_error()
        (kernel,) = self.share.load([specs.barrier_spec(self.num_ranks, self.transport_kind)])
        kernel.launch(grid=(1 + self.nic_ctas,), block=(128,), stream=stream, args=(
            U64(self.windows.ptr), I32(self.rank), U64(data_ptr(self.error_block)), U64(self.timeout_ns),
            Opaque(self.links.args("comm"))))  # fmt: skip

    # ---------------------------------------------------------------- capacity

    def check_capacity(self, num_region_bytes: int, what: str, layout: Callable[[], str]) -> None:
        """Raise `ValueError` unless the window holds the workspace and `num_region_bytes` of `what`'s
        records or slots (`layout()` says how they were counted; only called to word the error)."""
        needed = WORKSPACE_BYTES + num_region_bytes
        if needed > self.tail.free_end:
            kept = self.tail.describe()
            raise ValueError(
                f"{what}: the buffer holds {self.data_bytes} bytes per rank"
                + (f" ({kept} kept at its end for PP and Engram)" if kept else "")
                + f" but this call needs {needed} ({layout()}); create the buffer with "
                "ElasticBuffer.get_buffer_size_hint(...) for this shape (a buffer sized with `use_fp8_dispatch`=True "
                "holds FP8 dispatches, not BF16 ones)"
            )

    def expand_rank_scratch(self, num_elements: int) -> torch.Tensor:
        """`[>= num_elements]` `torch.int32` device scratch of the expanded layout (grown, never shrunk)."""
        if self._expand_scratch is None or self._expand_scratch.numel() < num_elements:
            self._expand_scratch = self.share.empty((num_elements,), dtype=torch.int32, device="cuda")
        return self._expand_scratch

    # ---------------------------------------------------------------- teardown

    def destroy(self) -> None:
        """Release the windows and the fault stream (idempotent)."""
        self.windows.destroy()
        if self._fault_stream_handle is not None:
            from cuda.bindings import driver as cuda

            cuda.cuStreamDestroy(self._fault_stream_handle)  # its work, if any, still completes
            self._fault_stream_handle = None


def peer_store(runtime: NvlinkRuntime, stream: torch.cuda.Stream, src: torch.Tensor, num_sms: int) -> None:
    """Speed-of-light probe: stream `src` (uint8, a multiple of 16 bytes) into every peer's window.

    Every rank launching it at once loads the links in both directions, as dispatch and combine do.
    """
    if runtime.scaleout is not None:
        raise ValueError("peer_store: the speed-of-light probe stores into every peer's window, and this buffer has "
                         "peers outside its scale-up domain")  # fmt: skip
    if WORKSPACE_BYTES + src.numel() > runtime.data_bytes:
        raise ValueError(f"peer_store: {src.numel()} bytes do not fit the window ({runtime.data_bytes} bytes)")
    (kernel,) = runtime.share.load([specs.peer_store_spec()])
    kernel.launch(
        grid=(num_sms,), block=(specs.NUM_THREADS,), stream=stream,
        args=(U64(runtime.windows.ptr), I32(runtime.rank), I32(runtime.num_ranks), U64(WORKSPACE_BYTES), src,
              U64(src.numel())))  # fmt: skip
