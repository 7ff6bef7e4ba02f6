"""`deep-ep bench` on 2 CPU ranks (reference backend): checks, then prints the table and writes JSON and PNG."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_on_cpu_ranks_writes_table_json_and_plot(tmp_path):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "deep_ep.cli", "bench", "--tokens", "64,16", "--iters", "2",
         "--json", str(json_path), "--plot", str(plot_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dispatch us" in result.stdout and "torch d/c us" in result.stdout, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.strip().startswith(("64 ", "16 "))]
    assert len(lines) == 2, result.stdout

    document = json.loads(json_path.read_text())
    for key in ("commit", "command", "hardware", "date", "results"):
        assert key in document, key
    assert "CPU ranks" in document["hardware"]
    assert [r["case"]["num_tokens"] for r in document["results"]] == [64, 16]
    for row in document["results"]:
        assert row["backend"] == "ReferenceBackend"
        for key in ("dispatch_us", "combine_us", "torch_dispatch_us", "torch_combine_us"):
            assert row[key] > 0, (key, row)
        assert row["speed_of_light_gbs"] is None  # no NVLink on CPU ranks
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
