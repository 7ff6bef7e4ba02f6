"""The transport self-test (transport_ping.cuh) over LSA on virtual ranks of one GPU: every rank's
block reaches every peer bit for bit, its signal after it, within the deadline; the buffer works
afterwards (the ping runs between operations). The GIN instantiation only compiles here
(tests/test_nccl_matrix.py): no machine here has an RDMA NIC."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _ping_rank(rank: int, group: dist.ProcessGroup) -> tuple[list[list[int]], tuple]:
    from kernel_checks import make_inputs

    import deep_ep
    from deep_ep.backends.kernels.ping import transport_ping

    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=2048, num_topk=8, backend="kernels",
                                   explicitly_destroy=True)  # fmt: skip
    runtime = buffer.backend.runtime
    rounds = [transport_ping(runtime, num_bytes) for num_bytes in (16, 4096, 1 << 16)]
    x, topk_idx, weights, _ = make_inputs(rank, group.size(), 32, 2048, "bf16", 8 * group.size(), 8, "uniform",
                                          0.0, 0, 5, "cuda")  # fmt: skip
    recv_x, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size())
    shapes = (tuple(recv_x.shape), handle.num_recv_tokens)
    buffer.destroy()
    return rounds, shapes


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_every_block_reaches_every_peer(num_ranks: int) -> None:
    for rounds, (recv_shape, num_recv) in LoopbackWorld(num_ranks).run(_ping_rank):
        assert rounds == [[1] * num_ranks] * 3, rounds
        assert recv_shape[0] == num_recv  # the buffer still dispatches after the pings
