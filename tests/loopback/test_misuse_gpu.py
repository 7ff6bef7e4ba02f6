"""Misuse of `ElasticBuffer` on a GPU (issue 20 #6), with virtual ranks (`deep_ep.loopback`) where a
case needs peers: inside a real CUDA-graph capture what waits on the host is refused before any CUDA
call (the capture goes on, its replay is right), tensors on the wrong device (CPU tensors for a CUDA
buffer, CUDA tensors for a CPU buffer, another GPU's tensors), a current device other than the
buffer's (two GPUs), and a handle that outlived its collected kernels buffer. Every case checks the
message, that no input changed and that the buffer works afterwards. The CPU cases are in
`test_misuse_cpu.py`; the table is in docs/semantics.md ("Misuse"). Run on the GPU machine:
`python -m pytest -m gpu tests/loopback/test_misuse_gpu.py`.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from deep_ep.loopback import LoopbackWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

NUM_TOKENS, HIDDEN, NUM_TOPK, TMAX = 64, 2048, 8, 128


def _seed() -> int:
    return int(os.environ.get("EP_TEST_SEED", time.time_ns() % 1_000_000))


def _error_of(call: Callable[[], Any], error_type: type[BaseException]) -> str | None:
    """The text of the `error_type` that `call()` raises, or `None` when it returns."""
    try:
        call()
    except error_type as error:
        return str(error)
    return None


def _make(group: dist.ProcessGroup, backend: str, **kwargs: Any) -> Any:
    import deep_ep

    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=HIDDEN, num_topk=NUM_TOPK,
                                 backend=backend, **kwargs)  # fmt: skip


def _inputs(rank: int, group: dist.ProcessGroup, seed: int, device: str, num_bias: int = 0) -> tuple:
    from kernel_checks import make_inputs

    return make_inputs(rank, group.size(), NUM_TOKENS, HIDDEN, "bf16", 8 * group.size(), NUM_TOPK, "uniform", 0.1,
                       num_bias, seed, device)  # fmt: skip


def _saved(**values: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Clones of every tensor passed (handles: their tensors); call it with this rank's stream drained."""
    import deep_ep

    tensors: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, deep_ep.EPHandle):
            tensors.update({f"{name}.{k}": t for k, t in vars(value).items() if isinstance(t, torch.Tensor)})
    return {name: (tensor, tensor.clone()) for name, tensor in tensors.items()}


