"""Misuse of `ElasticBuffer` on CPU (issue 20 #6): each case raises a clear exception naming the problem
before anything runs, leaves every input as it was, and leaves the buffer usable.

Foreign handles (another buffer, process group, `LoopbackWorld` or virtual rank; a destroyed or collected
buffer) on a one-rank gloo group and on virtual CPU ranks; the capture rules with the capture state
patched (the GPU file, `test_misuse_gpu.py`, captures for real); the current-device rule of a CUDA
buffer through its helper; tensors on another device. The table is in docs/semantics.md ("Misuse").
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep import validation
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.routing import uniform_routing

E, K, H, T, TMAX = 8, 2, 256, 6, 16


def make(group: dist.ProcessGroup, **kwargs: Any) -> deep_ep.ElasticBuffer:
    return deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=TMAX, hidden=H, num_topk=K, backend="reference",
                                 **kwargs)  # fmt: skip


def make_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    topk_idx, topk_weights = uniform_routing(T, E, K, generator=gen)
    x = torch.randn((T, H), generator=gen).to(torch.bfloat16)
    return {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights, "num_experts": E}


def message_of(error: type[Exception], call: Callable[[], Any]) -> str:
    with pytest.raises(error) as info:
        call()
    return str(info.value)


def saved(**values: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Clones of every tensor passed (handles: their tensors), to show afterwards that none changed."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, deep_ep.EPHandle):
            for field, tensor in vars(value).items():
                if isinstance(tensor, torch.Tensor):
                    tensors[f"{name}.{field}"] = tensor
    return {name: (tensor, tensor.clone()) for name, tensor in tensors.items()}


def assert_unchanged(originals: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for name, (tensor, copy) in originals.items():
        assert torch.equal(tensor, copy), f"`{name}` was modified"


def round_trip(buffer: deep_ep.ElasticBuffer, inputs: dict[str, Any]) -> None:
    """A correct dispatch and combine of `buffer` (collective): every token comes back once per holder rank."""
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    combined = buffer.combine(recv_x, handle)[0]
    num_local_experts = E // buffer.num_ranks
    ranks = torch.where(inputs["topk_idx"] >= 0, inputs["topk_idx"] // num_local_experts, -1)
    holders = torch.tensor([len(set(row) - {-1}) for row in ranks.tolist()], dtype=torch.float32)
    # Sums of at most a few BF16 copies are exact in FP32: one rounding gives these bits
    assert torch.equal(combined, (inputs["x"].float() * holders[:, None]).to(torch.bfloat16))


# ---------------------------------------------------------------------------- foreign handles


def test_a_handle_of_another_buffer_of_the_same_group(group: dist.ProcessGroup) -> None:
    buffer, other = make(group), make(group)
    inputs = make_inputs(1)
    recv_x, _, _, handle, _ = other.dispatch(**inputs)
    originals = saved(recv_x=recv_x, handle=handle, **inputs)
    for call in (lambda: buffer.combine(recv_x, handle), lambda: buffer.dispatch(inputs["x"], handle=handle)):
        message = message_of(ValueError, call)
        assert f"`handle` must come from a dispatch of this buffer (buffer_id {buffer.buffer_id})" in message
        assert f"got one from another buffer of this process group, buffer_id {other.buffer_id};" in message
    assert_unchanged(originals)
    round_trip(buffer, inputs)
    round_trip(other, inputs)


def test_a_handle_of_another_process_group(group: dist.ProcessGroup) -> None:
    other_group = dist.new_group([0], backend="gloo")
    buffer, other = make(group), make(other_group)
    inputs = make_inputs(2)
    recv_x, _, _, handle, _ = other.dispatch(**inputs)
    originals = saved(recv_x=recv_x, handle=handle, **inputs)
    message = message_of(ValueError, lambda: buffer.combine(recv_x, handle))
    assert f"got one from a buffer of another process group (rank 0 of 1), buffer_id {other.buffer_id};" in message
    message = message_of(ValueError, lambda: buffer.dispatch(inputs["x"], handle=handle))
    assert "a buffer of another process group" in message
    assert_unchanged(originals)
    round_trip(buffer, inputs)


def _dispatch_rank(rank: int, group: dist.ProcessGroup) -> tuple:
    """A buffer (returned, so that it stays alive), its dispatch and the inputs."""
    buffer = make(group)
    inputs = make_inputs(10 + rank)
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    return buffer, recv_x, handle, inputs


def _foreign_handle_rank(rank: int, group: dist.ProcessGroup, foreign: list) -> list[str]:
    """Pass this rank the handle of `foreign[rank]` (made elsewhere): both uses raise, nothing changes."""
    buffer = make(group)
    _, recv_x, handle, _ = foreign[rank]
    inputs = make_inputs(20 + rank)
    originals = saved(recv_x=recv_x, handle=handle, **inputs)
    messages = [
        message_of(ValueError, lambda: buffer.combine(recv_x, handle)),
        message_of(ValueError, lambda: buffer.dispatch(inputs["x"], handle=handle)),
    ]
    assert_unchanged(originals)
    round_trip(buffer, inputs)
    return messages


def test_a_handle_of_another_loopback_world() -> None:
    made = LoopbackWorld(2, device="cpu", timeout_s=60).run(_dispatch_rank)
    messages = LoopbackWorld(2, device="cpu", timeout_s=60).run(_foreign_handle_rank, made)
    for rank, (buffer, *_) in enumerate(made):
        for message in messages[rank]:
            assert (
                f"got one from a buffer of another LoopbackWorld (virtual rank {rank} of 2), "
                f"buffer_id {buffer.buffer_id};" in message
            ), message


def test_a_handle_between_a_loopback_world_and_a_process_group(group: dist.ProcessGroup) -> None:
    # A handle of the process group's buffer on virtual ranks
    buffer = make(group)
    inputs = make_inputs(3)
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    messages = LoopbackWorld(1, device="cpu", timeout_s=60).run(
        _foreign_handle_rank, [(buffer, recv_x, handle, inputs)]
    )
    for message in messages[0]:
        assert "a buffer of a torch.distributed process group (rank 0 of 1), not of this LoopbackWorld" in message
    # A handle of a virtual rank's buffer on the process group
    world_buffer, world_x, world_handle, _ = LoopbackWorld(1, device="cpu", timeout_s=60).run(_dispatch_rank)[0]
    originals = saved(recv_x=world_x, handle=world_handle)
    message = message_of(ValueError, lambda: buffer.combine(world_x, world_handle))
    assert (
        f"a buffer of a LoopbackWorld (virtual rank 0 of 1), not of this process group, buffer_id "
        f"{world_buffer.buffer_id};" in message
    )
    assert_unchanged(originals)
    round_trip(buffer, inputs)


def _swap_handles_rank(rank: int, group: dist.ProcessGroup, shared: list) -> tuple[list[str], int]:
    """Each rank passes its peer's handle (another virtual rank of the same world), then its own."""
    buffer = make(group)
    inputs = make_inputs(30 + rank)
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    shared[rank] = (recv_x, handle)
    dist.barrier(group=group)
    peer_x, peer_handle = shared[1 - rank]
    originals = saved(recv_x=recv_x, peer_x=peer_x, handle=handle, peer_handle=peer_handle, **inputs)
    # Validation never communicates: a rank that raises leaves its peer nothing to wait for
    messages = [
        message_of(ValueError, lambda: buffer.combine(peer_x, peer_handle)),
        message_of(ValueError, lambda: buffer.dispatch(inputs["x"], handle=peer_handle)),
    ]
    assert_unchanged(originals)
    buffer.combine(recv_x, handle)  # its own handle still works
    round_trip(buffer, inputs)
    return messages, buffer.buffer_id


