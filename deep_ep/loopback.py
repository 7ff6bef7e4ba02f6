"""Virtual ranks: many ranks of one GPU, each driving its own `ElasticBuffer`, in one process.

    world = LoopbackWorld(4)                       # 4 virtual ranks on cuda:0
    def step(rank, group):                         # one thread per rank
        buffer = ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=2048, explicitly_destroy=True)
        ...                                        # the public API, unchanged
        buffer.destroy()
        return result
    results = world.run(step)                      # per rank, in rank order

Each rank gets a `LoopbackGroup`: a `torch.distributed.ProcessGroup` whose collectives run between
the threads of the world, so the reference backend, `torch.distributed` calls and our own buffers
all work on it. With the kernels backend (the default on a CUDA world) a buffer runs the real
NVLink kernels: every rank's window lives in the same GPU and peers reach it by loads and stores,
as over NVLink; no NCCL is involved. It tests the protocol (slots, counts, credits, epochs, task
queues, deadlines and faults, layouts at many ranks, cached and graph paths), not NVLink speed nor
orderings that need the fabric (one L2 hides a missing system scope). `docs/loopback.md` has more.

What makes virtual ranks reliable is part of the world:
- SMs: each rank's grids fit its share (`num_sms_per_rank`, by default the device's SMs over the
  ranks; a communication kernel and its epilogue together), so a rank spinning on a peer never
  keeps that peer's kernels off the GPU. `green_contexts=True` makes the shares hard partitions.
- Streams: every rank has its own compute and communication streams, never from torch's pool
  (which hands out 32 per priority round robin: two ranks on one stream deadlock), and
  `CUDA_DEVICE_MAX_CONNECTIONS` is raised to 32 before CUDA starts (streams sharing a hardware
  queue would put one rank's work behind another's). Streams outlive their world (a later world
  takes them over): tensors that outlive it may still name them.
- Kernels: loading a kernel may wait for every running kernel (a context-wide synchronisation), so
  CUDA loads all of torch's kernels when it starts (`CUDA_MODULE_LOADING=EAGER`, set before CUDA
  starts), and a rank that needs one of our kernels for the first time loads it together with every
  other rank, at a point where none of them can launch.
- Memory: a `cudaMalloc` keeps the commands issued before it and after it, on any stream of the
  device, from running at the same time (CUDA's implicit synchronisation): one rank allocating
  while a peer's kernel waits for that rank's next launch stalls both until the deadline. So the
  world fills torch's caching allocator with a reserve per rank stream up front, from which
  allocations are served without `cudaMalloc` (`reserve_bytes`). `torch.cuda.empty_cache()`, which
  `torch.cuda.graph` calls, returns it; `LoopbackWorld.reserve()` refills it.
- Waits: never synchronize the whole device inside a rank function (`torch.cuda.synchronize()`
  would wait for peers' kernels that wait for this thread): wait on streams or events. And never
  read a CUDA tensor on the host (`.tolist()`, `.item()`, `.cpu()`) while this rank's stream holds
  work that waits for a peer's next launch: the copy waits inside the driver and holds back the
  peer's CUDA calls (its launch) with it. Drain the stream first by polling
  (`deep_ep.host_reads.wait_for_stream`), as the facade and the reference backend do.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .backends.base import loopback_world_of

# Hardware queues: streams that share one would order one rank's work behind another's
_DEVICE_CONNECTIONS = "32"
# A guarded allocation is surrounded by bytes of this pattern, and filled with the other (large
# values in every integer field: metadata that was never written cannot pass for valid)
_GUARD_PATTERN = 0xA5
_UNWRITTEN_PATTERN = 0x7B
_WINDOW_ALIGNMENT = 4096
# SMs per green-context partition come in steps of this many on Hopper
_GREEN_SM_STEP = 8

if not torch.cuda.is_initialized():
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", _DEVICE_CONNECTIONS)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


class LoopbackRankError(RuntimeError):
    """A rank function raised; `errors[r]` is rank r's exception (or `None`), `results[r]` its value."""

    def __init__(self, message: str, results: list[Any], errors: list[BaseException | None]) -> None:
        super().__init__(message)
        self.results = results
        self.errors = errors


def loopback_world(group: Any) -> LoopbackWorld | None:
    """The `LoopbackWorld` of a `LoopbackGroup`, or `None` for any other group."""
    return loopback_world_of(group) if isinstance(group, LoopbackGroup) else None


