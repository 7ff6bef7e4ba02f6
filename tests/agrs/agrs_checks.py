"""The AGRS checks one rank runs (CPU virtual ranks here, CUDA virtual ranks in the GPU test): all-gather
bit for bit against every rank's tensors, reduce-scatter bit for bit against a fixed-order FP32 sum
by brute force, single and batched calls, in-place tensors, the session's accounting."""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from oracle import assert_bitwise, gather_to_all

import deep_ep
from deep_ep.domains import group_device

GATHER_DTYPES = (torch.bfloat16, torch.float32, torch.int8, torch.uint8, torch.float8_e4m3fn)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype in (torch.bfloat16, torch.float32):  # a wide exponent range: FP32 sums depend on the order
        scale = torch.exp2(torch.randint(-14, 15, shape, generator=gen).float())
        return (torch.randn(shape, generator=gen) * scale).to(dtype)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def agrs_rank(rank: int, group: dist.ProcessGroup, seed: int, backend: str) -> dict[str, Any]:
    device = group_device(group)
    num_ranks = group.size()
    shapes = [(5, 24), (3,), (2, 3, 16)]
    num_bytes = deep_ep.ElasticBuffer.get_agrs_buffer_size_hint(
        group, sum(deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(group, s, torch.float32) for s in shapes) * 8
    )
    buffer = deep_ep.ElasticBuffer(group, num_bytes, backend=backend, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(seed * 101 + rank)
    out: dict[str, Any] = {"order_differs": 0, "window_views": True}
    # The kernels backend inside one NVLink domain gathers into its window: the outputs are views of it
    engine = buffer.backend.agrs()
    window = engine.runtime.windows.bytes if engine is not None else None
    with buffer.agrs_new_session():
        for dtype in GATHER_DTYPES:
            mine = [_random(shape, dtype, gen).to(device) for shape in shapes]
            single, wait = buffer.all_gather(mine[0])
            wait()
            *batched, wait = buffer.all_gather(mine)
            wait()
            everyone = gather_to_all(mine, group)
            for i, gathered in enumerate([single, *batched]):
                if window is not None:
                    start = gathered.data_ptr() - window.data_ptr()
                    out["window_views"] &= 0 <= start and start + gathered.nbytes <= window.nbytes
                index = 0 if i == 0 else i - 1
                expected = torch.stack([everyone[r][index] for r in range(num_ranks)])
                assert_bitwise(gathered, expected, f"all_gather of {dtype}, tensor {index}")
        inplace = buffer.agrs_get_inplace_tensor((4, 8), torch.bfloat16)
        inplace.copy_(_random((4, 8), torch.bfloat16, gen).to(device))
        gathered, wait = buffer.all_gather(inplace)
        wait()  # before a host read (virtual ranks: the read would hold back a peer's launch)
        assert_bitwise(gathered[rank], inplace, "all_gather of an in-place tensor")
    with buffer.agrs_new_session():
        # Rows of whole 16-byte vectors, and rows that end inside one (the kernels' two loops)
        for dtype, shape in itertools.product((torch.bfloat16, torch.float32), ((6, 40), (3, 5))):
            contributions = _random((num_ranks, *shape), dtype, gen).to(device)
            before = contributions.clone()
            reduced, wait = buffer.reduce_scatter(contributions)
            wait()
            everyone = gather_to_all(contributions, group)
            acc, backwards = torch.zeros(shape), torch.zeros(shape)
            for source in range(num_ranks):
                acc = acc + everyone[source][rank].float()
                backwards = backwards + everyone[num_ranks - 1 - source][rank].float()
            assert_bitwise(reduced, acc.to(dtype), f"reduce_scatter of {dtype} {shape}")
            assert_bitwise(contributions, before, "reduce_scatter's input (it was modified)")
            out["order_differs"] += int((acc.to(dtype) != backwards.to(dtype)).sum())
    out["sizes"] = (buffer.get_agrs_num_max_session_bytes(group, (5, 24), torch.bfloat16), num_bytes)
    buffer.destroy()
    return out


def random_schedule_rank(rank: int, group: dist.ProcessGroup, seed: int, backend: str) -> int:
    """Random sessions (the same schedule on every rank, from `seed`): each makes 1 to 6 calls of
    random kinds, dtypes and shapes back to back and waits only at its end, so that ranks run calls
    ahead of each other; every result is checked bit for bit against brute force. Returns the calls."""
    import random

    device = group_device(group)
    num_ranks = group.size()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    buffer = deep_ep.ElasticBuffer(group, 8 << 20, backend=backend, explicitly_destroy=True)
    num_calls = 0
    for _ in range(rng.randint(2, 4)):
        made = []
        with buffer.agrs_new_session():
            for _ in range(rng.randint(1, 6)):
                kind = rng.choice(["gather", "batched", "reduce"])
                if kind == "reduce":
                    dtype = rng.choice([torch.bfloat16, torch.float32])
                    shape = (num_ranks, rng.randint(1, 9), rng.choice([1, 7, 8, 40]))
                    x = _random(shape, dtype, gen).to(device)
                    made.append((kind, [x], buffer.reduce_scatter(x)))
                else:
                    dtype = rng.choice(GATHER_DTYPES)
                    shapes = [(rng.randint(1, 5), rng.choice([3, 16, 64])) for _ in range(1 if kind == "gather" else 3)]
                    xs = [_random(s, dtype, gen).to(device) for s in shapes]
                    made.append((kind, xs, buffer.all_gather(xs[0] if kind == "gather" else xs)))
            made[-1][2][-1]()  # the session's last call's wait covers the earlier ones (stream order)
            for kind, xs, result in made:
                everyone = gather_to_all(xs, group)
                for index, out in enumerate(result[:-1]):
                    if kind == "reduce":
                        acc = torch.zeros(out.shape)
                        for source in range(num_ranks):
                            acc = acc + everyone[source][0][rank].float()
                        assert_bitwise(out, acc.to(out.dtype), f"seed {seed}: reduce_scatter {tuple(xs[0].shape)}")
                    else:
                        expected = torch.stack([everyone[r][index] for r in range(num_ranks)])
                        assert_bitwise(out, expected, f"seed {seed}: all_gather ({kind}) {tuple(xs[index].shape)}")
                num_calls += 1
    buffer.destroy()
    return num_calls
