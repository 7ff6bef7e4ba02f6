"""`LoopbackWorld`: the virtual ranks of one GPU (or CPU threads), their streams, SM shares, memory
and windows, and `run`, which runs a function on every rank in a thread of its own."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backends.base import loopback_world_of
from .collectives import LoopbackGroup, Mailboxes, Rendezvous
from .device import POOL, GreenContexts, RankStreams, check, cuda_driver

# A guarded allocation is surrounded by bytes of this pattern, and filled with the other (large
# values in every integer field: metadata that was never written cannot pass for valid)
_GUARD_PATTERN = 0xA5
_UNWRITTEN_PATTERN = 0x7B
_WINDOW_ALIGNMENT = 4096
# SMs per green-context partition come in steps of this many on Hopper
_GREEN_SM_STEP = 8


class LoopbackRankError(RuntimeError):
    """A rank function raised; `errors[r]` is rank r's exception (or `None`), `results[r]` its value."""

    def __init__(self, message: str, results: list[Any], errors: list[BaseException | None]) -> None:
        super().__init__(message)
        self.results = results
        self.errors = errors


def loopback_world(group: Any) -> LoopbackWorld | None:
    """The `LoopbackWorld` of a `LoopbackGroup`, or `None` for any other group."""
    return loopback_world_of(group) if isinstance(group, LoopbackGroup) else None


# ------------------------------------------------------------------------------------------ windows


class LoopbackWindows:
    """`deep_ep.backends.kernels.transport.PeerWindows` of one buffer's virtual ranks: one allocation
    holds every rank's window (with guard bytes between them when the world guards allocations)."""

    def __init__(self, world: LoopbackWorld, rank: int, allocation: dict) -> None:
        self.world, self.rank, self.num_ranks = world, rank, world.num_ranks
        self._allocation = allocation
        self.num_bytes = allocation["window_bytes"]
        self.bytes = allocation["windows"][rank]
        self.ptr = self.bytes.data_ptr()
        self.peer_ptrs = [w.data_ptr() for w in allocation["windows"]]
        self._alive = True

    def destroy(self) -> None:
        """Release this rank's hold; the memory goes once every rank released it and every kernel
        enqueued before has finished (idempotent)."""
        if self._alive:
            self._alive = False
            self.world._release_windows(self.rank, self._allocation)


# ------------------------------------------------------------------------------------------ world