def _assert_unchanged(originals: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Compare with the clones (host reads: this rank's stream must hold nothing that waits for a peer)."""
    from deep_ep.host_reads import wait_for_stream

    wait_for_stream()
    for name, (tensor, copy) in originals.items():
        assert torch.equal(tensor, copy), f"`{name}` was modified"


# ---------------------------------------------------------------------------- CUDA-graph capture


def _capture_rank(rank: int, group: dist.ProcessGroup, seed: int) -> dict[str, str | None]:
    """Inside one capture: every call that would wait on the host raises (and records nothing), then
    a fresh no-sync dispatch, a cached dispatch and a combine are recorded; the replay must match the
    reference."""
    from kernel_checks import check_dispatch, equal

    from deep_ep.host_reads import wait_for_stream

    kbuf = _make(group, "kernels", explicitly_destroy=True)
    rbuf = _make(group, "reference", explicitly_destroy=True)
    x, topk_idx, weights, _ = _inputs(rank, group, seed, "cuda")
    x2 = _inputs(rank, group, seed + 1, "cuda")[0]
    args = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size())

    def recordable() -> tuple:
        fresh = kbuf.dispatch(x, **args, do_cpu_sync=False)
        cached = kbuf.dispatch(x2, handle=fresh[3])
        combined = kbuf.combine(fresh[0], fresh[3])
        return fresh, cached, combined

    # Every kernel loaded before the capture (a first load waits for the running kernels). A refused
    # call stops its kernels buffer on every rank (the peers may wait in it): each refusal gets its own
    eager = recordable()
    spares = [_make(group, "kernels", explicitly_destroy=True) for _ in range(4)]
    spare_handle = spares[2].dispatch(x, **args, do_cpu_sync=False)[3]
    ref = rbuf.dispatch(x, **args, do_cpu_sync=False)
    originals = _saved(x=x, x2=x2, topk_idx=topk_idx, topk_weights=weights, eager_handle=eager[0][3],
                       ref_recv_x=ref[0], ref_handle=ref[3])  # fmt: skip
    # Capture synchronizes the device: every rank has enqueued all it will before any begins
    wait_for_stream()
    dist.barrier(group=group)
    torch.cuda.current_stream().synchronize()
    graph = torch.cuda.CUDAGraph()
    refused: dict[str, str | None] = {}
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
        # Each refusal comes before any CUDA call of its own: the capture goes on
        refused["fresh dispatch, do_cpu_sync=None"] = _error_of(lambda: spares[0].dispatch(x, **args), ValueError)
        refused["fresh dispatch, do_cpu_sync=True"] = _error_of(
            lambda: spares[1].dispatch(x, **args, do_cpu_sync=True), ValueError
        )
        refused["cached dispatch, do_cpu_sync=True"] = _error_of(
            lambda: spares[2].dispatch(x2, handle=spare_handle, do_cpu_sync=True), ValueError
        )
        refused["barrier"] = _error_of(spares[3].barrier, ValueError)
        refused["reference dispatch"] = _error_of(lambda: rbuf.dispatch(x, **args, do_cpu_sync=False), ValueError)
        refused["reference combine"] = _error_of(lambda: rbuf.combine(ref[0], ref[3]), ValueError)
        captured = recordable()
    # Capturing allocates the graph's memory (a cudaMalloc can wait for the device): no replay before
    # every rank has captured
    dist.barrier(group=group)
    _assert_unchanged(originals)
    dist.barrier(group=group)  # the ranks replay together, none of them busy reading on the host

    graph.replay()
    wait_for_stream()
    check_dispatch(captured[0], ref, False, False, "replayed fresh dispatch")
    check_dispatch(captured[1], rbuf.dispatch(x2, handle=ref[3]), False, False, "replayed cached dispatch")
    equal(captured[2][0], rbuf.combine(ref[0], ref[3])[0], "replayed combine")

    # The buffer is still usable, also for what the capture refused
    assert kbuf.backend.dead_reason is None, kbuf.backend.dead_reason
    out = kbuf.dispatch(x, **args)
    ref_sync = rbuf.dispatch(x, **args)
    wait_for_stream()
    check_dispatch(out, ref_sync, False, False, "CPU-sync dispatch after the capture")
    kbuf.barrier()
    del graph
    for buffer in (kbuf, rbuf, *spares):
        buffer.destroy()
    return refused


def test_inside_capture_what_waits_on_the_host_is_refused_and_the_rest_replays():
    seed = _seed()
    world = LoopbackWorld(2, guard_bytes=64 << 10)
    outcomes = world.run(_capture_rank, seed)
    damaged = world.check_guards()
    world.close()
    for rank, refused in enumerate(outcomes):
        assert all(message is not None for message in refused.values()), (rank, refused)
        for key, how in (("do_cpu_sync=None", "the default without a cached `handle`"), ("do_cpu_sync=True", "given")):
            message = refused[f"fresh dispatch, {key}"]
            assert message.startswith("dispatch: `do_cpu_sync` must be False while a CUDA graph is being captured")
            assert f"got True ({how}); pass do_cpu_sync=False" in message, message
        assert (
            "`do_cpu_sync` must be None or False with a cached `handle`" in refused["cached dispatch, do_cpu_sync=True"]
        )
        assert refused["barrier"].startswith("barrier: the current stream must not be capturing a CUDA graph")
        for op in ("dispatch", "combine"):
            message = refused[f"reference {op}"]
            assert message.startswith(f"{op}: the buffer's `backend` must support CUDA-graph capture"), message
            assert "got backend='reference'" in message, message
    assert damaged == [], damaged
    print(f"\ncapture misuse, EP2, seed {seed}: rank 0: {outcomes[0]['fresh dispatch, do_cpu_sync=None']}")


# ---------------------------------------------------------------------------- devices


def _cpu_tensors_on_a_cuda_buffer_rank(rank: int, group: dist.ProcessGroup, seed: int) -> tuple[dict, str]:
    from deep_ep.host_reads import wait_for_stream

    kbuf = _make(group, "kernels", explicitly_destroy=True)
    x, topk_idx, weights, bias = _inputs(rank, group, seed, "cuda", num_bias=1)
    stats = torch.zeros(8, dtype=torch.int32, device="cuda")
    dispatch_args = dict(x=x, topk_idx=topk_idx, topk_weights=weights, cumulative_local_expert_recv_stats=stats,
                         num_experts=8 * group.size())  # fmt: skip
    recv_x, _, recv_weights, handle, _ = kbuf.dispatch(**dispatch_args)
    combine_args = dict(x=recv_x, handle=handle, topk_weights=recv_weights, bias=bias)
    wait_for_stream()  # the copies to the CPU below must find nothing that waits for the peer
    originals = _saved(**dispatch_args, **{f"combine_{k}": v for k, v in combine_args.items()})
    messages: dict[str, str | None] = {}
    for op, call_args, names in (
        ("dispatch", dispatch_args, ("x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats")),
        ("combine", combine_args, ("x", "topk_weights", "bias")),
    ):
        for name in names:
            bad = dict(call_args, **{name: call_args[name].cpu()})
            # A refused call stops its kernels buffer on every rank (the peers may wait in it)
            spare = _make(group, "kernels", explicitly_destroy=True)
            if op == "combine":
                spare_out = spare.dispatch(**dict(dispatch_args, cumulative_local_expert_recv_stats=None))
                bad = dict(bad, handle=spare_out[3], x=bad["x"] if name == "x" else spare_out[0])
            messages[f"{op} {name}"] = _error_of(lambda op=op, bad=bad, s=spare: getattr(s, op)(**bad), ValueError)
            wait_for_stream()
            spare.destroy()
    _assert_unchanged(originals)
    out = kbuf.dispatch(**dict(dispatch_args, cumulative_local_expert_recv_stats=None))
    kbuf.combine(out[0], out[3])
    wait_for_stream()
    kbuf.destroy()
    return messages, str(kbuf.device)


def test_cpu_tensors_given_to_a_cuda_buffer_are_refused():
    world = LoopbackWorld(2)
    outcomes = world.run(_cpu_tensors_on_a_cuda_buffer_rank, _seed())
    world.close()
    for messages, device in outcomes:
        for key, message in messages.items():
            op, name = key.split(" ")
            assert message == f"{op}: `{name}` must be on device {device} (the buffer's), got cpu", (key, message)


def _cuda_tensors_on_a_cpu_buffer_rank(rank: int, group: dist.ProcessGroup, seed: int) -> dict[str, str | None]:
    buffer = _make(group, "reference")
    x, topk_idx, weights, bias = _inputs(rank, group, seed, "cpu", num_bias=1)
    dispatch_args = dict(x=x, topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size())
    recv_x, _, recv_weights, handle, _ = buffer.dispatch(**dispatch_args)
    combine_args = dict(x=recv_x, handle=handle, topk_weights=recv_weights, bias=bias)
    originals = _saved(**dispatch_args, **{f"combine_{k}": v for k, v in combine_args.items()})
    messages: dict[str, str | None] = {}
    for op, call_args, names in (
        ("dispatch", dispatch_args, ("x", "topk_idx", "topk_weights")),
        ("combine", combine_args, ("x", "topk_weights", "bias")),
    ):
        for name in names:
            bad = dict(call_args, **{name: call_args[name].to("cuda")})
            messages[f"{op} {name}"] = _error_of(lambda op=op, bad=bad: getattr(buffer, op)(**bad), ValueError)
    _assert_unchanged(originals)
    out = buffer.dispatch(**dispatch_args)
    buffer.combine(out[0], out[3])
    return messages


def test_cuda_tensors_given_to_a_cpu_buffer_are_refused():
    outcomes = LoopbackWorld(2, device="cpu", timeout_s=60).run(_cuda_tensors_on_a_cpu_buffer_rank, _seed())
    device = torch.device("cuda", torch.cuda.current_device())
    for messages in outcomes:
        for key, message in messages.items():
            op, name = key.split(" ")
            assert message == f"{op}: `{name}` must be on device cpu (the buffer's), got {device}", (key, message)


def _other_device_rank(rank: int, group: dist.ProcessGroup, seed: int, other: int, foreign: list) -> dict:
    from deep_ep.host_reads import wait_for_stream

    kbuf = _make(group, "kernels", explicitly_destroy=True)
    x, topk_idx, weights, _ = _inputs(rank, group, seed, "cuda")
    args = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size())
    recv_x, _, _, handle, _ = kbuf.dispatch(x, **args)
    wait_for_stream()
    originals = _saved(x=x, topk_idx=topk_idx, topk_weights=weights, recv_x=recv_x, handle=handle)
    messages: dict[str, str | None] = {}
    with torch.cuda.device(other):
        messages["dispatch"] = _error_of(lambda: kbuf.dispatch(x, **args), ValueError)
        messages["combine"] = _error_of(lambda: kbuf.combine(recv_x, handle), ValueError)
        messages["barrier"] = _error_of(kbuf.barrier, ValueError)
    other_x, other_topk_idx = foreign[rank]
    messages["x"] = _error_of(lambda: kbuf.dispatch(other_x, **args), ValueError)
    messages["topk_idx"] = _error_of(lambda: kbuf.dispatch(x, **dict(args, topk_idx=other_topk_idx)), ValueError)
    _assert_unchanged(originals)
    out = kbuf.dispatch(x, **args)
    kbuf.combine(out[0], out[3])
    wait_for_stream()
    kbuf.destroy()
    return {"messages": messages, "device": str(kbuf.device)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_another_current_device_or_another_gpus_tensors_are_refused():
    world = LoopbackWorld(2)
    other = (world.device.index + 1) % torch.cuda.device_count()
    # Made here, before the ranks run: the other GPU's memory and context are ready when they start
    foreign = [
        (
            torch.zeros((NUM_TOKENS, HIDDEN), dtype=torch.bfloat16, device=f"cuda:{other}"),
            torch.zeros((NUM_TOKENS, NUM_TOPK), dtype=torch.int64, device=f"cuda:{other}"),
        )
        for _ in range(2)
    ]
    outcomes = world.run(_other_device_rank, _seed(), other, foreign)
    world.close()
    for outcome in outcomes:
        messages, device = outcome["messages"], outcome["device"]
        for op in ("dispatch", "combine", "barrier"):
            assert messages[op] == (
                f"{op}: the current CUDA device must be the buffer's ({device}), got cuda:{other}; call it inside "
                f"`with torch.cuda.device({world.device.index}):` (or `torch.cuda.set_device({world.device.index})`)"
            ), messages[op]
        for name in ("x", "topk_idx"):
            expected = f"dispatch: `{name}` must be on device {device} (the buffer's), got cuda:{other}"
            assert messages[name] == expected, messages[name]


# ---------------------------------------------------------------------------- a collected buffer


def _collected_buffer_rank(rank: int, group: dist.ProcessGroup, seed: int) -> list[str | None]:
    from kernel_checks import check_dispatch, equal

    from deep_ep.host_reads import wait_for_stream

    x, topk_idx, weights, _ = _inputs(rank, group, seed, "cuda")
    args = dict(topk_idx=topk_idx, topk_weights=weights, num_experts=8 * group.size())

    def dispatch_on_a_temporary_buffer() -> tuple:
        # Without `explicitly_destroy` the buffer's finalizer releases its windows when it is collected
        temporary = _make(group, "kernels")
        recv_x, _, _, handle, _ = temporary.dispatch(x, **args)
        temporary.combine(recv_x, handle)
        wait_for_stream()
        return recv_x, handle, weakref.ref(temporary), temporary.buffer_id

    recv_x, handle, temporary, buffer_id = dispatch_on_a_temporary_buffer()
    gc.collect()
    # The handle keeps neither its buffer nor its windows alive: no device pointer of it stays usable
    assert temporary() is None
    dist.barrier(group=group)
    kbuf = _make(group, "kernels", explicitly_destroy=True)
    rbuf = _make(group, "reference", explicitly_destroy=True)
    originals = _saved(x=x, topk_idx=topk_idx, topk_weights=weights, recv_x=recv_x, handle=handle)
    # A refused call stops its kernels buffer on every rank (the peers may wait in it): one each
    spares = [_make(group, "kernels", explicitly_destroy=True) for _ in range(2)]
    messages = [
        _error_of(lambda: spares[0].combine(recv_x, handle), ValueError),
        _error_of(lambda: spares[1].dispatch(x, handle=handle), ValueError),
    ]
    for spare in spares:
        spare.destroy()
    _assert_unchanged(originals)
    out, ref = kbuf.dispatch(x, **args), rbuf.dispatch(x, **args)
    wait_for_stream()
    check_dispatch(out, ref, False, False, "dispatch of the new buffer")
    combined = kbuf.combine(out[0], out[3])[0]
    wait_for_stream()
    equal(combined, rbuf.combine(ref[0], ref[3])[0], "combine of the new buffer")
    kbuf.destroy()
    rbuf.destroy()
    return [*messages, str(buffer_id)]


def test_a_handle_that_outlived_its_collected_kernels_buffer_is_refused():
    world = LoopbackWorld(2)
    outcomes = world.run(_collected_buffer_rank, _seed())
    world.close()
    for *messages, buffer_id in outcomes:
        for message in messages:
            assert message is not None and (
                f"buffer_id {buffer_id}, which was garbage collected (its handles died with it)" in message
            ), message
