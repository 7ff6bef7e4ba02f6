"""deep_ep.bench.calibrate: the fit of the planner's rates, the calibration document and `deep-ep calibrate`
(measuring needs GPUs; the fit and `--refit` run anywhere)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from deep_ep import planner
from deep_ep.bench import calibrate
from deep_ep.planner import smooth_max

P = 1 - math.comb(128, 8) / math.comb(256, 8)
TRUE = dict(nvlink_gbs=350.0, dispatch=(30.0, 3.0, 800.0, 40.0), combine=(25.0, 2.0, 2500.0, 20.0))
SMS = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 132)


def _points(noise: float = 0.0) -> list[dict]:
    """Graph times of the model itself (rates `TRUE`), as `measure_rank` records them."""
    points = []
    for op, record_bytes in (("dispatch", 7456), ("cached_dispatch", 7456), ("combine", 14336)):
        sm_gbs, knee_k, epilogue_gbs, fixed_us = TRUE["dispatch" if op != "combine" else "combine"]
        for i, tokens in enumerate((8192, 4096, 1024, 128)):
            logical, wire = tokens * record_bytes * 2 * P, tokens * record_bytes * P
            for j, m in enumerate(SMS):
                us = smooth_max(wire / (TRUE["nvlink_gbs"] * 1e3), logical / (m * sm_gbs * 1e3), knee_k)
                us += logical / (epilogue_gbs * 1e3) + fixed_us
                us *= 1 + noise * math.sin(7 * i + 3 * j)
                points.append(dict(op=op, num_tokens=tokens, num_sms=m, us=us, logical_bytes=logical,
                                   sm_bytes=logical, wire_bytes=wire))  # fmt: skip
    return points


def _document(points: list[dict]) -> dict:
    measurements = dict(probe=[dict(num_sms=8, gbs=150.0), dict(num_sms=132, gbs=TRUE["nvlink_gbs"])], points=points)
    settings = dict(tokens=[8192, 4096, 1024, 128], sms=list(SMS[:-1]), hidden=7168, num_topk=8, num_experts=256,
                    num_rotations=2, num_samples=5, seed=1)  # fmt: skip
    provenance = dict(
        date="2026-11-30T00:00:00+00:00", machine="2x test GPU (132 SMs)", command="test", commit="0" * 40
    )
    return calibrate.build_document(measurements, settings, provenance, num_ranks=2, num_device_sms=132)


def test_the_fit_recovers_the_rates_of_exact_model_times():
    for op in ("dispatch", "combine"):
        found = calibrate.fit_op([p for p in _points() if p["op"] == op], TRUE["nvlink_gbs"])
        sm_gbs, knee_k, epilogue_gbs, fixed_us = TRUE[op]
        assert found["sm_gbs"] == pytest.approx(sm_gbs, rel=2e-3)
        assert found["knee_k"] == knee_k
        assert found["epilogue_gbs"] == pytest.approx(epilogue_gbs, rel=1e-2)
        assert found["fixed_us"] == pytest.approx(fixed_us, rel=1e-2)
        assert found["rms_rel_error_bandwidth"] < 1e-3


def test_the_fit_of_noisy_times_predicts_them_within_a_few_percent():
    document = _document(_points(noise=0.02))
    assert all(abs(c["error"]) < 0.05 for c in document["checks"])
    assert {c["num_tokens"] for c in document["checks"]} == {8192, 4096}
    assert set(document["picks"]) == {"8192", "4096", "1024", "128"}


def test_fit_epilogue_keeps_the_rate_positive_and_the_fixed_cost_non_negative():
    assert calibrate.fit_epilogue({1: (1e6, 11.0), 2: (2e6, 12.0)}) == pytest.approx((1000.0, 10.0))
    rate, fixed = calibrate.fit_epilogue({1: (1e6, 1.0), 2: (3e6, 9.0)})  # the line crosses zero below 1e6
    assert fixed == 0.0 and rate == pytest.approx(1 / (28e6 / 10e12 * 1e3))  # slope sum(xy) / sum(xx)
    assert calibrate.fit_epilogue({1: (1e6, 12.0), 2: (2e6, 10.0)}) == (None, 11.0)
    with pytest.raises(ValueError, match="two or more SM counts"):
        calibrate.fit_op([dict(p, num_sms=24) for p in _points() if p["op"] == "dispatch"], 350.0)


def test_the_document_loads_as_hardware_and_merges_ranks():
    document = _document(_points())
    hardware = planner.hardware_from_document(json.loads(json.dumps(document)))
    assert hardware.nvlink_gbs == TRUE["nvlink_gbs"] and hardware.num_device_sms == 132
    # Concise provenance: machine, day, commit; the commands (and their machine paths) stay in the document
    assert hardware.source.startswith("calibrated: 2x test GPU") and "commit" in hardware.source
    assert "`test`" not in hardware.source
    assert hardware.rdma_gbs == calibrate.NOMINAL_RDMA_GBS
    slow = [dict(p, us=2 * p["us"]) for p in _points()]
    merged = calibrate.merge_ranks([dict(probe=[dict(num_sms=8, gbs=100.0)], points=_points()),
                                    dict(probe=[dict(num_sms=8, gbs=200.0)], points=slow)])  # fmt: skip
    assert merged["probe"] == [dict(num_sms=8, gbs=150.0)]
    assert [p["us"] for p in merged["points"]] == [p["us"] for p in slow]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deep_ep.cli", "calibrate", *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_refit_rewrites_a_document_from_its_measurements(tmp_path):
    source, out = tmp_path / "measured.json", tmp_path / "refit.json"
    document = _document(_points(noise=0.01))
    document["hardware"]["dispatch_sm_gbs"] = 1.0  # a stale rate the refit must replace
    source.write_text(json.dumps(document))
    result = _cli("--refit", str(source), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "per SM" in result.stdout and str(out) in result.stdout
    refit = json.loads(out.read_text())
    assert refit["hardware"]["dispatch_sm_gbs"] == pytest.approx(TRUE["dispatch"][0], rel=0.05)
    assert refit["provenance"]["machine"] == "2x test GPU (132 SMs)" and refit["provenance"]["refit"]["command"]
    assert planner.load_hardware(out).dispatch_sm_gbs == refit["hardware"]["dispatch_sm_gbs"]


def test_calibrate_without_gpus_fails_with_a_clear_message(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("GPUs present: the measurement would run")
    result = _cli("--out", str(tmp_path / "hopper.json"))
    assert result.returncode == 1 and "needs at least 2 CUDA GPUs" in result.stderr
    assert not (tmp_path / "hopper.json").exists()
