"""`deep-ep bench --host`: the host cost of every operation, on 2 CPU ranks (reference backend) and on
virtual CPU ranks; the multi-rank rule of its summary; the options it refuses."""

from __future__ import annotations

import json
import subprocess
import sys

from deep_ep.bench import cases, host


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deep_ep.cli", "bench", "--host", *args], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)  # fmt: skip


def test_host_bench_on_cpu_ranks_times_every_operation_and_writes_json(tmp_path):
    json_path = tmp_path / "host.json"
    result = _bench(tmp_path, "--tokens", "64,16", "--iters", "3", "--seed", "5", "--json", str(json_path))
    assert result.returncode == 0, result.stderr
    document = json.loads(json_path.read_text())
    for key in ("commit", "command", "hardware", "date", "seed", "multi_rank_rule"):
        assert document[key], key
    assert document["command"].startswith("deep-ep bench --host") and document["seed"] == 5
    assert document["steady_graphs"] is True  # the replays' graphs (EP_STEADY_GRAPHS) are on by default
    rows = document["results"]
    assert [(r["case"]["num_tokens"], r["op"]) for r in rows] == [(t, op) for t in (64, 16) for op in host.HOST_OPS]
    per_rank = document["per_rank"]
    assert len(per_rank) == 2 and all(r["backend"] == "ReferenceBackend" for r in per_rank[0])
    for index, row in enumerate(rows):
        mine = [ranks[index] for ranks in per_rank]
        # The summary is the slowest rank; a call never returns after the wait that follows it, and
        # one thread's CPU time never exceeds its wall time
        assert row["host_wall_us"] == max(r["host_wall_us"] for r in mine) > 0
        assert row["eager_wall_us"] == max(r["eager_wall_us"] for r in mine)
        for r in mine:
            # (the CPU clock's span holds the wall clock's reads and part of its own: 2 us to spare)
            assert r["eager_wall_us"] >= r["host_wall_us"] and r["host_cpu_us"] <= r["host_wall_us"] * 1.01 + 2
            # The floor: the timers' on CPU ranks too, the launch and the allocation only on GPUs
            assert r["timer_floor_us"] > 0 and r["launch_floor_us"] is None and r["alloc_floor_us"] is None
            # Dropping the results is timed apart from the call, and inside its eager wall
            assert 0 <= r["release_us"] <= r["eager_wall_us"]
            # The calls with new addresses are timed too; the reference backend has no graphs
            assert r["host_wall_moved_us"] > 0 and set(r["graphs"].values()) == {0}
        assert row["gpu_us"] is None  # no GPU
    assert all(r["host_target_us"] is None for r in rows)  # the targets are the kernels'
    for text in (
        "host cost per call",
        "dispatch_cpu_sync",
        "host CPU us: the calling thread's CPU",
        "measured: commit",
        "floor of this run, T=64 fp8 uniform: launch n/a, allocation n/a, timers",
    ):
        assert text in result.stdout, text


def test_host_bench_on_virtual_cpu_ranks_runs_in_one_process():
    config = cases.BenchConfig(cases.make_cases([32], None, ["bf16"], ["imbalanced"], 256, 4, 16), 4, "cpu",
                               virtual_ranks=True, num_warmups=1, num_iters=2, graphs=False, speed_of_light=False,
                               seed=3)  # fmt: skip
    rows = host.run_host(config, command="deep-ep bench --host --test")
    assert [r["op"] for r in rows] == list(host.HOST_OPS)
    assert all(r["backend"] == "ReferenceBackend" and r["host_wall_us"] > 0 for r in rows)


def test_host_bench_refuses_the_options_of_the_bandwidth_tables(tmp_path):
    result = _bench(tmp_path, "--sms", "8", "--plot", "x.png")
    assert result.returncode == 1 and "`--host` times the planner's SM pick" in result.stderr, result.stderr
    assert "drop --sms, --plot" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, "-m", "deep_ep.cli", "bench", "--graph-ab", "2"], capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1 and "`--graph-ab` times the calls of `--host`" in result.stderr, result.stderr