class LoopbackWorld:
    """`num_ranks` virtual ranks on one GPU (or, with `device="cpu"`, CPU threads for the reference
    backend), run by `run(fn)`.

    Arguments:
        num_ranks: the number of ranks (1 to 64).
        device: a CUDA device (index or `torch.device`), or `"cpu"`.
        num_sms_per_rank: SMs each rank's kernels may use (default: the device's SMs // `num_ranks`;
            at least 2: a communication kernel and its epilogue run side by side).
        green_contexts: give each rank a hard partition of that many SMs (a multiple of 8 on Hopper).
        guard_bytes: surround every window and every output our kernels write with this many guard
            bytes, and fill the outputs with garbage instead of leaving them uninitialised
            (`check_guards()` then tells whether anything wrote outside them); 0 to turn it off.
        timeout_s: the deadline of host-side waits of the world (collectives, kernel loading, `run`).
        reserve_bytes: device memory kept in torch's caching allocator for each rank's streams
            (default: 40% of the free memory over the ranks, at most 4 GiB each; see the module notes).
        num_ranks_per_node: virtual nodes of this many consecutive ranks (default: one node); the
            buffers see them as hosts (`deep_ep.get_physical_domain_size`), and the kernels reach the
            ranks of other nodes only through an emulated NIC (`nic`).
        nic: the emulated NIC between virtual nodes: `'strict'` (puts late and shuffled by a NIC CTA,
            GIN's weakest guarantees), `'eager'` (puts copy at once), or a
            `deep_ep.backends.kernels.links.NicOptions`.
    """

    def __init__(
        self,
        num_ranks: int,
        device: int | str | torch.device = 0,
        *,
        num_sms_per_rank: int | None = None,
        green_contexts: bool = False,
        guard_bytes: int = 0,
        timeout_s: float = 300.0,
        reserve_bytes: int | None = None,
        num_ranks_per_node: int | None = None,
        nic: Any = "strict",
    ) -> None:
        from ..backends.kernels.layout import MAX_RANKS

        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"LoopbackWorld: `num_ranks` must be an int in [1, {MAX_RANKS}], got {num_ranks!r}")
        if isinstance(guard_bytes, bool) or not isinstance(guard_bytes, int) or guard_bytes < 0:
            raise ValueError(f"LoopbackWorld: `guard_bytes` must be a non-negative int, got {guard_bytes!r}")
        self.num_ranks = num_ranks
        self.num_ranks_per_node = num_ranks if num_ranks_per_node is None else num_ranks_per_node
        if (isinstance(self.num_ranks_per_node, bool) or not isinstance(self.num_ranks_per_node, int)
                or self.num_ranks_per_node < 1 or num_ranks % self.num_ranks_per_node != 0):  # fmt: skip
            raise ValueError(
                f"LoopbackWorld: `num_ranks_per_node` must be a positive int dividing num_ranks = {num_ranks}, "
                f"got {num_ranks_per_node!r}"
            )
        from ..backends.kernels.links import NicOptions

        if isinstance(nic, str) and nic in ("strict", "eager"):
            nic = NicOptions(strict=nic == "strict")
        if not isinstance(nic, NicOptions):
            raise ValueError(f"LoopbackWorld: `nic` must be 'strict', 'eager' or a NicOptions, got {nic!r}")
        self.nic = nic
        self.device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("LoopbackWorld: `device` is a CUDA device, but CUDA is not available (use 'cpu')")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type != "cpu":
            raise ValueError(f"LoopbackWorld: `device` must be a CUDA device or 'cpu', got {device!r}")
        self.timeout_s = float(timeout_s)
        self.guard_bytes = -(-guard_bytes // _WINDOW_ALIGNMENT) * _WINDOW_ALIGNMENT
        self.collectives = Rendezvous(num_ranks, lambda: self._abort_reason)
        self.mailboxes = Mailboxes(lambda: self._abort_reason)
        self._internal = Rendezvous(num_ranks, lambda: self._abort_reason)
        self._internal_calls = [0] * num_ranks
        self._abort_reason: str | None = None
        self._lock = threading.Lock()
        self._loaded: list[set] = [set() for _ in range(num_ranks)]
        self._guarded: list[tuple[torch.Tensor, int, str]] = []
        self._windows: list[dict] = []
        self._green: GreenContexts | None = None
        self._green_key: Any = None
        self.num_device_sms = 0
        self.num_sms_per_rank = 0
        self._streams: list[RankStreams] = []
        if self.device.type == "cuda":
            self._init_cuda(num_sms_per_rank, green_contexts)
            free_bytes = torch.cuda.mem_get_info(self.device)[0]
            self.reserve_bytes = (
                reserve_bytes if reserve_bytes is not None else min(4 << 30, int(0.4 * free_bytes) // num_ranks)
            )
            self.reserve()
        self.groups = [LoopbackGroup(self, rank) for rank in range(num_ranks)]

    def _init_cuda(self, num_sms_per_rank: int | None, green_contexts: bool) -> None:
        connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))
        if connections < min(32, 2 * self.num_ranks):
            raise ValueError(
                f"LoopbackWorld: {self.num_ranks} ranks need CUDA_DEVICE_MAX_CONNECTIONS >= "
                f"{min(32, 2 * self.num_ranks)} (got {connections}): set it before CUDA starts, or import "
                "deep_ep.loopback before anything initialises CUDA"
            )
        if os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() != "EAGER":
            raise ValueError(
                "LoopbackWorld: virtual ranks need CUDA_MODULE_LOADING=EAGER (a lazily loaded kernel waits for every "
                "running kernel): set it before CUDA starts, or import deep_ep.loopback before anything initialises CUDA"
            )
        self.num_device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        share = num_sms_per_rank or self.num_device_sms // self.num_ranks
        if green_contexts:
            share = share // _GREEN_SM_STEP * _GREEN_SM_STEP
        if share < 2 or share * self.num_ranks > self.num_device_sms:
            raise ValueError(
                f"LoopbackWorld: {self.num_ranks} ranks x {share} SMs do not fit the {self.num_device_sms} SMs of "
                f"{self.device} (each rank needs at least 2{', in steps of 8 with green contexts' if green_contexts else ''})"
            )
        self.num_sms_per_rank = share
        self._check_occupancy()
        cuda = cuda_driver()
        index = self.device.index
        from ..jit import driver as jit_driver

        def create_stream() -> int:
            with jit_driver.current_context(index):
                flags = cuda.CUstream_flags.CU_STREAM_NON_BLOCKING
                return int(check(cuda.cuStreamCreate(flags), "cuStreamCreate"))

        if green_contexts:
            self._green_key = ("green", index, self.num_ranks, share)
            self._green = POOL.take(self._green_key, lambda: GreenContexts(index, self.num_ranks, share))
        for rank in range(self.num_ranks):
            if self._green is not None:
                handles = self._green.stream_handles[rank]
            else:
                handles = tuple(POOL.take(("stream", index), create_stream) for _ in range(2))
            compute, comm = (torch.cuda.get_stream_from_external(h, self.device) for h in handles)
            self._streams.append(RankStreams(compute, comm, handles))

    def _check_occupancy(self) -> None:
        """Our kernels run one 512-thread CTA per SM at most; check that one fits at all."""
        from ..backends.kernels.specs import barrier_spec, load

        with torch.cuda.device(self.device):
            kernel = load(barrier_spec(self.num_ranks))
            if kernel.occupancy(128) < 1:
                raise ValueError(f"LoopbackWorld: {kernel.name} cannot run on {self.device} (occupancy 0)")

    def reserve(self) -> None:
        """Fill torch's caching allocator with `reserve_bytes` per rank: one large block on its
        communication stream (three quarters) and on its compute stream, and small-allocation
        segments on both, so that later allocations of the ranks need no `cudaMalloc`. Call it when
        no rank function runs."""
        small = 1 << 20  # the largest request torch serves from 2 MiB small-allocation segments
        with torch.cuda.device(self.device):
            for streams in self._streams:
                for stream, share in ((streams.comm, 0.75), (streams.compute, 0.25)):
                    sizes = [int(self.reserve_bytes * share) // (2 << 20) * (2 << 20)] + [small] * 64
                    pointers = [
                        torch.cuda.caching_allocator_alloc(size, self.device, stream) for size in sizes if size > 0
                    ]
                    for pointer in pointers:
                        torch.cuda.caching_allocator_delete(pointer)

    # -------------------------------------------------------------------- what a rank uses

    def comm_stream(self, rank: int) -> torch.cuda.Stream:
        """The communication stream of `rank`'s buffers."""
        return self._streams[rank].comm

    def compute_stream(self, rank: int) -> torch.cuda.Stream:
        """`rank`'s compute stream: the current stream of its thread inside `run`."""
        return self._streams[rank].compute

    def device_share(self, rank: int) -> Any:
        """The `deep_ep.backends.kernels.transport.DeviceShare` of `rank`'s kernels."""
        from ..backends.kernels.transport import DeviceShare

        return DeviceShare(self.num_sms_per_rank, exclusive=True, empty=self.empty,
                           load=lambda specs: self.load_kernels(rank, specs), guarded=self.guard_bytes > 0,
                           shared=self.num_ranks > 1)  # fmt: skip

    def _exchange(self, rank: int, value: Any, what: str) -> list[Any]:
        key = ("internal", self._internal_calls[rank])
        self._internal_calls[rank] += 1
        return self._internal.exchange(key, rank, value, self.timeout_s, f"LoopbackWorld {what} on rank {rank}")

    def load_kernels(self, rank: int, specs: Sequence[Any]) -> list[Any]:
        """Load `specs` for `rank`. The first time a rank needs a kernel, every rank loads its own at
        the same point (all ranks run the same operations): loading may wait for running kernels,
        and none of those can then wait for a launch that a loading thread holds back."""
        from ..backends.kernels.specs import load

        missing = [spec for spec in specs if spec not in self._loaded[rank]]
        if missing:
            self._exchange(rank, None, "kernel loading (before)")
            try:
                with torch.cuda.device(self.device):
                    for spec in missing:
                        load(spec)
            finally:
                self._exchange(rank, None, "kernel loading (after)")
            self._loaded[rank].update(missing)
        return [load(spec) for spec in specs]

    def empty(self, shape: Sequence[int], *, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        """`torch.empty` on the world's device; with guards, between guard bytes and filled with
        garbage (what an uninitialised allocation may hold; no random numbers, so that it also
        works while another rank captures a CUDA graph)."""
        shape = tuple(shape)
        if self.guard_bytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        body = -(-max(num_bytes, 1) // 256) * 256
        storage = torch.full((2 * self.guard_bytes + body,), _GUARD_PATTERN, dtype=torch.uint8, device=self.device)
        storage[self.guard_bytes : self.guard_bytes + body].fill_(_UNWRITTEN_PATTERN)
        with self._lock:
            self._guarded.append((storage, body, f"output {list(shape)} {dtype}"))
        return storage[self.guard_bytes : self.guard_bytes + num_bytes].view(dtype).view(shape)

    def check_guards(self) -> list[str]:
        """What wrote outside a guarded window or output: one line per damaged guard (empty when
        none). Waits for this thread's current stream first."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        damaged = []
        with self._lock:
            items = list(self._guarded)
            for allocation in self._windows:
                items.append((allocation["storage"], -1, f"windows of {allocation['window_bytes']} bytes"))
        for storage, body, what in items:
            if body < 0:
                regions = self._window_guards(storage)
            else:
                regions = [(0, self.guard_bytes), (self.guard_bytes + body, self.guard_bytes)]
            for begin, length in regions:
                bad = int((storage[begin : begin + length] != _GUARD_PATTERN).sum())
                if bad:
                    damaged.append(f"{what}: {bad} guard bytes changed in [{begin}, {begin + length})")
        return damaged

    def _window_guards(self, storage: torch.Tensor) -> list[tuple[int, int]]:
        """[guard | window 0 | guard | window 1 | ... | window N-1 | guard]"""
        stride = (storage.numel() - self.guard_bytes) // self.num_ranks
        return [(r * stride, self.guard_bytes) for r in range(self.num_ranks + 1)]

    def open_windows(self, rank: int, num_bytes: int) -> LoopbackWindows:
        """Every rank's window of a new buffer (collective: every rank asks for the same size)."""
        window_bytes = -(-int(num_bytes) // _WINDOW_ALIGNMENT) * _WINDOW_ALIGNMENT
        sizes = self._exchange(rank, window_bytes, "window sizes")
        if len(set(sizes)) != 1:
            raise ValueError(f"window size differs between ranks: {sizes}; every rank must ask for the same size")
        allocation = None
        if rank == 0:
            self._collect_released_windows()
            stride = self.guard_bytes + window_bytes
            storage = torch.full((self.guard_bytes + self.num_ranks * stride,), _GUARD_PATTERN, dtype=torch.uint8,
                                 device=self.device)  # fmt: skip
            windows = [storage[self.guard_bytes + r * stride :][:window_bytes] for r in range(self.num_ranks)]
            for window in windows:
                window.zero_()
            torch.cuda.current_stream().synchronize()
            allocation = {"storage": storage, "windows": windows, "window_bytes": window_bytes,
                          "released": [None] * self.num_ranks}  # fmt: skip
            with self._lock:
                self._windows.append(allocation)
        allocation = self._exchange(rank, allocation, "window allocation")[0]
        return LoopbackWindows(self, rank, allocation)

    def _release_windows(self, rank: int, allocation: dict) -> None:
        events = []
        if self.device.type == "cuda":
            for stream in (self._streams[rank].comm, self._streams[rank].compute, torch.cuda.current_stream()):
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        with self._lock:
            allocation["released"][rank] = events

    def _collect_released_windows(self) -> None:
        """Free the windows every rank released once everything enqueued before has finished."""
        with self._lock:
            # By identity: `list.remove` compares the dicts' tensors with `==`
            self._windows = [
                allocation for allocation in self._windows
                if not (all(r is not None for r in allocation["released"])
                        and all(e.query() for events in allocation["released"] for e in events))
            ]  # fmt: skip

    # -------------------------------------------------------------------- running

    def run(self, fn: Callable[..., Any], *args: Any, return_exceptions: bool = False,
            timeout_s: float | None = None) -> list[Any]:  # fmt: skip
        """Run `fn(rank, group, *args)` on every rank, one thread each, and return the results in
        rank order.

        Each thread runs on the world's device with its rank's compute stream current. When a rank
        raises, the world stops its collectives on the other ranks too (they raise instead of
        waiting for it).

        Arguments:
            fn: the rank function; `group` is the rank's `LoopbackGroup`.
            return_exceptions: put each failed rank's exception in its result instead of raising.
            timeout_s: the deadline of the whole run (default: the world's `timeout_s`).

        Raises:
            LoopbackRankError: a rank raised (without `return_exceptions`); it holds every result and error.
            TimeoutError: ranks did not finish in time (their threads are left running).
        """
        results: list[Any] = [None] * self.num_ranks
        errors: list[BaseException | None] = [None] * self.num_ranks
        first_failure: list[int] = []
        self._abort_reason = None

        def body(rank: int) -> None:
            try:
                with contextlib.ExitStack() as stack:
                    if self.device.type == "cuda":
                        stack.enter_context(torch.cuda.device(self.device))
                        stack.enter_context(torch.cuda.stream(self._streams[rank].compute))
                    results[rank] = fn(rank, self.groups[rank], *args)
            except BaseException as error:
                errors[rank] = error
                error.loopback_traceback = traceback.format_exc()  # type: ignore[attr-defined]
                with self._lock:
                    if self._abort_reason is None:
                        self._abort_reason = f"rank {rank} raised {type(error).__name__}: {error}"
                        first_failure.append(rank)

        threads = [threading.Thread(target=body, args=(rank,), name=f"loopback-rank-{rank}", daemon=True)
                   for rank in range(self.num_ranks)]  # fmt: skip
        interval = sys.getswitchinterval()
        # Host waits busy-poll: hand the interpreter over often
        sys.setswitchinterval(min(interval, 1e-4))
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        finally:
            sys.setswitchinterval(interval)
        stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
        if stuck:
            self._abort_reason = f"ranks {stuck} passed the run's deadline"
            raise TimeoutError(f"LoopbackWorld.run: ranks {stuck} did not finish in time")
        if return_exceptions:
            return [error if error is not None else result for result, error in zip(results, errors, strict=True)]
        failed = [rank for rank, error in enumerate(errors) if error is not None]
        if failed:
            # The rank that raised first is the cause; the others usually stopped because of it
            origin = first_failure[0] if first_failure else failed[0]
            raise LoopbackRankError(
                f"LoopbackWorld.run: ranks {failed} raised; rank {origin} first:\n{errors[origin].loopback_traceback}",  # type: ignore[union-attr]
                results, errors,
            )  # fmt: skip
        return results

    def close(self) -> None:
        """Wait for every rank's streams, free the windows and release the streams (idempotent).
        Call it when no rank function runs."""
        if self.device.type != "cuda":
            return
        for streams in self._streams:
            streams.comm.synchronize()
            streams.compute.synchronize()
        with self._lock:
            self._windows.clear()
            self._guarded.clear()
        # Contributions to collectives that a failure left unfinished
        self.collectives.clear()
        self._internal.clear()
        self.mailboxes.clear()
        torch.cuda.empty_cache()  # the reserve of this world's streams
        if self._green is not None:
            POOL.give(self._green_key, self._green)
            self._green = None
        else:
            for streams in self._streams:
                for handle in streams.handles:
                    POOL.give(("stream", self.device.index), handle)
        self._streams = []

    def __enter__(self) -> LoopbackWorld:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