def test_a_handle_of_another_virtual_rank_of_the_same_world() -> None:
    results = LoopbackWorld(2, device="cpu", timeout_s=60).run(_swap_handles_rank, [None, None])
    for rank, (messages, _) in enumerate(results):
        peer, peer_id = 1 - rank, results[1 - rank][1]
        for message in messages:
            assert (
                f"got one from the buffer of another rank of this LoopbackWorld (virtual rank {peer} of 2; this "
                f"buffer is rank {rank}), buffer_id {peer_id};" in message
            ), message


def test_a_handle_whose_buffer_was_destroyed(group: dist.ProcessGroup) -> None:
    old = make(group, explicitly_destroy=True)
    inputs = make_inputs(4)
    recv_x, _, _, handle, _ = old.dispatch(**inputs)
    old.destroy()
    originals = saved(recv_x=recv_x, handle=handle, **inputs)
    # With its own buffer
    for call in (lambda: old.combine(recv_x, handle), lambda: old.dispatch(inputs["x"], handle=handle)):
        message = message_of(ValueError, call)
        assert "the buffer must be alive, got a destroyed buffer" in message and "its handles died with it" in message
    # With a new buffer of the same group
    new = make(group)
    for call in (lambda: new.combine(recv_x, handle), lambda: new.dispatch(inputs["x"], handle=handle)):
        message = message_of(ValueError, call)
        assert (
            f"another buffer of this process group, buffer_id {old.buffer_id}, which was destroyed (its handles "
            "died with it)" in message
        ), message
    assert_unchanged(originals)
    round_trip(new, inputs)


