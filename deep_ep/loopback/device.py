"""CUDA driver resources of virtual ranks that outlive a world: streams and green contexts, kept in
a pool for later worlds (tensors that outlive a world may still name its streams)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def cuda_driver() -> Any:
    from cuda.bindings import driver as cuda

    return cuda


def check(result: tuple, call: str) -> Any:
    from ..jit import driver as jit_driver

    return jit_driver.check(result, call)


@dataclass
class RankStreams:
    compute: torch.cuda.Stream
    comm: torch.cuda.Stream
    handles: tuple[int, ...]


class GreenContexts:
    """Hard SM partitions of one device, one per rank (`cuDevSmResourceSplitByCount`)."""

    def __init__(self, device: int, num_ranks: int, num_sms_per_rank: int) -> None:
        cuda = cuda_driver()
        from ..jit import driver as jit_driver

        jit_driver.init()
        resource = check(
            cuda.cuDeviceGetDevResource(jit_driver.device(device), cuda.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
            "cuDeviceGetDevResource",
        )
        groups, num_groups, _ = check(
            cuda.cuDevSmResourceSplitByCount(num_ranks, resource, 0, num_sms_per_rank), "cuDevSmResourceSplitByCount"
        )
        if num_groups < num_ranks:
            raise ValueError(
                f"LoopbackWorld: `green_contexts` needs {num_ranks} partitions of {num_sms_per_rank} SMs, the device "
                f"splits into {num_groups}"
            )
        self.contexts = []
        for group in list(groups)[:num_ranks]:
            desc = check(cuda.cuDevResourceGenerateDesc([group], 1), "cuDevResourceGenerateDesc")
            flags = cuda.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
            self.contexts.append(
                check(cuda.cuGreenCtxCreate(desc, jit_driver.device(device), flags), "cuGreenCtxCreate")
            )

        flags = cuda.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.stream_handles = [
            tuple(
                int(check(cuda.cuGreenCtxStreamCreate(context, flags, 0), "cuGreenCtxStreamCreate")) for _ in range(2)
            )
            for context in self.contexts
        ]


class Pool:
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


POOL = Pool()
