"""The soak (`soak.py`) on CPU: its short run on CPU virtual ranks (reference against reference),
its leak detector and failure exits. No GPU or nvcc is needed."""

from __future__ import annotations

import json

import leaks
import pytest
import soak

MIB = 1 << 20

# The short run: 2 ranks, small shapes so that 200 iterations take seconds on two slow cores
_SHORT = ["--device", "cpu", "--ranks", "2", "--iterations", "200", "--warmup", "50", "--max-tokens", "32",
          "--max-local-experts", "8", "--check-every", "5", "--seed", "7"]  # fmt: skip


# ---------------------------------------------------------------------------- the soak


def test_the_soak_runs_on_cpu_virtual_ranks_and_passes(tmp_path, capsys):
    path = tmp_path / "soak.json"
    # The host allocator's arenas move RSS by tens of MiB on CPU with no leak; a leak is tested below
    assert soak.main([*_SHORT, "--rss-tolerance-mib", "256", "--json", str(path)]) == 0
    assert "soak PASSED" in capsys.readouterr().out
    result = json.loads(path.read_text())
    assert result["passed"] and result["leaks"] == [] and result["error"] is None
    assert {"commit", "hardware", "date", "command", "torch"} <= set(result)
    assert result["command"].startswith("python3 tests/loopback/soak.py --device cpu")
    samples = result["samples"]
    assert [samples[0]["phase"], samples[-1]["phase"]] == ["warm-up end", "end"]
    assert (samples[0]["iteration"], samples[-1]["iteration"]) == (50, 200) and len(samples) >= 10
    assert all({"host_rss_bytes", "open_fds", "threads", "live_tensors"} <= set(s) for s in samples)
    checked = sum(soak.should_check(i, 200, 5) for i in range(200))
    assert (result["times"]["checked"], result["times"]["plain"]) == (checked, 200 - checked)
    assert result["rerun"].endswith("--seed 7")


def _series(**growth: int) -> list[dict]:
    """Three samples, each metric of `growth` rising by that much in all from the first to the last."""
    base = dict(device_allocated_bytes=100 * MIB, device_outside_torch_bytes=900 * MIB, host_rss_bytes=500 * MIB,
                open_fds=12, threads=40, live_tensors=300, live_cuda_events=8)  # fmt: skip
    return [dict(base, iteration=i, **{k: base[k] + growth.get(k, 0) * i // 2 for k in growth}) for i in range(3)]


def test_the_leak_detector_passes_flat_series_and_fails_growing_ones():
    assert leaks.find_growth(_series()) == []
    assert leaks.find_growth(_series()[:1]) == []
    assert leaks.find_growth(_series(host_rss_bytes=63 * MIB, live_tensors=16)) == []
    assert leaks.find_growth(_series(device_allocated_bytes=-50 * MIB, threads=-3)) == []  # shrinking is fine
    cases = {
        "device_allocated_bytes": (3 * MIB, "device_allocated_bytes grew by 3.0 MiB from iteration 0 to 2"),
        "device_outside_torch_bytes": (65 * MIB, "device_outside_torch_bytes grew by 65.0 MiB"),
        "host_rss_bytes": (
            65 * MIB,
            "host_rss_bytes grew by 65.0 MiB from iteration 0 to 2 (500.0 MiB -> 565.0 MiB; tolerance 64.0 MiB)",
        ),
        "open_fds": (1, "open_fds grew by 1 from iteration 0 to 2 (12 -> 13; tolerance 0)"),
        "threads": (2, "threads grew by 2"),
        "live_tensors": (17, "live_tensors grew by 17"),
        "live_cuda_events": (1, "live_cuda_events grew by 1"),
    }
    for key, (amount, text) in cases.items():
        problems = leaks.find_growth(_series(**{key: amount}))
        assert len(problems) == 1 and text in problems[0], (key, problems)
    assert len(leaks.find_growth(_series(open_fds=4, threads=1))) == 2
    # A metric one sample lacks (no GPU, no /proc) is not compared
    series = _series(open_fds=4)
    del series[-1]["open_fds"]
    assert leaks.find_growth(series) == []
    assert leaks.find_growth(_series(open_fds=4), dict(open_fds=4)) == []


def test_the_soak_exits_non_zero_when_a_sample_grows(monkeypatch, capsys):
    real = soak.sample_process
    calls = []

    def leaking(device):  # one more descriptor at every sample: what a handle kept per call does
        calls.append(1)
        values = real(device)
        values["open_fds"] += len(calls)
        return values

    monkeypatch.setattr(soak, "sample_process", leaking)
    assert soak.main(["--device", "cpu", "--ranks", "2", "--iterations", "30", "--warmup", "10", "--max-tokens",
                      "8", "--max-local-experts", "2", "--check-every", "10"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "LEAK: open_fds grew by" in out and "soak FAILED" in out


def test_the_soak_exits_non_zero_and_names_the_iteration_when_outputs_differ(monkeypatch, capsys):
    def differ(*args, **kwargs):
        raise AssertionError("combined_x: 2 bytes differ")

    monkeypatch.setattr(soak, "equal", differ)
    assert soak.main(["--device", "cpu", "--ranks", "2", "--iterations", "20", "--warmup", "5", "--max-tokens",
                      "8", "--max-local-experts", "2", "--seed", "11"]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "FAILED: iteration 0 (checked), rank" in out and "combined_x: 2 bytes differ" in out
    assert "rerun: python3 tests/loopback/soak.py --device cpu --ranks 2 --iterations 20" in out
    assert "--seed 11" in out


def test_the_soak_plan_changes_every_mode_and_checks_first_last_and_every_nth():
    plans = [soak.iteration_plan(4, i, 3, 512) for i in range(400)]
    assert plans == [soak.iteration_plan(4, i, 3, 512) for i in range(400)]  # the same on every rank
    tokens = [t for p in plans for t in p["tokens"]]
    assert {0, 512} <= set(tokens) and len(set(tokens)) > 100 and max(tokens) == 512
    assert plans[0]["tokens"] == [0] * 4 and plans[1]["tokens"] == [512] * 4
    for key in ("expand", "cached", "cpu_sync", "dispatch_weights", "combine_weights", "multiple_reduction",
                "zero_padding"):  # fmt: skip
        assert {p[key] for p in plans} == {False, True}, key
    assert {p["dtype"] for p in plans} == {"bf16", "fp32", "ue8m0"}
    assert {p["alignment"] for p in plans} == {1, 128} and len({p["hidden"] for p in plans}) == 2
    assert all(p["num_local_experts"] <= 8 for p in (soak.iteration_plan(2, i, 3, 32, 8) for i in range(100)))
    checked = [i for i in range(100) if soak.should_check(i, 100, 25)]
    assert checked == [0, 24, 49, 74, 99]
    assert all(soak.should_check(i, 10, 1) for i in range(10))


def test_the_soak_refuses_impossible_requests():
    for argv in (["--device", "cpu", "--max-tokens", "513"], ["--device", "cpu", "--check-every", "0"],
                 ["--device", "cpu", "--iterations", "10", "--warmup", "10"], ["--ranks", "5"]):  # fmt: skip
        with pytest.raises(SystemExit):
            soak.parse_config(argv)
