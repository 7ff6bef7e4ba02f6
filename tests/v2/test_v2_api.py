"""DeepEP V2's API surface (docs in ../shared/docs/v2-parity.md, items 1, 3, 4, 10 and 12): the
constructor's positional order, the module-level names, `get_theoretical_num_sms`'s parameters, V2's
limits, the empty per-expert list without CPU sync, and the handle's deterministic-mode fields.
One CPU rank (gloo) and 2 CPU virtual ranks for what needs a peer."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import deep_ep
from deep_ep.loopback import LoopbackWorld
from deep_ep.utils.routing import uniform_routing

# V2's `ElasticBuffer.__init__` parameters, in order (v2-parity.md item 1)
V2_CONSTRUCTOR = (
    "group", "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden", "num_topk", "use_fp8_dispatch",
    "deterministic", "allow_hybrid_mode", "allow_multiple_reduction", "prefer_overlap_with_compute", "sl_idx",
    "num_allocated_qps", "num_cpu_timeout_secs", "num_gpu_timeout_secs", "explicitly_destroy",
)  # fmt: skip
V2_NUM_SMS = ("num_experts", "num_topk", "num_scaleout_topk", "rdma_gbs", "nvlink_gbs", "sm_read_gbs", "sm_write_gbs")


def test_the_constructor_takes_v2s_arguments_in_v2s_order() -> None:
    parameters = list(inspect.signature(deep_ep.ElasticBuffer.__init__).parameters.values())[1:]
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert tuple(positional) == V2_CONSTRUCTOR
    assert [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY] == [
        "backend",
        "enable_rank_masking",
        "mask_ranks_on_timeout",
    ]


def test_a_positional_v2_call_binds_the_same_parameters(group: dist.ProcessGroup) -> None:
    # group, num_bytes, num_cpu_bytes, Tmax, hidden, top-k, fp8, deterministic, hybrid, multiple reduction,
    # overlap, sl_idx, qps, cpu timeout, gpu timeout, explicitly_destroy
    buffer = deep_ep.ElasticBuffer(group, None, 0, 24, 256, 4, False, True, False, False, False, 2, 9, 30, 20, True)
    assert (buffer.num_max_tokens_per_rank, buffer.hidden, buffer.num_topk) == (24, 256, 4)
    assert buffer.deterministic and not buffer.allow_hybrid_mode and not buffer.allow_multiple_reduction
    assert not buffer.prefer_overlap_with_compute and buffer.num_allocated_qps == 9 and buffer.explicitly_destroy
    buffer.destroy()


def test_module_level_names_are_v2s(group: dist.ProcessGroup) -> None:
    from deep_ep.event import EventHandle

    assert deep_ep.EventHandle is EventHandle and deep_ep.topk_idx_t is torch.int64
    assert deep_ep.get_physical_domain_size(group) == (1, 1)
    assert deep_ep.get_logical_domain_size(group) == (1, 1)
    assert deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, 1)


def test_get_theoretical_num_sms_takes_v2s_model_inputs(group: dist.ProcessGroup) -> None:
    parameters = list(inspect.signature(deep_ep.ElasticBuffer.get_theoretical_num_sms).parameters)[1:]
    assert tuple(parameters) == V2_NUM_SMS
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=1024, explicitly_destroy=True)
    plain = buffer.get_theoretical_num_sms(64, 8)
    assert buffer.get_theoretical_num_sms(64, 8, 0, 50.0, 450.0, sm_read_gbs=200, sm_write_gbs=50) == plain
    buffer.destroy()


@pytest.mark.parametrize(
    ("num_experts", "num_topk", "message"),
    [
        (64, 33, r"`topk_idx` must have <= 32 lanes \(DeepEP V2's limit\), got 33"),
        (4096, 2, r"`num_experts` must be <= 2048 and <= 256 per rank \(DeepEP V2's limits\), got 4096"),
        (512, 2, r"got 512 \(512 per rank over 1 ranks\)"),
    ],
)
def test_v2s_limits_are_checked_with_the_argument_named(
    group: dist.ProcessGroup, num_experts: int, num_topk: int, message: str
) -> None:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, explicitly_destroy=True)
    topk_idx = torch.arange(num_topk).repeat(4, 1)
    x = torch.randn((4, 128)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        buffer.dispatch(x, topk_idx=topk_idx, num_experts=num_experts)
    buffer.destroy()
    with pytest.raises(ValueError, match=r"`num_topk` must be in \[0, 32\] .* got 33"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, num_topk=33)


def _no_sync_rank(rank: int, group: dist.ProcessGroup) -> tuple:
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=128, num_topk=2, explicitly_destroy=True)
    topk_idx, _ = uniform_routing(12, 8, 2, generator=torch.Generator().manual_seed(rank + 7))
    x = torch.randn((12, 128)).to(torch.bfloat16)
    synced = buffer.dispatch(x, topk_idx=topk_idx, num_experts=8, do_cpu_sync=True)[3]
    fresh = buffer.dispatch(x, topk_idx=topk_idx, num_experts=8, do_cpu_sync=False)[3]
    result = (synced.num_recv_tokens_per_expert_list, fresh.num_recv_tokens_per_expert_list,
              fresh.cached_recv_src_metadata_before_sort, fresh.deterministic_sort(), buffer.get_physical_domain_size(),
              deep_ep.get_physical_domain_size(group))  # fmt: skip
    buffer.destroy()
    return result


def test_without_cpu_sync_the_per_expert_list_is_empty_and_the_handle_has_v2s_fields() -> None:
    for synced, fresh, before_sort, sorted_, physical, module_physical in LoopbackWorld(2, device="cpu").run(
        _no_sync_rank
    ):
        assert len(synced) == 4 and sum(synced) > 0 and fresh == []
        assert before_sort is None and sorted_ is None
        assert physical == module_physical == (1, 2)


def test_queue_pairs_follow_v2s_defaults(group: dist.ProcessGroup, tmp_path) -> None:
    from deep_ep import planner

    direct = deep_ep.ElasticBuffer(group, None, 0, 16, 256, 4, allow_hybrid_mode=False, backend="reference")
    assert direct.num_allocated_qps == 17 and direct.get_theoretical_num_qps(24) == 9
    hybrid = deep_ep.ElasticBuffer(group, None, 0, 16, 256, 4, backend="reference")
    assert hybrid.num_allocated_qps == planner.default_num_allocated_qps(True) in (65, 129)
    assert hybrid.get_theoretical_num_qps(3) == 3 * 16 + 1  # V2's hybrid rule, even inside one domain
    assert hybrid.get_theoretical_num_qps(24) == hybrid.num_allocated_qps  # 24 * 16 + 1, capped
    # A ConnectX of CA type MT4131 (fast RDMA atomics) needs fewer: V2 allocates 65
    for name, hca_type in (("mlx5_0", "MT4129"), ("mlx5_1", "MT4131")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "hca_type").write_text(hca_type + "\n")
    assert planner.default_num_allocated_qps(True, str(tmp_path)) == 65
    (tmp_path / "mlx5_1" / "hca_type").write_text("MT4129\n")
    assert planner.default_num_allocated_qps(True, str(tmp_path)) == 129
    assert planner.default_num_allocated_qps(False, str(tmp_path)) == 17


# V2's experimental methods (its `elastic.py`), parameter names in order
V2_EXPERIMENTAL = {
    "get_agrs_num_max_session_bytes": ("group", "shapes", "dtype"),
    "get_agrs_buffer_size_hint": ("group", "num_max_session_bytes"),
    "create_agrs_session": (),
    "destroy_agrs_session": (),
    "agrs_new_session": ("enabled",),
    "agrs_set_config": ("num_max_session_bytes", "num_max_all_gathers_per_session"),
    "agrs_get_inplace_tensor": ("shapes", "dtype"),
    "all_gather": ("t",),
    "get_pp_buffer_size_hint": ("num_max_tensor_bytes", "num_max_inflight_tensors"),
    "pp_set_config": ("num_max_tensor_bytes", "num_max_inflight_tensors"),
    "pp_send": ("t", "dst_rank_idx", "num_sms"),
    "pp_recv": ("t", "src_rank_idx", "num_sms"),
    "get_engram_storage_size_hint": ("num_entries", "hidden", "num_max_tokens_per_rank", "dtype"),
    "engram_write": ("storage", "sf"),
    "engram_fetch": ("indices", "num_qps", "use_tma_aligned_col_major_sf"),
}


def test_v2s_experimental_methods_take_v2s_parameters() -> None:
    for name, expected in V2_EXPERIMENTAL.items():
        parameters = [p for p in inspect.signature(getattr(deep_ep.ElasticBuffer, name)).parameters if p != "self"]
        assert tuple(parameters) == expected, (name, parameters)
