"""`deep-ep bench`: on 2 CPU ranks (reference backend) it checks, prints the tables and writes JSON and PNG;
its report (GPU rows with graph times: tables, planner and issue checks, plot) from synthetic rows."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import asdict

import pytest

from deep_ep.bench import cases, report

PNG = b"\x89PNG\r\n\x1a\n"


def _bench(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deep_ep.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)  # fmt: skip


def test_bench_on_cpu_ranks_writes_table_json_and_plot(tmp_path):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = _bench(tmp_path, "--tokens", "64,16", "--iters", "2", "--json", str(json_path), "--plot", str(plot_path))
    assert result.returncode == 0, result.stderr
    assert "dispatch us" in result.stdout and "torch d/c us" in result.stdout, result.stdout
    assert "CUDA-graph replay: not measured" in result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip().startswith(("64 ", "16 "))]
    assert len(lines) == 2, result.stdout
    assert all(line.split("|")[0].split()[-1] == "n/a" for line in lines)  # the reference backend has no SMs
    # CPU ranks: no GPU-only column or footer; every column shown is explained; the check is named for what it is
    assert "%SoL" not in result.stdout and "planner's pick (num_sms=0" not in result.stdout
    assert "planner rates" not in result.stdout and "/root/" not in result.stdout
    for column in (
        "log GB/s:",
        "wire GB/s:",
        "x torch d/c:",
        "torch d/c us:",
        "several ranks: every time is the slowest",
    ):
        assert column in result.stdout, column
    assert "self-consistency check" in result.stdout and "measured: commit " in result.stdout

    document = json.loads(json_path.read_text())
    for key in ("commit", "command", "hardware", "date", "results", "checks", "planner_source"):
        assert key in document, key
    assert "CPU ranks" in document["hardware"]
    assert document["planner_source"].startswith(("pre-calibration estimates", "calibrated"))
    assert [r["case"]["num_tokens"] for r in document["results"]] == [64, 16]
    for row in document["results"]:
        assert row["backend"] == "ReferenceBackend" and row["num_sms_source"] == "planner"
        assert row["num_sms"] == row["planner_num_sms"] > 0
        for key in ("dispatch_us", "combine_us", "torch_dispatch_us", "torch_combine_us", "predicted_dispatch_us"):
            assert row[key] > 0, (key, row)
        assert row["speed_of_light_gbs"] is None and row["graph_dispatch_us"] is None  # no NVLink, no graphs
    assert plot_path.read_bytes()[:8] == PNG
    assert document["checked_against"] == "itself" and "slowest rank" in document["multi_rank_rule"]
    # One rule: the progress line shows the table's figures (the slowest rank's), and GB/s recompute from the row
    progress = [line for line in result.stderr.splitlines() if "slowest rank" in line]
    for line, row in zip(progress, document["results"], strict=True):
        assert f"eager {row['dispatch_us']:.1f}/{row['combine_us']:.1f} us" in line, (line, row["dispatch_us"])
    for row in document["results"]:
        _check_recomputable(row)


def _check_recomputable(row: dict) -> None:
    """Every GB/s of a row = its mean record count x record bytes / its (slowest rank's) time."""
    assert row["num_records"] == pytest.approx(sum(row["num_records_per_rank"]) / len(row["num_records_per_rank"]))
    for prefix, time_key, bytes_key in report.TIMED:
        if row[time_key] is None:
            continue
        for kind, records in (("logical", "num_records"), ("wire", "num_wire_records")):
            expected = row[records] * row[bytes_key] / row[time_key] / 1e3
            assert row[f"{prefix}_{kind}_gbs"] == pytest.approx(expected), (prefix, kind)


def test_bench_rejects_iters_0_and_a_hot_fraction_above_1_with_a_clear_error(tmp_path):
    for args, message in ((("--iters", "0"), "--iters: expected a positive integer, got '0'"),
                          (("--hot-fraction", "2"), "--hot-fraction: expected a number in [0, 1]"),
                          (("--samples", "-1"), "--samples: expected a positive integer")):  # fmt: skip
        result = _bench(tmp_path, *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_bench_help_explains_every_column_and_the_multi_rank_rule(tmp_path):
    text = _bench(tmp_path, "--help").stdout
    for name, _, _ in report_columns():
        assert f"  {name}: " in text, name
    assert "several ranks: every time is the slowest rank's median" in text and "self-consistency" in text


def report_columns():
    from deep_ep.bench import COLUMNS

    return COLUMNS


def test_summary_of_imbalanced_ranks_is_recomputable_from_the_json_fields():
    per_rank = []
    for rank, (records, us) in enumerate(((900, 100.0), (300, 200.0))):  # the hot rank sends more, faster
        per_rank.append([dict(_gpu_rank_rows(rank)[-1], num_records=records, num_wire_records=records // 2,
                              dispatch_us=us, graph_dispatch_us=us / 2)])  # fmt: skip
    (row,) = report.summarize(per_rank, dict(speed_of_light_gbs=350.0))
    assert row["dispatch_us"] == 200.0 and row["num_records"] == 600 and row["num_records_per_rank"] == [900, 300]
    assert row["dispatch_logical_gbs"] == pytest.approx(600 * 7456 / 200.0 / 1e3)
    _check_recomputable(row)


def test_bench_options_dtype_routing_and_sweep(tmp_path):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = _bench(tmp_path, "--tokens", "16", "--iters", "1", "--dtype", "fp8,bf16", "--routing", "uniform,imbalanced",
                    "--sms", "2", "--hot-fraction", "0.9", "--seed", "7", "--json", str(json_path), "--plot", str(plot_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(json_path.read_text())
    assert document["seed"] == 7 and document["hot_fraction"] == 0.9
    got = [(r["case"]["fp8_dispatch"], r["case"]["routing"], r["num_sms_source"]) for r in document["results"]]
    assert got == [(fp8, routing, source) for fp8 in (True, False) for routing in ("uniform", "imbalanced")
                   for source in ("planner", "sweep")]  # fmt: skip
    bf16 = [r for r in document["results"] if not r["case"]["fp8_dispatch"]]
    assert all(r["dispatch_bytes"] == 1024 * 2 + 4 * 8 for r in bf16)  # BF16 data, top-k ids and weights
    hot = [r for r in document["results"] if r["case"]["routing"] == "imbalanced"]
    assert all(r["num_records"] > 0 for r in hot)
    assert document["checks"]["planner_sm"] == []  # the reference backend ignores the SM count
    assert plot_path.read_bytes()[:8] == PNG


def test_bench_rejects_unknown_options(tmp_path):
    result = _bench(tmp_path, "--dtype", "fp4")
    assert result.returncode == 2 and "fp8, bf16" in result.stderr
    with pytest.raises(ValueError, match="routing"):
        cases.make_cases([16], None, ["fp8"], ["zipf"], 1024, 4, 32)


# ------------------------------------------------------------------------------------------ GPU report


def _gpu_rank_rows(rank: int) -> list[dict]:
    """Per-rank rows as a 2-GPU run returns them: T=8192 with a sweep, T=128 with the planner's pick."""
    rows = []
    sol = 350.0
    for tokens, sms in ((8192, (0, 16, 24, 32, 48, 64)), (128, (0,))):
        for num_sms in sms:
            used = num_sms or 48
            case = cases.BenchCase(tokens, 7168, 8, 256, True, num_sms, "uniform")
            records = 2 * tokens - 30
            # Graph time: link-bound above 32 SMs (wire bytes at 90% of SoL), SM-bound below
            wire_us = (records // 2) * 7456 / (0.9 * sol * 1e3)
            graph_dispatch = max(wire_us, wire_us * 32 / used) + 20
            graph_combine = 2 * graph_dispatch
            if tokens == 128:
                graph_dispatch, graph_combine = 12.0, 14.0
            rows.append(dict(
                case=asdict(case), num_sms=used, planner_num_sms=48, num_sms_source="planner" if num_sms == 0 else "sweep",
                backend="NvlinkBackend", rank=rank, dispatch_us=1500.0 + rank, combine_us=700.0,
                torch_dispatch_us=1100.0, torch_combine_us=1800.0, num_records=records, num_wire_records=records // 2,
                dispatch_bytes=7456, combine_bytes=14336, graph_dispatch_us=graph_dispatch + rank,
                graph_cached_dispatch_us=0.8 * graph_dispatch, graph_combine_us=graph_combine, graph_calls_per_replay=1,
                graph_checked=True, predicted_dispatch_us=1.1 * graph_dispatch, predicted_combine_us=0.7 * graph_combine,
                kernel_breakdown=dict(dispatch=dict(dispatch=8.0, dispatch_epilogue=4.0), combine={"error": "x"})
                if (tokens == 128 and rank == 0) else None,
            ))  # fmt: skip
    return rows


def test_gpu_report_tables_checks_json_and_plot(tmp_path):
    meta = dict(speed_of_light_gbs=350.0, speed_of_light_by_sms={16: 250.0, 64: 340.0, 132: 350.0},
                num_device_sms=132, planner_source="test rates")  # fmt: skip
    rows = report.summarize([_gpu_rank_rows(0), _gpu_rank_rows(1)], meta)
    pick = rows[0]
    assert pick["graph_dispatch_us"] == max(
        r["graph_dispatch_us"] for r in (_gpu_rank_rows(0)[0], _gpu_rank_rows(1)[0])
    )
    assert pick["graph_dispatch_wire_vs_sol"] == pytest.approx(pick["graph_dispatch_wire_gbs"] / 350.0)
    assert pick["graph_dispatch_speedup_vs_torch"] == pytest.approx(1100.0 / pick["graph_dispatch_us"])
    assert pick["predicted_combine_error"] == pytest.approx(-0.3)

    found = report.checks(rows)
    planner_sm = {c["op"]: c for c in found["planner_sm"]}
    assert set(planner_sm) == {"dispatch", "combine"} and planner_sm["dispatch"]["acceptance"]
    assert planner_sm["dispatch"]["smallest_95_sms"] == 32 and planner_sm["dispatch"]["pick_sms"] == 48
    assert not planner_sm["dispatch"]["passed"]  # 48 > 1.25 x 32
    predictions = {(c["case"], c["op"]): c for c in found["prediction"]}
    assert predictions[("T=8192 fp8 uniform", "dispatch")]["passed"]
    assert not predictions[("T=8192 fp8 uniform", "combine")]["passed"]  # -30%
    targets = {t["target"]: t for t in found["targets"]}
    assert targets["T=128 dispatch (graph, cached or no-sync)"]["passed"]
    assert targets["T=8192 dispatch wire vs SoL, <= 24 SMs"]["num_sms"] == 24
    assert targets["T=128 dispatch epilogue share (report)"]["value"] == pytest.approx(4.0 / 12.0)

    text = report.format_report(rows, found, meta)
    for expected in ("CUDA-graph replay", "fresh us", "planner's SM pick vs the sweep", "issue 6 targets",
                     "kernel breakdown", "speed of light", "MISSED"):  # fmt: skip
        assert expected in text, expected
    graph_lines = [line for line in text.split("CUDA-graph replay")[1].splitlines() if line.strip().startswith("8192")]
    assert len(graph_lines) == 6

    class Config:
        seed, num_iters, num_warmups, num_rotations, num_graph_rotations, num_graph_samples = 1, 2, 1, 2, 2, 3
        hot_fraction, num_ranks, virtual_ranks = 0.5, 2, False

    json_path, plot_path = tmp_path / "gpu.json", tmp_path / "gpu.png"
    report.write_json(str(json_path), rows, found, meta, Config(), "deep-ep bench --test", "2x test GPU")
    document = json.loads(json_path.read_text())
    assert document["command"] == "deep-ep bench --test" and document["speed_of_light_by_sms"]["64"] == 340.0
    report.plot(rows, str(plot_path), meta, report.provenance("deep-ep bench --test", "2x test GPU"))
    assert plot_path.read_bytes()[:8] == PNG
    assert b"deep-ep bench --test" in plot_path.read_bytes()  # provenance in the PNG's text chunk


# ------------------------------------------------------------------------------------------ graph plumbing


def _graph_path_rank(rank: int, num_ranks: int, fp8: bool) -> dict:
    """`runner._graph_times` on CPU ranks with graphs faked (every call runs eagerly at "capture")."""
    import torch.distributed as dist

    import deep_ep
    from deep_ep.bench import runner, timing

    class EagerOp(timing.CapturedOp):
        def replay_first(self):
            return self.outputs[0][0]

    captured = []

    def eager_capture(call, num_inputs, calls_per_graph, host_barrier):
        host_barrier()
        captured.append((num_inputs, calls_per_graph))
        return EagerOp([None] * num_inputs, [[call(r) for _ in range(calls_per_graph)] for r in range(num_inputs)],
                       calls_per_graph)  # fmt: skip

    runner.capture = eager_capture
    runner.agree_on_replays = lambda op, align, group: 4
    runner.time_graphs = lambda op, num_replays, num_samples, align: 1e-5 * num_replays
    group = dist.group.WORLD
    case = cases.BenchCase(16, 256, 4, 8, fp8, 0, "imbalanced")
    config = cases.BenchConfig([case], num_ranks, "cpu", num_warmups=1, num_iters=1, seed=3)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=16, hidden=256, num_topk=4, use_fp8_dispatch=fp8,
                                   explicitly_destroy=True)  # fmt: skip
    try:
        state = runner._key_state(case, buffer, rank, num_ranks, config, group, lambda: dist.barrier(group=group))
        result = runner._graph_times(case, buffer, state, 4, config, group, lambda: None)
    finally:
        buffer.destroy()
    return dict(result, captured=captured, num_recv=state.num_recv)


@pytest.mark.parametrize("fp8", [True, False])
def test_graph_path_checks_no_sync_cached_and_combine_outputs_against_the_reference(fp8):
    from deep_ep.utils.spawn import spawn_ranks

    for result in spawn_ranks(_graph_path_rank, 2, args=(fp8,), timeout_s=120):
        assert result["graph_checked"] and result["num_recv"] > 0
        assert result["captured"] == [(2, 8)] * 3  # fresh, cached, combine; 2 input sets; 8 calls (T=16)
        assert result["graph_dispatch_us"] == pytest.approx(40.0) and result["graph_calls_per_replay"] == 8


def test_the_checks_compare_the_real_rows_bitwise_and_name_what_differs():
    import torch

    from deep_ep.bench.runner import check_combine, check_dispatch

    class Handle:
        def __init__(self, psum):
            self.psum_num_recv_tokens_per_scaleup_rank = torch.tensor(psum, dtype=torch.int32)
            self.num_unaligned_recv_tokens_per_expert = torch.tensor([3, 1], dtype=torch.int32)

    data = torch.randn(4, 8).to(torch.float8_e4m3fn)
    scales, idx, weights = torch.rand(4, 1), torch.arange(8).reshape(4, 2), torch.rand(4, 2)
    ref = ((data, scales), idx, weights, Handle([2, 3]))
    padded = (tuple(torch.cat([t, t[:2]]) for t in (data, scales)), torch.cat([idx, -idx[:2]]), torch.cat([weights, weights[:2]]),
              Handle([2, 3]))  # fmt: skip
    check_dispatch(padded, ref, 3, "worst-case rows past the real ones are ignored")
    wrong = ((data, scales * 2), idx, weights, Handle([2, 3]))
    with pytest.raises(AssertionError, match="recv_x differs"):
        check_dispatch(wrong, ref, 3, "x")
    check_dispatch(((data, scales), None, None, None), ref, 3, "cached: recv_x only", full=False)
    with pytest.raises(AssertionError, match="recv_topk_idx differs"):
        check_dispatch(((data, scales), idx + 1, weights, Handle([2, 3])), ref, 3, "x")
    with pytest.raises(AssertionError, match="psum_num_recv_tokens_per_scaleup_rank"):
        check_dispatch(((data, scales), idx, weights, Handle([2, 4])), ref, 3, "x")
    with pytest.raises(AssertionError, match="combine differs"):
        check_combine(torch.ones(2), torch.zeros(2), "x")


def test_gpu_bench_compiles_exactly_kernels_of_the_warmup_set_for_two_gpus():
    # `deep-ep bench` compiles its kernels up front; on 2 GPUs with the default shape (FP8 and BF16)
    # they are all among `deep-ep jit warmup`'s, which tests/test_kernels_compile.py builds for sm_90a
    from deep_ep.backends.kernels import specs as kernel_specs

    bench_cases = cases.make_cases([8192, 128], [8, 24], ["fp8", "bf16"], ["uniform"], 7168, 8, 256)
    specs = cases.kernel_specs(cases.BenchConfig(bench_cases, 2, "cuda"))
    names = {spec.name for spec in specs}
    assert {"deep_ep::dispatch_impl", "deep_ep::dispatch_epilogue_impl", "deep_ep::combine_impl",
            "deep_ep::combine_epilogue_impl", "deep_ep::peer_store_impl"} <= names  # fmt: skip
    assert len(specs) == len(set(specs))
    assert set(specs) <= set(kernel_specs.warmup_specs())
    eight = cases.kernel_specs(cases.BenchConfig(bench_cases, 8, "cuda"))
    assert all(spec.template_args[0] == 8 for spec in eight if spec.name == "deep_ep::dispatch_impl")


# ------------------------------------------------------------------------------------------ ranks


def test_ranks_option_chooses_the_number_of_ranks_and_rejects_what_cannot_run():
    config = cases.default_config(tokens=[16], num_ranks=4)  # CPU here: 4 CPU ranks, 32 experts
    assert config.num_ranks == 4 and not config.virtual_ranks
    for bad, message in ((3, "divide the 32 experts"), (1, r"\[2, 64\]"), (65, r"\[2, 64\]")):
        with pytest.raises(ValueError, match=message):
            cases.default_config(num_ranks=bad)


def test_bench_on_virtual_cpu_ranks_runs_every_rank_in_one_process_and_says_so(tmp_path):
    from deep_ep.bench import runner

    config = cases.BenchConfig(cases.make_cases([16], None, ["bf16"], ["imbalanced"], 256, 4, 16), 4, "cpu",
                               virtual_ranks=True, num_warmups=1, num_iters=2, num_rotations=2, graphs=False,
                               speed_of_light=False, seed=11)  # fmt: skip
    json_path = tmp_path / "virtual.json"
    rows = runner.run(config, json_path=str(json_path), command="deep-ep bench --test")
    document = json.loads(json_path.read_text())
    assert document["virtual_ranks"] is True and document["num_ranks"] == 4
    assert "virtual" in document["hardware"] and "VIRTUAL RANKS" in document["virtual_ranks_note"]
    assert document["checks"]["targets"] == [] and document["checks"]["prediction"] == []
    (row,) = rows
    assert row["backend"] == "ReferenceBackend" and row["num_records"] > 0
    assert row["dispatch_us"] > 0 and row["torch_dispatch_us"] > 0 and row["predicted_dispatch_us"] is None
    text = report.format_report(rows, document["checks"], dict(virtual_ranks=True, planner_source="test"))
    assert text.startswith("VIRTUAL RANKS")


# ------------------------------------------------------------------------------------------ plots


def _many_cases(num_sms_values: tuple[int, ...]) -> list[dict]:
    """Summarized rows of 24 cases (4 token counts x 2 dtypes x 3 routings... as labels) over `num_sms_values`."""
    rank_rows = []
    for index in range(24):
        tokens = 128 * (1 + index)
        for num_sms in (0, *num_sms_values):
            case = cases.BenchCase(
                tokens, 7168, 8, 256, index % 2 == 0, num_sms, ("uniform", "imbalanced")[index % 3 == 0]
            )
            row = dict(_gpu_rank_rows(0)[0], case=asdict(case), num_sms=num_sms or num_sms_values[0],
                       num_sms_source="planner" if num_sms == 0 else "sweep", num_records=tokens + index,
                       num_wire_records=tokens // 2, graph_dispatch_us=50.0 + index + num_sms,
                       graph_cached_dispatch_us=40.0, graph_combine_us=90.0 + index)  # fmt: skip
            rank_rows.append(row)
    return report.summarize([rank_rows], dict(speed_of_light_gbs=350.0))


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_of_24_cases_keeps_legends_off_the_data_with_distinct_styles(tmp_path):
    import matplotlib.pyplot as plt

    rows = _many_cases((8, 16, 24))
    fig = report.build_figure(rows, dict(speed_of_light_gbs=350.0, speed_of_light_by_sms={8: 200.0, 132: 350.0}), "p")
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        data_axes = [axis for axis in fig.axes if axis.axison]
        legends = [axis.get_legend() for axis in fig.axes if axis.get_legend() is not None]
        assert len(data_axes) == 3 and len(legends) == 2
        for legend in legends:
            for axis in data_axes:
                assert not _overlaps(legend.get_window_extent(renderer), axis.get_window_extent(renderer))
        dispatch_axis = data_axes[1]
        styles = [
            (line.get_color(), line.get_marker()) for line in dispatch_axis.get_lines() if line.get_marker() != "None"
        ]
        assert len(styles) == len({(str(c), m) for c, m in styles}) >= 24  # no case shares colour and marker
        assert "*" not in {m for _, m in styles}  # a star is the planner's pick only
    finally:
        plt.close(fig)
    assert len(set(report.plot_styles(220))) == 220


def test_plot_of_one_sm_count_has_integer_sm_ticks(tmp_path):
    import matplotlib.pyplot as plt

    rows = [r for r in _many_cases((2,)) if r["num_sms_source"] == "planner"][:1]
    fig = report.build_figure(rows, dict(speed_of_light_gbs=None), None)
    try:
        fig.canvas.draw()
        for axis in [axis for axis in fig.axes if axis.axison][1:]:
            ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
            assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks
    finally:
        plt.close(fig)
    report.plot(rows, str(tmp_path / "one.png"), dict(speed_of_light_gbs=None))
    assert (tmp_path / "one.png").read_bytes()[:8] == PNG


def test_plot_of_cpu_rows_marks_the_sm_panels_not_applicable():
    import matplotlib.pyplot as plt

    rows = [dict(r, backend="ReferenceBackend") for r in _many_cases((2,)) if r["num_sms_source"] == "planner"][:3]
    fig = report.build_figure(rows, dict(speed_of_light_gbs=None), None)
    try:
        data_axes = [axis for axis in fig.axes if axis.axison]
        assert data_axes[0].get_title().startswith("every case")
        for axis in data_axes[1:]:
            assert any("uses no SMs" in text.get_text() for text in axis.texts) and not axis.get_lines()
    finally:
        plt.close(fig)


def test_kernel_breakdown_uses_the_median_launch_and_the_slowest_rank():
    from deep_ep.bench.timing import per_call_kernel_times

    # 16 calls, two dispatch launches per call; one launch waited 20 ms for a late peer
    launches = [("dispatch", 120.0 + i % 3) for i in range(31)] + [("dispatch", 20000.0)]
    launches += [("dispatch_epilogue", 50.0 + i % 5) for i in range(16)]
    per_call = per_call_kernel_times(launches, num_calls=16)
    assert per_call["dispatch"] == pytest.approx(2 * 121.0)  # a mean would say 1490
    assert per_call["dispatch_epilogue"] == pytest.approx(52.0)
    assert list(per_call) == ["dispatch", "dispatch_epilogue"]

    merged = report.slowest_breakdown([
        dict(dispatch=dict(dispatch=10.0, dispatch_epilogue=4.0), combine=dict(combine=7.0)),
        dict(dispatch=dict(dispatch=9.0, dispatch_epilogue=6.0), combine={"error": "profiler failed"}),
        None,
    ])  # fmt: skip
    assert merged == dict(dispatch=dict(dispatch=10.0, dispatch_epilogue=6.0), combine={"error": "profiler failed"})
    assert report.slowest_breakdown([None, None]) is None


def test_a_breakdown_longer_than_its_operation_is_flagged():
    row = dict(case=dict(num_tokens=8192, fp8_dispatch=True, routing="uniform"), num_sms=20, graph_dispatch_us=212.4,
               graph_combine_us=369.2, kernel_breakdown=dict(dispatch=dict(dispatch=1589.6), combine=dict(combine=343.4)))  # fmt: skip
    text = report.format_breakdowns([row])
    dispatch_line, combine_line = text.splitlines()[1:]
    assert "dispatch (212.4 us): dispatch 1589.6 (longer than the operation's graph time" in dispatch_line
    assert "combine (369.2 us): combine 343.4" in combine_line and "longer" not in combine_line
    assert "median launch" in text and "do not add up" in text


def test_a_breakdown_on_virtual_ranks_is_refused_before_anything_compiles():
    case = cases.make_cases([128], None, ["fp8"], ["uniform"], 7168, 8, 256)[0]
    config = cases.BenchConfig([case], 4, "cuda", virtual_ranks=True, breakdown=True)
    with pytest.raises(ValueError, match=r"`--breakdown` needs one process per rank .* 2 or more GPUs"):
        from deep_ep.bench import runner

        runner.check_config(config)


def test_bench_op_agrs_checks_then_times_both_paths_and_writes_json(tmp_path):
    json_path = tmp_path / "agrs.json"
    result = _bench(tmp_path, "--op", "agrs", "--ranks", "2", "--iters", "1", "--seed", "7", "--json", str(json_path))
    assert result.returncode == 0, result.stderr
    document = json.loads(json_path.read_text())
    assert {"commit", "command", "hardware", "date", "seed", "rows", "per_rank"} <= set(document)
    # Per size (4 KiB and 64 KiB on CPU ranks), both operations; the CPU path is torch collectives (no CTAs)
    assert [(r["op"], r["bytes_per_rank"]) for r in document["rows"]] == [
        ("all_gather", 4096), ("reduce_scatter", 4096), ("all_gather x8", 4096), ("all_gather", 65536),
        ("reduce_scatter", 65536), ("all_gather x8", 65536)]  # fmt: skip
    for row in document["rows"]:
        assert row["ours_us"] > 0 and row["torch_us"] > 0 and row["ours_ctas"] is None, row
        assert row["ours_over_torch"] == pytest.approx(row["ours_us"] / row["torch_us"])
    assert "reduce_scatter" in result.stdout and "ours/torch" in result.stdout
    refused = _bench(tmp_path, "--op", "agrs", "--tokens", "128")
    assert refused.returncode != 0 and "`--op agrs` times AGRS calls of fixed sizes; drop --tokens" in refused.stderr


@pytest.mark.parametrize("op", ["pp", "engram"])
def test_bench_op_pp_and_engram_check_then_time_both_paths_and_write_json(tmp_path, op):
    json_path = tmp_path / f"{op}.json"
    result = _bench(tmp_path, "--op", op, "--ranks", "2", "--iters", "1", "--seed", "5", "--json", str(json_path))
    assert result.returncode == 0, result.stderr
    document = json.loads(json_path.read_text())
    assert {"commit", "command", "hardware", "date", "seed", "rows", "per_rank", "checked_against"} <= set(document)
    assert len(document["rows"]) == 2 and len(document["per_rank"]) == 2  # two sizes on CPU ranks
    for row in document["rows"]:
        assert row["ours_us"] > 0 and row["torch_us"] > 0, row
        assert row["ours_over_torch"] == pytest.approx(row["ours_us"] / row["torch_us"])
        assert row["path"] == ("point-to-point calls" if op == "pp" else "replicated table"), row
    refused = _bench(tmp_path, "--op", op, "--sms", "8")
    assert refused.returncode != 0 and f"`--op {op}` times" in refused.stderr and "drop --sms" in refused.stderr


def test_a_result_of_code_its_commit_does_not_hold_is_marked_dirty(tmp_path, monkeypatch):
    monkeypatch.delenv("EP_BENCH_COMMIT", raising=False)

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    source = tmp_path / "kernel.cuh"
    source.write_text(f"// {random.random()}\n")
    git("add", "kernel.cuh")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert report.git_commit(tmp_path) == head
    source.write_text(source.read_text() + "// changed after the commit\n")
    assert report.git_commit(tmp_path) == f"{head}-dirty"
    assert report.git_commit(tmp_path / "no checkout here") == "unknown"
    monkeypatch.setenv("EP_BENCH_COMMIT", "named")  # a copy without .git names its commit
    assert report.git_commit(tmp_path) == "named"
