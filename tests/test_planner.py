"""deep_ep.planner (the analytic SM/QP/buffer model) and `deep-ep plan`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from deep_ep import planner
from deep_ep.planner import HOPPER, MoEShape, expected_hit_groups, plan

DSV3 = MoEShape(num_tokens=8192, hidden=7168, num_topk=8, num_experts=256, fp8_dispatch=True)


def test_expected_hit_groups_matches_hand_computed_values():
    # One group: always hit. Groups of one expert each: exactly top-k of them are hit.
    assert expected_hit_groups(256, 8, 1) == pytest.approx(1.0)
    assert expected_hit_groups(256, 8, 256) == pytest.approx(8.0)
    # 2 groups of 128: a group is missed only if all 8 experts fall in the other one
    miss = math.prod((128 - i) / (256 - i) for i in range(8))
    assert miss == pytest.approx(0.0034899, rel=1e-4)
    assert expected_hit_groups(256, 8, 2) == pytest.approx(2 * (1 - miss))


def test_two_ranks_one_domain_is_nvlink_bound_with_hand_computed_time():
    result = plan(DSV3, 2, 2)
    p = expected_hit_groups(256, 8, 2) / 2
    assert result.rdma_records_per_token == 0 and result.num_qps == 0
    assert result.nvlink_records_per_token == pytest.approx(p)
    assert result.bottleneck == "nvlink"
    # Combine: 8192 BF16 rows of 14336 bytes, a fraction p crossing one NVLink direction
    link_us = 8192 * 14336 * p / (HOPPER.nvlink_gbs * 1e3)
    assert result.predicted_combine_us == pytest.approx(link_us + HOPPER.fixed_us)
    # The SMs keep up: stores of (NVLink + own) records at the per-SM rate within the link time
    needed = 8192 * 14336 * 2 * p / (link_us * HOPPER.sm_write_gbs * 1e3)
    assert result.num_sms == 2 * math.ceil(needed / 2)
    assert 8 <= result.num_sms <= 24


def test_more_tokens_never_predict_less_time_nor_fewer_buffer_bytes():
    previous = None
    for num_tokens in (1, 16, 128, 1024, 4096, 8192, 16384):
        shape = MoEShape(num_tokens, 7168, 8, 256)
        current = plan(shape, 64, 8, "hybrid")
        if previous is not None:
            assert current.predicted_dispatch_us >= previous.predicted_dispatch_us
            assert current.predicted_combine_us >= previous.predicted_combine_us
            assert current.dispatch_buffer_bytes >= previous.dispatch_buffer_bytes
        previous = current


def test_faster_links_never_predict_more_time():
    slow = planner.Hardware(200.0, 25.0, HOPPER.sm_read_gbs, HOPPER.sm_write_gbs, 132, HOPPER.fixed_us, "test")
    for ranks, per_node in ((2, 2), (8, 8), (16, 8), (256, 8)):
        for mode in ("direct", "hybrid"):
            assert (
                plan(DSV3, ranks, per_node, mode).predicted_dispatch_us
                <= plan(DSV3, ranks, per_node, mode, slow).predicted_dispatch_us
            )


@pytest.mark.parametrize("num_ranks", [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])
def test_every_ep_size_up_to_2048_gets_a_valid_plan(num_ranks):
    per_node = min(8, num_ranks)
    shape = MoEShape(4096, 7168, 8, max(256, num_ranks))
    for mode in ("direct", "hybrid"):
        result = plan(shape, num_ranks, per_node, mode)
        assert 2 <= result.num_sms <= HOPPER.num_device_sms and result.num_sms % 2 == 0
        assert result.predicted_dispatch_us > HOPPER.fixed_us
        assert result.dispatch_buffer_bytes % (2 << 20) == 0
        assert result.bottleneck in ("nvlink", "rdma", "sm")
        assert (result.num_qps == 0) == (num_ranks == per_node)


def test_hybrid_sends_fewer_rdma_records_than_direct_across_domains():
    direct, hybrid = plan(DSV3, 64, 8, "direct"), plan(DSV3, 64, 8, "hybrid")
    assert hybrid.rdma_records_per_token < direct.rdma_records_per_token
    assert hybrid.nvlink_records_per_token > direct.nvlink_records_per_token
    assert hybrid.predicted_dispatch_us < direct.predicted_dispatch_us
    assert direct.bottleneck == hybrid.bottleneck == "rdma"
    # One domain: nothing to forward, the modes coincide
    assert plan(DSV3, 8, 8, "direct") == plan(DSV3, 8, 8, "hybrid")


def test_no_overlap_preference_uses_at_least_64_sms():
    assert plan(DSV3, 2, 2, prefer_overlap_with_compute=False).num_sms >= 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_ranks=6, num_ranks_per_domain=4), "multiple of `ranks_per_node`"),
        (dict(num_ranks=4096, num_ranks_per_domain=8), r"\[1, 2048\]"),
        (dict(num_ranks=3, num_ranks_per_domain=3), "multiple of `ranks`"),
    ],
)
def test_impossible_inputs_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(DSV3, **kwargs)
    with pytest.raises(ValueError, match="topk"):
        plan(MoEShape(1, 128, 300, 256), 2, 2)
    with pytest.raises(ValueError, match="mode"):
        plan(DSV3, 2, 2, "ring")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deep_ep.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_plan_command_prints_both_modes_and_json():
    result = _cli("--ranks", "64", "--ranks-per-node", "8", "--hidden", "7168", "--topk", "8", "--experts", "256",
                  "--tokens", "8192", "--fp8")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "direct" in result.stdout and "hybrid" in result.stdout and "bottleneck" in result.stdout
    document = json.loads(_cli("--ranks", "16", "--fp8", "--json").stdout)
    assert [p["mode"] for p in document["plans"]] == ["direct", "hybrid"]
    assert all(p["num_sms"] > 0 for p in document["plans"])
    assert document["hardware"]["source"]


def test_plan_command_rejects_impossible_shapes():
    result = _cli("--ranks", "6", "--ranks-per-node", "4")
    assert result.returncode == 1 and "ranks_per_node" in result.stderr
    result = _cli("--ranks", "64", "--experts", "100")
    assert result.returncode == 1 and "experts" in result.stderr
