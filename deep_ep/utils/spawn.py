"""Run a function on N local ranks, each in its own process with an initialised process group.

`spawn_ranks` is how the tests and the CLI start multi-rank jobs on one machine: no `torchrun`, no
leftover processes. A failing rank's traceback is raised in the parent; a job that does not finish
within its deadline is killed as a whole.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

# Set in every child before torch initialises NCCL (never use NVLink multicast on our machines)
CHILD_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# How long the parent waits for the other ranks' reports once one rank has failed
_FAILURE_GRACE_S = 3.0


class RankError(RuntimeError):
    """A rank raised an exception; the message holds its rank index and traceback."""


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    num_ranks: int,
    backend: str,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
) -> None:
    os.environ.update(CHILD_ENV)
    initialized = False
    try:
        import torch
        import torch.distributed as dist

        # Do not oversubscribe the CPU when many ranks share few cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=num_ranks,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        initialized = True
        report = (rank, True, fn(rank, num_ranks, *args))
    except BaseException:
        report = (rank, False, traceback.format_exc())

    # Report before tearing the group down: peers fail once our connections close, and the root
    # cause must reach the parent first (`join_thread` waits until the report is in the pipe)
    results.put(report)
    results.close()
    results.join_thread()
    if initialized:
        dist.destroy_process_group()


def _stop(processes: list[Any]) -> None:
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.is_alive():
            process.terminate()
    for process in started:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def spawn_ranks(
    fn: Callable[..., Any],
    num_ranks: int,
    backend: str = "gloo",
    args: Sequence[Any] = (),
    timeout_s: float = 300.0,
) -> list[Any]:
    """Run `fn(rank, num_ranks, *args)` on `num_ranks` local processes and return their results.

    Each child sets `CHILD_ENV`, initialises the default process group over TCP on a free port
    (for `nccl`: device `cuda:rank`, passed as `device_id`), calls `fn`, and destroys the group.

    Arguments:
        fn: a picklable (module-level) function; its return value must be picklable.
        num_ranks: the number of processes.
        backend: `'gloo'` (CPU) or `'nccl'` (one GPU per rank).
        args: extra positional arguments for `fn`.
        timeout_s: the deadline of the whole job, start-up included; on expiry every child is killed.

    Returns:
        results: the return values of `fn`, indexed by rank.

    Raises:
        RankError: a rank raised; the message holds the traceback of the first failure reported
            (and names the other failed ranks).
        TimeoutError: the job passed its deadline; the message names the ranks that had not finished.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn_ranks: `backend` must be 'gloo' or 'nccl', got {backend!r}")
    if num_ranks < 1:
        raise ValueError(f"spawn_ranks: `num_ranks` must be positive, got {num_ranks}")

    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    port = find_free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, num_ranks, backend, port, timeout_s, fn, tuple(args), results),
            daemon=True,
        )
        for rank in range(num_ranks)
    ]
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    failure_deadline = None
    try:
        for process in processes:
            process.start()
        while len(values) + len(failures) < num_ranks:
            now = time.monotonic()
            if failure_deadline is not None and now > failure_deadline:
                break
            if now > deadline:
                missing = sorted(set(range(num_ranks)) - set(values) - set(failures))
                raise TimeoutError(
                    f"spawn_ranks: {fn.__name__} did not finish within {timeout_s:.0f} s on ranks {missing}; "
                    "all ranks were killed"
                )
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue_module.Empty:
                # A rank that died without reporting (e.g. a segfault) is a failure too
                for rank, process in enumerate(processes):
                    if process.exitcode is not None and rank not in values and rank not in failures:
                        try:
                            rank_, ok_, value_ = results.get(timeout=1.0)
                            (values if ok_ else failures)[rank_] = value_
                        except queue_module.Empty:
                            failures[rank] = f"process exited with code {process.exitcode} without a report"
                continue
            if ok:
                values[rank] = value
            else:
                failures[rank] = value
            if failures and failure_deadline is None:
                failure_deadline = time.monotonic() + _FAILURE_GRACE_S
        if failures:
            # The first report is usually the root cause (the other ranks then fail on a closed peer)
            first = next(iter(failures))
            others = sorted(set(failures) - {first})
            unfinished = sorted(set(range(num_ranks)) - set(values) - set(failures))
            note = f" (ranks {others} failed too)" if others else ""
            note += f" (ranks {unfinished} were killed)" if unfinished else ""
            raise RankError(f"rank {first} of {num_ranks} failed{note}:\n{failures[first]}")
        return [values[rank] for rank in range(num_ranks)]
    finally:
        _stop(processes)
        results.close()
        results.join_thread()
