"""The `torch.distributed.ProcessGroup` of a virtual rank: collectives between the threads of one
`LoopbackWorld`, matched call by call (`Rendezvous`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .world import LoopbackWorld


class Rendezvous:
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


class Mailboxes:
    """Point-to-point messages between the ranks of a world: one FIFO per (source, destination)."""

    def __init__(self, abort: Callable[[], str | None]) -> None:
        self.abort = abort
        self.condition = threading.Condition()
        self.queues: dict[tuple[int, int], list[Any]] = {}

    def put(self, src: int, dst: int, value: Any) -> None:
        with self.condition:
            self.queues.setdefault((src, dst), []).append(value)
            self.condition.notify_all()

    def get(self, src: int, dst: int, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        with self.condition:
            while not self.queues.get((src, dst)):
                reason = self.abort()
                if reason is not None:
                    raise RuntimeError(f"{what}: the loopback world stopped ({reason})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{what}: rank {src} sent nothing within {timeout_s:g} s")
                self.condition.wait(min(left, 0.05))
            return self.queues[(src, dst)].pop(0)

    def clear(self) -> None:
        with self.condition:
            self.queues.clear()


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
    so `src=` global ranks cannot be translated), `all_to_all_single`, `all_to_all`, `barrier`, the
    `*_object` collectives built on them, and `send`/`recv` (`isend`/`irecv`; pass `group_dst=` /
    `group_src=`; a send never waits for its receiver). A call returns once every rank has made it (or raises
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

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """Queue a copy of `tensors[0]` for rank `dstRank` (messages of one pair arrive in order; tags
        are not matched)."""
        self.loopback_world.mailboxes.put(self._rank, dstRank, _Contribution(tensors[:1]))
        return _completed_work()

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """Wait (with the world's deadline) for rank `srcRank`'s next message into `tensors[0]`."""
        value = self.loopback_world.mailboxes.get(srcRank, self._rank, self.loopback_world.timeout_s,
                                                  f"LoopbackGroup recv on rank {self._rank}")  # fmt: skip
        tensors[0].copy_(value.ready_on_current_stream()[0])
        return _completed_work()

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
