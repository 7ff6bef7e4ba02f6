"""The public facade on one rank: exports, attributes, size hints, backend choice, events, handles."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.backends.base import ScaleKind, worst_case_num_expanded_tokens
from deep_ep.backends.reference.backend import ReferenceBackend
from deep_ep.buffer import select_backend_class
from deep_ep.event import EventHandle, EventOverlap
from deep_ep.records import BUFFER_ALIGNMENT_BYTES
from deep_ep.utils.routing import uniform_routing


def test_lazy_exports() -> None:
    assert deep_ep.topk_idx_t is torch.int64
    assert deep_ep.ElasticBuffer.__module__ == "deep_ep.buffer"
    assert deep_ep.EPHandle.__module__ == "deep_ep.handle"
    assert deep_ep.EventOverlap is EventOverlap
    assert issubclass(deep_ep.EPTimeoutError, RuntimeError)


def test_public_reference_module_names_the_reference_backend() -> None:
    import deep_ep.reference

    assert deep_ep.reference.ReferenceBackend is ReferenceBackend
    assert deep_ep.reference.worst_case_num_expanded_tokens is worst_case_num_expanded_tokens
    assert all(getattr(deep_ep.reference, name) is not None for name in deep_ep.reference.__all__)


def test_attributes_and_hints(group: dist.ProcessGroup) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=7168, num_topk=8, backend="auto")
    assert isinstance(buffer.backend, ReferenceBackend) and buffer.device == torch.device("cpu")
    assert (buffer.rank_idx, buffer.num_ranks) == (0, 1)
    assert buffer.get_logical_domain_size() == (1, 1) and buffer.get_physical_domain_size() == (1, 1)
    domains = (buffer.num_scaleout_ranks, buffer.num_scaleup_ranks, buffer.num_rdma_ranks, buffer.num_nvlink_ranks)
    assert domains == (1, 1, 1, 1)
    assert buffer.num_bytes == deep_ep.ElasticBuffer.get_buffer_size_hint(group, 128, 7168, 8)
    assert buffer.num_bytes % BUFFER_ALIGNMENT_BYTES == 0 and buffer.num_bytes >= 128 * 7168 * 2
    assert buffer.get_comm_stream() is None
    num_sms = buffer.get_theoretical_num_sms(256, 8)
    assert num_sms > 0 and buffer.get_theoretical_num_qps(num_sms) == min(num_sms * 16 + 1, buffer.num_allocated_qps)
    small = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 128, 7168, 8, use_fp8_dispatch=True)
    large = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 128, 7168, 8, allow_multiple_reduction=False)
    assert small <= buffer.num_bytes <= large and small % BUFFER_ALIGNMENT_BYTES == 0


def test_backend_choice(group: dist.ProcessGroup) -> None:
    assert select_backend_class(group, "auto") is ReferenceBackend
    assert select_backend_class(group, "reference") is ReferenceBackend
    with pytest.raises(ValueError, match="`backend`"):
        select_backend_class(group, "nvshmem")


def test_events_on_cpu() -> None:
    event = deep_ep.ElasticBuffer.capture()
    assert isinstance(event, EventHandle) and event.query()
    event.current_stream_wait()
    event.synchronize()
    overlap = EventOverlap(EventHandle(use_cuda=False), extra_tensors=(torch.ones(1),))
    calls: list[int] = []
    overlap.register_hook_after_wait(lambda: calls.append(len(calls)))
    with pytest.raises(RuntimeError, match="already registered"):
        overlap.register_hook_after_wait(lambda: None)
    overlap.current_stream_wait()
    overlap.current_stream_wait()
    assert calls == [0]
    with overlap(release_handle=True):
        pass
    assert overlap.event is None and overlap.extra_tensors is None
    with pytest.raises(RuntimeError, match="released"):
        overlap.current_stream_wait()
    with overlap:  # a released event makes the context manager a no-op
        pass


def test_single_rank_dispatch_and_handle(group: dist.ProcessGroup) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=128, backend="reference")
    topk_idx, topk_weights = uniform_routing(10, 4, 2, masked_ratio=0.25, generator=7)
    x = torch.randn((10, 128)).to(torch.bfloat16)
    recv_x, recv_topk_idx, recv_weights, handle, event = buffer.dispatch(
        x, topk_idx, topk_weights, num_experts=4, do_cpu_sync=False
    )
    routed = (topk_idx >= 0).any(dim=1)
    num_recv = int(routed.sum())
    assert recv_x.shape == (16, 128) and handle.num_recv_tokens == 16 and handle.num_recv_tokens_per_expert_list == []
    assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == num_recv
    assert torch.equal(recv_x[:num_recv], x[routed]) and torch.equal(recv_topk_idx[:num_recv], topk_idx[routed])
    assert handle.num_expanded_tokens == worst_case_num_expanded_tokens(1, 16, 2, 4, 1) == 32
    assert handle.scale_kind == ScaleKind.NONE and handle.num_tokens == 10 and not handle.do_cpu_sync
    assert handle.token_metadata_at_forward is None and handle.channel_linked_list is None
    assert "EPHandle(" in repr(handle) and isinstance(event, EventOverlap)
    combined, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights)
    assert torch.equal(combined[routed], x[routed]) and not combined[~routed].any()
    assert torch.equal(combined_weights, topk_weights.masked_fill(topk_idx < 0, 0))


def test_num_max_tokens_per_rank_errors_state_one_rule(group: dist.ProcessGroup) -> None:
    """Negative is never allowed (>= 0); 0 (no default) only with `num_bytes`, and the text says so."""
    with pytest.raises(ValueError, match=r"`num_max_tokens_per_rank` must be >= 0, got -1"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=-1, hidden=128)
    with pytest.raises(ValueError, match=r"must be >= 1 \(they size the buffer; 0, no default, needs `num_bytes`\)"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=0, hidden=128)
    assert deep_ep.ElasticBuffer(group, num_bytes=2 << 20, num_max_tokens_per_rank=0).num_max_tokens_per_rank == 0
