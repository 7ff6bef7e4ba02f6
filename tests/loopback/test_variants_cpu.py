"""The variants of `tests/loopback/variants.py` still revert what they name: every edit matches its
file exactly once, and a variant differs from the checkout by exactly its edits."""

from __future__ import annotations

import filecmp

import pytest
from variants import KNOCKOUTS, ORDERING_REVERT, ROOT, Edit, check_edits, make_variant


@pytest.mark.parametrize("edits", [k.edits for k in KNOCKOUTS] + [ORDERING_REVERT],
                         ids=[k.name for k in KNOCKOUTS] + ["ordering-revert"])  # fmt: skip
def test_every_edit_matches_its_file_once(edits):
    check_edits(edits)


def test_knockouts_have_distinct_names_and_gpu_tests():
    assert len({k.name for k in KNOCKOUTS}) == len(KNOCKOUTS)
    for knockout in KNOCKOUTS:
        path, _, name = knockout.test.partition("::")
        assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), knockout.test


def test_a_variant_differs_from_the_checkout_by_its_edits_only(tmp_path):
    tree = make_variant(ORDERING_REVERT, tmp_path)
    edited = {edit.path for edit in ORDERING_REVERT}
    for path in edited:
        assert (tree / path).read_text() != (ROOT / path).read_text()
    for source in ("include/deep_ep/kernels/dispatch.cuh", "deep_ep/buffer.py", "pyproject.toml"):
        assert filecmp.cmp(tree / source, ROOT / source, shallow=False), source
    assert not (tree / ".git").exists()


def test_an_edit_that_no_longer_matches_is_refused():
    with pytest.raises(ValueError, match="occurs 0 times"):
        check_edits((Edit("include/deep_ep/common/ptx.cuh", "no such text in the header", ""),))


def test_the_ab_reads_graph_times_of_the_planner_picks_from_a_bench_result():
    from variants import _graph_times

    times = _graph_times(ROOT / "bench" / "results" / "2026-12-01-h200-virtual4-bench.json")
    assert set(times) == {f"T={t} {d} {op}" for t in (4096, 128) for d in ("fp8", "bf16")
                          for op in ("fresh", "cached", "combine")}  # fmt: skip
    assert all(value > 0 for value in times.values())
