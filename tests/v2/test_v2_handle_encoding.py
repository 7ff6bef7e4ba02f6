"""The handle's encodings as DeepEP V2 writes them (v2-parity.md items 8 and 9), on a routing small
enough to write the answer by hand: `dst_buffer_slot_idx` holds `rank * Tmax + slot` on a token's
highest lane to each destination only, and `recv_src_metadata` column 1 is `src_rank * K + the
token's highest lane to the receiving rank`."""

from __future__ import annotations

import torch
import torch.distributed as dist

import deep_ep
from deep_ep.loopback import LoopbackWorld

TMAX, HIDDEN = 8, 64
# Two ranks, 2 experts each (rank 0: experts 0, 1; rank 1: experts 2, 3), top-3
ROUTING = {
    0: [[2, 0, 3], [1, -1, 0], [-1, 3, -1]],
    1: [[0, 2, 1], [3, 2, -1]],
}
# rank 0's tokens: token 0 goes to rank 1 (lanes 0, 2: master lane 2) and rank 0 (lane 1);
# token 1 to rank 0 (lanes 0, 2: master 2); token 2 to rank 1 (lane 1)
EXPECTED_SLOTS = {
    0: [[-1, 0 * TMAX + 0, 0 * TMAX + 0], [-1, -1, 0 * TMAX + 1], [-1, 0 * TMAX + 1, -1]],
    1: [[-1, 1 * TMAX + 0, 1 * TMAX + 0], [-1, 1 * TMAX + 1, -1]],
}
# Received rows in (source rank, source token) order with column 1 = src * 3 + master lane
EXPECTED_COLUMN_1 = {
    0: [0 * 3 + 1, 0 * 3 + 2, 1 * 3 + 2],  # from rank 0: tokens 0, 1; from rank 1: token 0 (lanes 0, 2)
    1: [0 * 3 + 2, 0 * 3 + 1, 1 * 3 + 1, 1 * 3 + 1],  # from rank 0: tokens 0, 2; from rank 1: tokens 0, 1
}


def _encoding_rank(rank: int, group: dist.ProcessGroup) -> tuple[list, list]:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=3,
                                   backend="reference", explicitly_destroy=True)  # fmt: skip
    topk_idx = torch.tensor(ROUTING[rank], dtype=torch.int64)
    x = torch.randn((len(ROUTING[rank]), HIDDEN)).to(torch.bfloat16)
    handle = buffer.dispatch(x, topk_idx=topk_idx, num_experts=4)[3]
    result = (handle.dst_buffer_slot_idx.tolist(), handle.recv_src_metadata[: handle.num_recv_tokens, 1].tolist())
    buffer.destroy()
    return result


def test_slots_and_metadata_use_v2s_encodings() -> None:
    for rank, (slots, column_1) in enumerate(LoopbackWorld(2, device="cpu").run(_encoding_rank)):
        assert slots == EXPECTED_SLOTS[rank], (rank, slots)
        assert column_1 == EXPECTED_COLUMN_1[rank], (rank, column_1)
