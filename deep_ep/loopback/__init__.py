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

The package: `world` (the world, its ranks' streams, SM shares, memory and windows, and `run`),
`collectives` (the `ProcessGroup` of a virtual rank), `device` (CUDA driver resources that outlive a
world: streams and green contexts). Importing it sets the CUDA settings virtual ranks need, if CUDA
has not started yet.
"""

from __future__ import annotations

import os

import torch

# Hardware queues: streams that share one would order one rank's work behind another's
_DEVICE_CONNECTIONS = "32"

if not torch.cuda.is_initialized():
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", _DEVICE_CONNECTIONS)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

from .collectives import LoopbackGroup  # noqa: E402  (after the settings, which must precede CUDA)
from .world import LoopbackRankError, LoopbackWindows, LoopbackWorld, loopback_world  # noqa: E402

__all__ = ["LoopbackGroup", "LoopbackRankError", "LoopbackWindows", "LoopbackWorld", "loopback_world"]
