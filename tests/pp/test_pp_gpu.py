"""Pipeline send/recv on CUDA virtual ranks of one GPU (issue 24): a ring and a non-adjacent pair with
several tensors in flight, bit for bit, on kernels buffers (whose PP runs on the group's point-to-point
calls until the copy-engine ring is built)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _ring_rank(rank: int, group: dist.ProcessGroup) -> bool:
    n = group.size()
    buffer = deep_ep.ElasticBuffer(group, 2 << 20, backend="kernels", explicitly_destroy=True)
    buffer.pp_set_config(1 << 16, 4)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    sent = [torch.randn((64, 128), generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3)]
    for t in sent:
        buffer.pp_send(t, (rank + 2) % n)  # not adjacent from 4 ranks on
    got = [torch.empty_like(t) for t in sent]
    for t in got:
        buffer.pp_recv(t, (rank - 2) % n)
    everyone = [None] * n
    dist.all_gather_object(everyone, [t.cpu() for t in sent], group=group)
    buffer.destroy()
    return all(
        torch.equal(a.cpu().view(torch.int16), b.view(torch.int16))
        for a, b in zip(got, everyone[(rank - 2) % n], strict=True)
    )


@pytest.mark.parametrize("num_ranks", [4, 8])
def test_tensors_reach_non_adjacent_ranks_bit_for_bit(num_ranks: int) -> None:
    assert LoopbackWorld(num_ranks).run(_ring_rank) == [True] * num_ranks