@pytest.mark.parametrize("explicitly_destroy", [False, True])
def test_a_handle_that_outlived_its_collected_buffer(group: dist.ProcessGroup, explicitly_destroy: bool) -> None:
    inputs = make_inputs(5)

    def dispatch_on_a_temporary_buffer() -> tuple:
        temporary = make(group, explicitly_destroy=explicitly_destroy)
        recv_x, _, _, handle, _ = temporary.dispatch(**inputs)
        return recv_x, handle, weakref.ref(temporary), temporary.buffer_id

    recv_x, handle, temporary, buffer_id = dispatch_on_a_temporary_buffer()
    gc.collect()
    # The handle keeps neither its buffer nor the buffer's memory alive, and so reaches no live window
    assert temporary() is None
    originals = saved(recv_x=recv_x, handle=handle, **inputs)
    new = make(group)
    for call in (lambda: new.combine(recv_x, handle), lambda: new.dispatch(inputs["x"], handle=handle)):
        message = message_of(ValueError, call)
        assert f"buffer_id {buffer_id}, which was garbage collected (its handles died with it)" in message, message
    assert_unchanged(originals)
    round_trip(new, inputs)


# ---------------------------------------------------------------------------- CUDA-graph capture


@pytest.fixture
def capturing(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Make the checks see this thread's stream capturing a CUDA graph (or not)."""

    def set_capturing(active: bool) -> None:
        monkeypatch.setattr(validation, "graph_capture_active", lambda: active)

    return set_capturing


def test_inside_capture_a_backend_that_waits_on_the_host_is_refused(
    group: dist.ProcessGroup, capturing: Callable[[bool], None]
) -> None:
    buffer = make(group)
    inputs = make_inputs(6)
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    originals = saved(recv_x=recv_x, handle=handle, **inputs)
    capturing(True)
    for call in (
        lambda: buffer.dispatch(**inputs, do_cpu_sync=False),
        lambda: buffer.dispatch(inputs["x"], handle=handle),
        lambda: buffer.combine(recv_x, handle),
    ):
        message = message_of(ValueError, call)
        assert "`backend` must support CUDA-graph capture while a graph is being captured, got backend='reference'" in (
            message
        )
        assert "capture a buffer created with backend='kernels'" in message
    message = message_of(ValueError, buffer.barrier)
    assert message.startswith("barrier: the current stream must not be capturing a CUDA graph"), message
    capturing(False)
    assert_unchanged(originals)
    round_trip(buffer, inputs)
    buffer.barrier()


def test_inside_capture_dispatch_must_not_sync_with_the_cpu(
    group: dist.ProcessGroup, capturing: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    buffer = make(group)
    # As a backend that can be captured: the CPU-sync rule is the facade's, the same for every backend
    monkeypatch.setattr(buffer, "_ctx", dataclasses.replace(buffer._ctx, supports_graph_capture=True))
    inputs = make_inputs(7)
    stats = torch.zeros(E, dtype=torch.int32)
    recv_x, _, _, handle, _ = buffer.dispatch(**inputs)
    originals = saved(recv_x=recv_x, handle=handle, stats=stats, **inputs)
    capturing(True)
    for given, how in ((None, "the default without a cached `handle`"), (True, "given")):
        message = message_of(
            ValueError,
            lambda given=given: buffer.dispatch(**inputs, cumulative_local_expert_recv_stats=stats, do_cpu_sync=given),
        )
        assert message == (
            "dispatch: `do_cpu_sync` must be False while a CUDA graph is being captured (a CPU sync waits on the "
            f"host for counts that only a replay produces), got True ({how}); pass do_cpu_sync=False (worst-case "
            "shapes, the real counts in the handle's tensors) or a cached `handle`"
        )
    message = message_of(ValueError, lambda: buffer.dispatch(inputs["x"], handle=handle, do_cpu_sync=True))
    assert "`do_cpu_sync` must be None or False with a cached `handle`" in message
    assert_unchanged(originals)
    # What a graph can record passes the checks (here the reference backend then simply runs on CPU)
    fresh = buffer.dispatch(**inputs, do_cpu_sync=False)
    assert fresh[3].num_recv_tokens == TMAX  # worst case: N * Tmax rows
    buffer.dispatch(inputs["x"], handle=handle)
    buffer.combine(recv_x, handle)
    capturing(False)
    round_trip(buffer, inputs)


# ---------------------------------------------------------------------------- devices


def test_a_current_cuda_device_other_than_the_buffers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # One GPU (or none) cannot make the current device differ: the GPU file tests it on two
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for op in ("dispatch", "combine", "barrier"):
        message = message_of(ValueError, lambda op=op: validation.check_current_device(op, torch.device("cuda", 0)))
        assert message == (
            f"{op}: the current CUDA device must be the buffer's (cuda:0), got cuda:1; call it inside "
            "`with torch.cuda.device(0):` (or `torch.cuda.set_device(0)`)"
        )
    validation.check_current_device("dispatch", torch.device("cuda", 1))
    validation.check_current_device("dispatch", torch.device("cpu"))  # a CPU buffer has no current device


@pytest.mark.parametrize(
    "op,name", [("dispatch", "x"), ("dispatch", "topk_idx"), ("dispatch", "topk_weights"),
                ("dispatch", "cumulative_local_expert_recv_stats"), ("combine", "x"), ("combine", "topk_weights"),
                ("combine", "bias")],
)  # fmt: skip
def test_a_tensor_on_another_device_is_refused(group: dist.ProcessGroup, op: str, name: str) -> None:
    # `meta` stands for any device other than the buffer's (the GPU file passes CPU and CUDA tensors)
    buffer = make(group)
    inputs = make_inputs(8)
    inputs["cumulative_local_expert_recv_stats"] = torch.zeros(E, dtype=torch.int32)
    recv_x, _, recv_weights, handle, _ = buffer.dispatch(**inputs)
    combine_args = {"x": recv_x, "handle": handle, "topk_weights": recv_weights, "bias": torch.ones_like(inputs["x"])}
    args = inputs if op == "dispatch" else combine_args
    originals = saved(**args)
    bad = dict(args, **{name: args[name].to("meta")})
    message = message_of(ValueError, lambda: getattr(buffer, op)(**bad))
    assert message == f"{op}: `{name}` must be on device cpu (the buffer's), got meta"
    assert_unchanged(originals)
    round_trip(buffer, make_inputs(9))