# ------------------------------------------------------------------------------------------ collectives


class _Rendezvous:
    """Matches the k-th call of every rank: what each brought, and who has taken the results."""

    def __init__(self, num_ranks: int, abort: Callable[[], str | None]) -> None:
        self.num_ranks = num_ranks
        self.abort = abort
        self.condition = threading.Condition()
        self.entries: dict[Any, dict] = {}

    def deposit(self, key: Any, rank: int, value: Any) -> dict:
        with self.condition:
            entry = self.entries.setdefault(key, {"values": [None] * self.num_ranks, "arrived": 0, "taken": 0})
            entry["values"][rank] = value
            entry["arrived"] += 1
            if entry["arrived"] == self.num_ranks:
                self.condition.notify_all()
            return entry

    def is_full(self, entry: dict) -> bool:
        return entry["arrived"] == self.num_ranks

    def wait_full(self, entry: dict, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        with self.condition:
            while entry["arrived"] < self.num_ranks:
                reason = self.abort()
                if reason is not None:
                    raise RuntimeError(f"{what}: the loopback world stopped ({reason})")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, v in enumerate(entry["values"]) if v is None]
                    raise RuntimeError(f"{what}: ranks {missing} did not join within {timeout_s:g} s")
                self.condition.wait(min(left, 0.05))

    def take(self, key: Any, entry: dict) -> None:
        with self.condition:
            entry["taken"] += 1
            if entry["taken"] == self.num_ranks:
                self.entries.pop(key, None)

    def clear(self) -> None:
        with self.condition:
            self.entries.clear()

    def exchange(self, key: Any, rank: int, value: Any, timeout_s: float, what: str) -> list[Any]:
        """Blocking: every rank's value for `key`."""
        entry = self.deposit(key, rank, value)
        self.wait_full(entry, timeout_s, what)
        values = list(entry["values"])
        self.take(key, entry)
        return values


class _Contribution:
    """A rank's input to a collective: a private copy, and on CUDA the event after which it is ready."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = [t.detach().clone() for t in tensors]
        self.event = None
        if any(t.is_cuda for t in self.tensors):
            self.event = torch.cuda.Event()
            self.event.record()

    def ready_on_current_stream(self) -> list[torch.Tensor]:
        """The tensors, once the current stream has waited for them (the allocator keeps them for it)."""
        if self.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.event)
            for t in self.tensors:
                if t.is_cuda:
                    t.record_stream(stream)
        return self.tensors


def _completed_work() -> dist.Work:
    """A `Work` that has completed. Collectives of a Python process group come back to the caller
    through torch's op registry, which keeps only the C++ side of a `Work` subclass (its
    `is_completed` would never turn true): so every collective of ours completes within the call."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _reduce(values: list[torch.Tensor], op: Any) -> torch.Tensor:
    result = values[0].clone()
    for value in values[1:]:
        if op == dist.ReduceOp.SUM:
            result += value
        elif op == dist.ReduceOp.MIN:
            result = torch.minimum(result, value)
        elif op == dist.ReduceOp.MAX:
            result = torch.maximum(result, value)
        elif op == dist.ReduceOp.PRODUCT:
            result *= value
        else:
            raise ValueError(f"LoopbackGroup: reduce op {op} is not supported (SUM, MIN, MAX, PRODUCT are)")
    return result


