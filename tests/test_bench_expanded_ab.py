"""`bench/expanded_ab.py summarize` on CPU: the medians and ratios it writes from run lines of two
checkouts (its `run` half needs one GPU: it is what produced bench/results/*-expanded-ab-*.json)."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "expanded_ab.py"


def _run_line(rng: random.Random, tag: str, num_ranks: int) -> dict:
    per_rank = [{"fp8_dispatch_us": rng.uniform(900, 1300), "bf16_combine_us": rng.uniform(1800, 2300)}
                for _ in range(num_ranks)]  # fmt: skip
    slowest = {key: max(times[key] for times in per_rank) for key in per_rank[0]}
    return dict(tag=tag, slowest=slowest, per_rank=per_rank)


def test_summarize_takes_medians_over_runs_of_the_slowest_and_the_median_rank(tmp_path):
    rng = random.Random()
    runs = [_run_line(rng, tag, 8) for tag in ("old", "new", "new", "old", "new", "old", "old")]
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    files[0].write_text("".join(json.dumps(r) + "\n" for r in runs[:4]))
    files[1].write_text("".join(json.dumps(r) + "\n" for r in runs[4:]) + "\n")  # a blank line is skipped
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "summarize", *map(str, files), "--json", str(out),
                           "--commit", "abc", "--old", "def", "--command", "test", "--hardware", "none"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(out.read_text())
    assert (result["commit"], result["old"], result["command"], result["hardware"]) == ("abc", "def", "test", "none")
    assert result["runs"] == runs
    for key in ("fp8_dispatch_us", "bf16_combine_us"):
        figure = result["figures"][key]
        for tag in ("old", "new"):
            mine = [r for r in runs if r["tag"] == tag]
            assert figure[tag]["slowest_per_run_us"] == [r["slowest"][key] for r in mine]
            assert figure[tag]["slowest_us"] == statistics.median(r["slowest"][key] for r in mine)
            medians = [statistics.median(t[key] for t in r["per_rank"]) for r in mine]
            assert figure[tag]["rank_median_us"] == statistics.median(medians)
        assert figure["new_over_old_slowest"] == figure["new"]["slowest_us"] / figure["old"]["slowest_us"]
        assert key in done.stdout
