"""deep_ep.jit.ninja_build: compile_many builds specs in parallel through ninja, publishing like single compiles."""

from __future__ import annotations

import pytest
from deep_ep.jit import JITCompileError, cache, compile_many, compile_spec, stats
from deep_ep.jit.elf import kernel_symbols
from kernels import jit_specs

# Every test here compiles with nvcc (skipped with the reason where it is not found: tests/conftest.py)
pytestmark = pytest.mark.nvcc


def test_gpu_test_kernels_compile_in_parallel_with_a_progress_bar(jit_cache, capfd):
    specs = jit_specs.gpu_test_specs()
    cached = compile_spec(specs[0])  # one is cached already: it must not be rebuilt
    compiles = stats().get("compile", 0)
    entries = compile_many([*specs, specs[1]], jobs=2, progress=True)
    assert stats().get("compile", 0) == compiles + len(specs) - 1
    assert "kernels" in capfd.readouterr().err  # the progress bar
    assert entries[0].path == cached.path and entries[-1].path == entries[1].path  # the duplicate
    for spec, entry in zip(specs, entries[: len(specs)], strict=True):
        assert entry.metadata["name"] == spec.display_name
        assert kernel_symbols(entry.read_binary()) == [entry.symbol]
        assert entry.metadata["resources"][entry.symbol]["stack_frame"] == 0
    assert len(cache.entries()) == len(specs)
    # A second run compiles nothing and returns the same entries.
    assert [e.path for e in compile_many(specs)] == [e.path for e in entries[: len(specs)]]
    assert stats().get("compile", 0) == compiles + len(specs) - 1


def test_failures_are_reported_together_after_the_successes_are_published(jit_cache):
    with pytest.raises(JITCompileError) as caught:
        compile_many([jit_specs.coop(), jit_specs.broken(), jit_specs.cluster()])
    message = str(caught.value)
    assert message.startswith("1 of 3 kernels failed to compile")
    assert "undeclared_name_in_broken_impl" in message and "-gencode=arch=compute_90a,code=sm_90a" in message
    assert caught.value.command and "undeclared_name_in_broken_impl" in caught.value.stderr
    names = sorted(e.name for e in cache.entries())
    assert names == ["jit_test::cluster_impl<64>", "jit_test::coop_impl<4>"]
    assert not any((jit_cache / "tmp").iterdir())
