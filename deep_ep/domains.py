"""The domains of a process group, as DeepEP V2's module-level helpers report them.

Physical: `(num_rdma_ranks, num_nvlink_ranks)`, the hosts of the group and the ranks on each (one
NVLink domain per host; a `deep_ep.loopback` world's virtual nodes count as hosts). Logical:
`(num_scaleout_ranks, num_scaleup_ranks)`: with hybrid mode allowed and more than one host, one
scale-up domain per host (a buffer then runs hybrid mode: docs/hybrid.md), else one domain of the
whole group.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from deep_ep.backends.base import loopback_world_of
from deep_ep.host_reads import to_host

# Bytes of a host name in the exchange (longer names are cut; 64 is the POSIX host name limit)
_HOST_NAME_BYTES = 64


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device of a group's tensors: the current CUDA device for NCCL groups, the world's device
    for virtual ranks (`deep_ep.loopback`), else the CPU."""
    world = loopback_world_of(group)
    if world is not None:
        return world.device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """`(num_rdma_ranks, num_nvlink_ranks)` of `group`: its hosts and the ranks on each.

    Collective on a real group (every rank's host name, one all-gather); the virtual ranks of a
    `deep_ep.loopback` world share one host. Raises `ValueError` when the hosts hold different
    numbers of ranks (V2 needs equal NVLink domains too).
    """
    world = loopback_world_of(group)
    if world is not None:
        return group.size() // world.num_ranks_per_node, world.num_ranks_per_node
    name = socket.gethostname().encode()[:_HOST_NAME_BYTES]
    row = torch.zeros(_HOST_NAME_BYTES, dtype=torch.uint8)
    if name:
        row[: len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    device = group_device(group)
    gathered = [torch.empty_like(row, device=device) for _ in range(group.size())]
    dist.all_gather(gathered, row.to(device), group=group)
    hosts: dict[bytes, int] = {}
    for host in to_host(torch.stack(gathered)).tolist():
        key = bytes(host)
        hosts[key] = hosts.get(key, 0) + 1
    counts = sorted(set(hosts.values()))
    if len(counts) != 1:
        raise ValueError(
            f"get_physical_domain_size: every host must hold the same number of ranks of `group`, got "
            f"{sorted(hosts.values())} over {len(hosts)} hosts"
        )
    return len(hosts), counts[0]


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """`(num_scaleout_ranks, num_scaleup_ranks)` of `group`: its physical domains when hybrid mode is
    allowed and the group spans more than one host, else `(1, group.size())` (direct mode).

    Collective on a real group spanning hosts (`get_physical_domain_size`).
    """
    return logical_domains(get_physical_domain_size(group), group.size(), allow_hybrid_mode)


def logical_domains(physical: tuple[int, int], num_ranks: int, allow_hybrid_mode: bool) -> tuple[int, int]:
    """The logical domains of a group of `num_ranks` ranks whose physical domains are `physical`."""
    num_hosts, num_ranks_per_host = physical
    if allow_hybrid_mode and num_hosts > 1:
        return num_hosts, num_ranks_per_host
    return 1, num_ranks
