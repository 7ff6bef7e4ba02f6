"""DeepEP V2's stream rules on the NVLink kernels (v2-parity.md items 11 and 15), with virtual ranks on
one GPU: `previous_event_before_epilogue` holds back the epilogue only (a peer that waits for our
records is not held back), every buffer of a process shares one high-priority communication stream,
and `EP_AVOID_RECORD_STREAM=1` leaves the inputs of an asynchronous call to the caller."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

NUM_TOKENS, HIDDEN, NUM_TOPK, TMAX, NUM_EXPERTS = 64, 2048, 8, 128, 32
SLEEP_CYCLES = 400_000_000  # about 0.2 s


def _buffers(group: dist.ProcessGroup) -> tuple:
    import deep_ep

    shape = dict(num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK, explicitly_destroy=True)
    return tuple(deep_ep.ElasticBuffer(group, backend=backend, **shape) for backend in ("kernels", "reference"))


def _inputs(rank: int, group: dist.ProcessGroup, seed: int) -> tuple:
    from kernel_checks import make_inputs

    return make_inputs(rank, group.size(), NUM_TOKENS, HIDDEN, "bf16", NUM_EXPERTS, NUM_TOPK, "uniform", 0.1, 0,
                       seed, "cuda")  # fmt: skip


def _late_event_rank(rank: int, group: dist.ProcessGroup, seed: int) -> dict:
    from kernel_checks import check_dispatch

    import deep_ep

    kernels, reference = _buffers(group)
    x, topk_idx, weights, _ = _inputs(rank, group, seed)
    expected = reference.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS)
    kernels.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS)  # compiles, loads
    torch.cuda.current_stream().synchronize()
    kwargs = {}
    late = torch.cuda.Stream()
    if rank == 0:  # an event that completes only after a long kernel on another stream
        with torch.cuda.stream(late):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(SLEEP_CYCLES)
            kwargs["previous_event_before_epilogue"] = deep_ep.ElasticBuffer.capture()
    dist.barrier(group=group)
    began = time.monotonic()
    out = kernels.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS, **kwargs)
    torch.cuda.current_stream().synchronize()
    seconds = time.monotonic() - began
    check_dispatch(out, expected, False, False, "dispatch with a late before-epilogue event")
    late.synchronize()
    for buffer in (kernels, reference):
        buffer.destroy()
    return {"seconds": seconds}


def test_the_before_epilogue_event_holds_back_the_epilogue_only() -> None:
    seed = time.time_ns() % 1_000_000
    outcomes = LoopbackWorld(2).run(_late_event_rank, seed)
    slept, peer = outcomes[0]["seconds"], outcomes[1]["seconds"]
    # Rank 0's records went out before its event: rank 1 finished long before rank 0's epilogue ran
    assert slept > 0.05 and peer < slept / 4, (seed, outcomes)
    print(f"\nbefore-epilogue event: the rank with the late event took {slept * 1e3:.0f} ms, its peer "
          f"{peer * 1e3:.1f} ms (seed {seed})")  # fmt: skip


def test_every_buffer_of_a_process_shares_one_high_priority_communication_stream() -> None:
    from deep_ep.event import shared_comm_stream

    device = torch.device("cuda", torch.cuda.current_device())
    stream = shared_comm_stream(device)
    assert shared_comm_stream(device) is stream and shared_comm_stream(torch.device("cuda")) is stream
    assert stream.priority < 0, stream.priority  # above the default priority of compute streams

    def two_buffers(rank: int, group: dist.ProcessGroup) -> bool:
        first, second = _buffers(group)
        same = first.get_comm_stream() is second.get_comm_stream()
        first.destroy()
        second.destroy()
        return same

    assert LoopbackWorld(2).run(two_buffers) == [True, True]  # virtual ranks: one per rank


def _async_dispatch_rank(rank: int, group: dist.ProcessGroup, seed: int) -> tuple[int, list[int], int]:
    """An asynchronous dispatch; returns this rank's comm stream, its inputs' and recv_x's addresses."""
    kernels, reference = _buffers(group)
    x, topk_idx, weights, _ = _inputs(rank, group, seed)
    out = kernels.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_experts=NUM_EXPERTS,
                           async_with_compute_stream=True)  # fmt: skip
    out[-1].current_stream_wait()
    result = (kernels.get_comm_stream().cuda_stream, [t.data_ptr() for t in (x, topk_idx, weights)], out[0].data_ptr())
    for buffer in (kernels, reference):
        buffer.destroy()
    return result


@pytest.mark.parametrize("avoid", [False, True])
def test_avoid_record_stream_leaves_the_inputs_to_the_caller(avoid: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(os.environ, "EP_AVOID_RECORD_STREAM", "1" if avoid else "0")
    recorded: list[tuple[int, int]] = []  # (stream, tensor address), from every rank's thread
    original = torch.Tensor.record_stream

    def watched(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        recorded.append((stream.cuda_stream, tensor.data_ptr()))
        original(tensor, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", watched)
    for comm, inputs, recv_x in LoopbackWorld(2).run(_async_dispatch_rank, 7):
        assert [(comm, ptr) in recorded for ptr in inputs] == [not avoid] * 3, (avoid, inputs)
        assert (comm, recv_x) in recorded  # from the communication stream's pool: always recorded