def test_host_summary_takes_each_fields_slowest_rank():
    def row(rank: int, wall: float, gpu: float | None, op: str = "combine", wait: float | None = None) -> dict:
        return dict(case=dict(num_tokens=8, dtype="bf16", routing="uniform"), op=op, rank=rank, backend="NvlinkBackend", host_wall_us=wall,
                    host_wall_moved_us=wall + 2, host_cpu_us=wall / 2, eager_wall_us=wall + 1, release_us=1.0, gpu_us=gpu, count_wait_us=wait,
                    launch_floor_us=wall / 4, alloc_floor_us=wall / 8, timer_floor_us=0.1)  # fmt: skip

    (summary,) = host.summarize([[row(0, 5.0, 3.0)], [row(1, 7.0, None)]])
    assert (summary["host_wall_us"], summary["host_cpu_us"], summary["eager_wall_us"]) == (7.0, 3.5, 8.0)
    assert summary["host_wall_moved_us"] == 9.0
    assert (summary["launch_floor_us"], summary["alloc_floor_us"], summary["timer_floor_us"]) == (1.75, 0.875, 0.1)
    assert "floor of this run, T=8 bf16 uniform: launch 1.8 us, allocation 0.9 us, timers 0.1 us" in host.format_table(
        [summary], "test", False
    )
    assert summary["gpu_us"] == 3.0 and summary["host_target_us"] == 20.0 and "rank" not in summary
    assert summary["count_wait_us"] is None
    # A CPU-sync dispatch's target follows the slowest rank's wait for its counts (90 us > 52 + 30)
    (synced,) = host.summarize([[row(0, 90.0, None, "dispatch_cpu_sync", 41.0)],
                                [row(1, 80.0, None, "dispatch_cpu_sync", 52.0)]])  # fmt: skip
    assert synced["count_wait_us"] == 52.0 and synced["host_target_us"] == 52.0 + host.CPU_SYNC_TARGET_US
    assert "82 missed/missed" in host.format_table([synced], "test", False)
    (moved_only,) = host.summarize([[row(0, 18.0, 3.0)]])  # 18 us, moved 20 us: the combine's 20 met twice
    assert "20 met/met" in host.format_table([moved_only], "test", False)
    (moved_only,) = host.summarize([[row(0, 19.0, 3.0)]])
    assert "20 met/missed" in host.format_table([moved_only], "test", False)


def test_host_profile_says_where_each_operations_host_time_goes(tmp_path):
    json_path = tmp_path / "host.json"
    result = _bench(tmp_path, "--tokens", "32", "--iters", "3", "--profile", "--json", str(json_path))
    assert result.returncode == 0, result.stderr
    rows = json.loads(json_path.read_text())["results"]
    assert [r["op"] for r in rows] == list(host.HOST_OPS)
    for row in rows:
        profile = row["profile"]
        assert profile["num_calls"] == 3 and profile["total_us"] > 0
        assert abs(sum(profile["areas"].values()) - profile["total_us"]) < 1e-6 * profile["total_us"] + 1e-9
        own = [f["own_us"] for f in profile["top"]]
        assert own == sorted(own, reverse=True) and len(own) == 40
        # The facade's validation runs in every call, and each call enters `ElasticBuffer.dispatch`/`combine`
        assert "validation (deep_ep.validation)" in profile["areas"], profile["areas"]
        assert f"profile of {row['op']}, T=32 fp8 uniform" in result.stdout
    assert "top functions (own us, cumulative us, calls per call)" in result.stdout


def test_profile_areas_follow_where_the_code_lives_and_profile_needs_host(tmp_path):
    from deep_ep.bench import host_profile

    assert host_profile.area_of("~") == host_profile._C_AREA
    assert host_profile.area_of("/x/site-packages/deep_ep/validation.py").startswith("validation")
    assert host_profile.area_of("/r/deep_ep/backends/kernels/dispatch.py").startswith("kernels backend")
    assert host_profile.area_of("/r/deep_ep/backends/reference/backend.py") == "reference backend"
    assert host_profile.area_of("/r/deep_ep/buffer.py").startswith("facade")
    assert host_profile.area_of("/usr/lib/python3.11/site-packages/torch/cuda/streams.py") == "torch's Python"
    assert host_profile.area_of("/usr/lib/python3.11/contextlib.py") == host_profile._OTHER_AREA
    result = subprocess.run([sys.executable, "-m", "deep_ep.cli", "bench", "--profile"], capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1 and "`--profile` profiles the calls of `--host`; add --host" in result.stderr


def test_one_rank_is_a_host_bench_of_its_own_and_only_that(tmp_path):
    result = _bench(tmp_path, "--ranks", "1", "--tokens", "16", "--iters", "2")
    assert result.returncode == 0, result.stderr
    assert "(1 CPU rank (gloo)" in result.stdout and "combine" in result.stdout
    refused = subprocess.run([sys.executable, "-m", "deep_ep.cli", "bench", "--ranks", "1"], capture_output=True,
                             text=True, timeout=600, cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 1 and "`--ranks` must be in [2, " in refused.stderr, refused.stderr