class LoopbackGroup(dist.ProcessGroup):
    """One virtual rank's process group: collectives between the threads of a `LoopbackWorld`.

    Supports `all_gather` (of lists), `all_reduce` (SUM, MIN, MAX, PRODUCT),
    `broadcast` (pass `group_src=` for the root: the group is not registered with torch's world,
    so `src=` global ranks cannot be translated), `all_to_all_single`, `all_to_all`, `barrier` and the
    `*_object` collectives built on them. A call returns once every rank has made it (or raises
    after the world's deadline, or when another rank's function raised); outputs are written on the
    caller's current stream.

    Attributes:
        loopback_world: the world.
        device: where this rank's tensors live.
    """

    def __init__(self, world: LoopbackWorld, rank: int) -> None:
        super().__init__(rank, world.num_ranks)
        self.loopback_world = world
        self.rendezvous = world.collectives
        self._rank = rank
        self._num_calls = 0

    @property
    def device(self) -> torch.device:
        return self.loopback_world.device

    def getBackendName(self) -> str:
        return "loopback"

    def _collective(self, what: str, inputs: Sequence[torch.Tensor], finish: Callable[[list[Any]], None]) -> dist.Work:
        """Contribute `inputs`, wait (with the world's deadline) until every rank has, then
        `finish(contributions)` on this rank's current stream."""
        key = self._num_calls
        self._num_calls += 1
        entry = self.rendezvous.deposit(key, self._rank, _Contribution(inputs))
        self.rendezvous.wait_full(entry, self.loopback_world.timeout_s,
                                  f"LoopbackGroup {what} (call {key}) on rank {self._rank}")  # fmt: skip
        try:
            finish(entry["values"])
        finally:
            self.rendezvous.take(key, entry)
        return _completed_work()

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:  # fmt: skip
        def finish(values: list[_Contribution]) -> None:
            for out, value in zip(output_tensors[0], values, strict=True):
                out.copy_(value.ready_on_current_stream()[0])

        return self._collective("all_gather", input_tensors[:1], finish)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp

        def finish(values: list[_Contribution]) -> None:
            tensors[0].copy_(_reduce([value.ready_on_current_stream()[0] for value in values], op))

        return self._collective("all_reduce", tensors[:1], finish)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = 0 if opts is None else opts.rootRank

        def finish(values: list[_Contribution]) -> None:
            tensors[0].copy_(values[root].ready_on_current_stream()[0])

        return self._collective("broadcast", tensors[:1], finish)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._collective("barrier", [], lambda values: None)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> dist.Work:  # fmt: skip
        n = self.size()
        sends = list(input_split_sizes) or [input.shape[0] // n] * n
        recvs = list(output_split_sizes) or [output.shape[0] // n] * n
        me = self._rank

        def finish(values: list[_Contribution]) -> None:
            offset = 0
            for src, value in enumerate(values):
                chunks = value.ready_on_current_stream()
                output[offset : offset + recvs[src]].copy_(chunks[me])
                offset += recvs[src]

        return self._collective("all_to_all_single", list(torch.split(input, sends)), finish)

    # Newer torch calls the group's own `all_to_all_single`, which would wrap our work
    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:  # fmt: skip
        me = self._rank

        def finish(values: list[_Contribution]) -> None:
            for out, value in zip(output_tensors, values, strict=True):
                out.copy_(value.ready_on_current_stream()[me])

        return self._collective("all_to_all", input_tensors, finish)


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


# ------------------------------------------------------------------------------------------ streams


def _driver() -> Any:
    from cuda.bindings import driver as cuda

    return cuda


def _check(result: tuple, call: str) -> Any:
    from .jit import driver as jit_driver

    return jit_driver.check(result, call)


@dataclass
class _RankStreams:
    compute: torch.cuda.Stream
    comm: torch.cuda.Stream
    handles: tuple[int, ...]


class _GreenContexts:
    """Hard SM partitions of one device, one per rank (`cuDevSmResourceSplitByCount`)."""

    def __init__(self, device: int, num_ranks: int, num_sms_per_rank: int) -> None:
        cuda = _driver()
        from .jit import driver as jit_driver

        jit_driver.init()
        resource = _check(
            cuda.cuDeviceGetDevResource(jit_driver.device(device), cuda.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
            "cuDeviceGetDevResource",
        )
        groups, num_groups, _ = _check(
            cuda.cuDevSmResourceSplitByCount(num_ranks, resource, 0, num_sms_per_rank), "cuDevSmResourceSplitByCount"
        )
        if num_groups < num_ranks:
            raise ValueError(
                f"LoopbackWorld: `green_contexts` needs {num_ranks} partitions of {num_sms_per_rank} SMs, the device "
                f"splits into {num_groups}"
            )
        self.contexts = []
        for group in list(groups)[:num_ranks]:
            desc = _check(cuda.cuDevResourceGenerateDesc([group], 1), "cuDevResourceGenerateDesc")
            flags = cuda.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
            self.contexts.append(
                _check(cuda.cuGreenCtxCreate(desc, jit_driver.device(device), flags), "cuGreenCtxCreate")
            )

        flags = cuda.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream_handles = [
            tuple(
                int(_check(cuda.cuGreenCtxStreamCreate(context, flags, 0), "cuGreenCtxStreamCreate")) for _ in range(2)
            )
            for context in self.contexts
        ]


class _Pool:
    """What ended worlds leave for the next: streams and green contexts are never destroyed, because
    tensors that outlive a world may still name its streams (torch's allocator records an event on
    every stream a freed tensor was used on, and a destroyed stream's handle is undefined behaviour)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[Any, list[Any]] = {}

    def take(self, key: Any, create: Callable[[], Any]) -> Any:
        with self._lock:
            items = self._free.get(key)
            if items:
                return items.pop()
        return create()

    def give(self, key: Any, item: Any) -> None:
        with self._lock:
            self._free.setdefault(key, []).append(item)


_POOL = _Pool()


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
    ) -> None:
        from .backends.kernels.layout import MAX_RANKS

        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or not 1 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"LoopbackWorld: `num_ranks` must be an int in [1, {MAX_RANKS}], got {num_ranks!r}")
        if isinstance(guard_bytes, bool) or not isinstance(guard_bytes, int) or guard_bytes < 0:
            raise ValueError(f"LoopbackWorld: `guard_bytes` must be a non-negative int, got {guard_bytes!r}")
        self.num_ranks = num_ranks
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
        self.collectives = _Rendezvous(num_ranks, lambda: self._abort_reason)
        self._internal = _Rendezvous(num_ranks, lambda: self._abort_reason)
        self._internal_calls = [0] * num_ranks
        self._abort_reason: str | None = None
        self._lock = threading.Lock()
        self._loaded: list[set] = [set() for _ in range(num_ranks)]
        self._guarded: list[tuple[torch.Tensor, int, str]] = []
        self._windows: list[dict] = []
        self._green: _GreenContexts | None = None
        self._green_key: Any = None
        self.num_device_sms = 0
        self.num_sms_per_rank = 0
        self._streams: list[_RankStreams] = []
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
        cuda = _driver()
        index = self.device.index
        from .jit import driver as jit_driver

        def create_stream() -> int:
            with jit_driver.current_context(index):
                flags = cuda.CUstream_flags.CU_STREAM_NON_BLOCKING
                return int(_check(cuda.cuStreamCreate(flags), "cuStreamCreate"))

        if green_contexts:
            self._green_key = ("green", index, self.num_ranks, share)
            self._green = _POOL.take(self._green_key, lambda: _GreenContexts(index, self.num_ranks, share))
        for rank in range(self.num_ranks):
            if self._green is not None:
                handles = self._green.stream_handles[rank]
            else:
                handles = tuple(_POOL.take(("stream", index), create_stream) for _ in range(2))
            compute, comm = (torch.cuda.get_stream_from_external(h, self.device) for h in handles)
            self._streams.append(_RankStreams(compute, comm, handles))

    def _check_occupancy(self) -> None:
        """Our kernels run one 512-thread CTA per SM at most; check that one fits at all."""
        from .backends.kernels.specs import barrier_spec, load

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
        from .backends.kernels.transport import DeviceShare

        return DeviceShare(self.num_sms_per_rank, exclusive=True, empty=self.empty,
                           load=lambda specs: self.load_kernels(rank, specs))  # fmt: skip

    def _exchange(self, rank: int, value: Any, what: str) -> list[Any]:
        key = ("internal", self._internal_calls[rank])
        self._internal_calls[rank] += 1
        return self._internal.exchange(key, rank, value, self.timeout_s, f"LoopbackWorld {what} on rank {rank}")

    def load_kernels(self, rank: int, specs: Sequence[Any]) -> list[Any]:
        """Load `specs` for `rank`. The first time a rank needs a kernel, every rank loads its own at
        the same point (all ranks run the same operations): loading may wait for running kernels,
        and none of those can then wait for a launch that a loading thread holds back."""
        from .backends.kernels.specs import load

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
            for allocation in list(self._windows):
                released = allocation["released"]
                if all(r is not None for r in released) and all(e.query() for events in released for e in events):
                    self._windows.remove(allocation)

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
        torch.cuda.empty_cache()  # the reserve of this world's streams
        if self._green is not None:
            _POOL.give(self._green_key, self._green)
            self._green = None
        else:
            for streams in self._streams:
                for handle in streams.handles:
                    _POOL.give(("stream", self.device.index), handle)
        self._streams = []

    def __enter__(self) -> LoopbackWorld:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
