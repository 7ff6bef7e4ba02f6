"""The kernel fuzzer (`fuzz_kernels.py`) and the soak (`soak.py`) on CPU: the soak's short run on CPU
virtual ranks (reference against reference), its leak detector and failure exits, the fuzzer's
spreading of cases and its reproducers. No GPU or nvcc is needed."""

from __future__ import annotations

import json
import shlex

import fuzz_kernels as fuzz
import leaks
import pytest
import soak
from sweep import make_cases

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
    assert result["passed"] and result["complete"] and result["leaks"] == [] and result["error"] is None
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


# ---------------------------------------------------------------------------- the fuzzer


def test_cases_are_spread_towards_small_worlds_and_sum_to_the_request():
    counts = fuzz.spread_cases(1000, [2, 3, 4, 8, 16])
    assert sum(counts.values()) == 1000
    assert min(counts[2], counts[3], counts[4]) > counts[8] > counts[16] >= fuzz.NUM_CORNERS
    # About six minutes at the sweep's rates
    assert 300 < sum(count / fuzz.RATES[n] for n, count in counts.items()) < 420
    for total, ranks in ((7, [2, 3, 4, 8, 16]), (1, [16]), (3, [2, 16]), (20, [8, 16]), (12345, [3, 8])):
        counts = fuzz.spread_cases(total, ranks)
        assert sum(counts.values()) == total and list(counts) == ranks, (total, ranks, counts)
        assert min(counts.values()) >= min(fuzz.NUM_CORNERS, total // len(ranks))


def test_a_case_selected_by_ep_and_index_is_the_same_dict_as_in_the_full_list():
    seed = 4242
    full = fuzz.build_plan(fuzz._parser().parse_args(["--cases", "1000", "--seed", str(seed)]), seed)
    assert {n: len(cases) for n, cases in full.items()} == fuzz.spread_cases(1000, [2, 3, 4, 8, 16])
    for ep in (2, 4, 16):
        cases = full[ep]
        for index in (0, 3, 4, len(cases) // 2, len(cases) - 1):
            args = fuzz._parser().parse_args(["--seed", str(seed), "--case", f"{ep}:{index}"])
            assert fuzz.build_plan(args, seed) == {ep: [cases[index]]}
        args = fuzz._parser().parse_args(["--case", f"{ep}:2-9", "--case", f"{ep}:0"])
        assert fuzz.build_plan(args, seed) == {ep: cases[2:10] + cases[:1]}
    # Later cases than a run had still come from the same sequence
    assert fuzz.select_cases(8, 200, 200, seed)[0] == make_cases(8, 300, seed)[200]


def test_a_printed_reproducer_parses_back_to_its_case():
    seed, cases = 99, make_cases(3, 40, 99)
    alone, sequence = fuzz.reproducers(seed, 3, 5, 31)
    assert alone == "python3 tests/loopback/fuzz_kernels.py --seed 99 --case 3:31"
    assert sequence.endswith("--seed 99 --case 3:5-31")
    for line, expected in ((alone, [cases[31]]), (sequence, cases[5:32])):
        argv = shlex.split(line)[2:]
        args = fuzz._parser().parse_args(argv)
        assert args.seed == seed and fuzz.build_plan(args, args.seed) == {3: expected}
    assert fuzz.reproducers(seed, 3, 31, 31) == [alone]


@pytest.mark.parametrize("text", ["4", "4:", "5:1", "4:x", "4:3-1", ":3", "4:1-2-3"])
def test_a_malformed_case_is_refused(text):
    with pytest.raises(SystemExit):
        fuzz._parser().parse_args(["--case", text])


def test_the_fuzzer_dry_run_prints_the_seed_and_the_spread(capsys):
    assert fuzz.main(["--dry-run", "--cases", "50", "--ranks", "2,16", "--seed", "5"]) == 0
    assert "fuzz: seed 5, 50 cases (EP2 41, EP16 9)" in capsys.readouterr().out
    assert fuzz.main(["--dry-run", "--cases", "50"]) == 0
    assert "fuzz: seed " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        fuzz.main(["--ranks", "2,5", "--dry-run"])
