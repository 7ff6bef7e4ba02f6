"""deep_ep.jit's cache under stress: many processes compiling the same kernels from an empty cache,
`deep-ep jit clear` while a process compiles, damaged and foreign entries, and a cache root that
cannot be written."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deep_ep.jit import cache, compile_many, compile_spec, stats
from kernels import jit_specs

pytestmark = pytest.mark.nvcc

NUM_PROCESSES, NUM_KERNELS = 8, 20


def _specs() -> list:
    return [jit_specs.scalars(32 * (i + 1)) for i in range(NUM_KERNELS)]


def _compile_all(barrier, queue) -> None:
    barrier.wait(timeout=120)
    entries = compile_many(_specs(), jobs=2)
    queue.put([(str(e.path), hashlib.sha256(e.read_binary()).hexdigest()) for e in entries])


def test_processes_compiling_the_same_kernels_at_once_agree_on_one_valid_entry_each(jit_cache):
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(NUM_PROCESSES), context.Queue()
    children = [context.Process(target=_compile_all, args=(barrier, queue)) for _ in range(NUM_PROCESSES)]
    for child in children:
        child.start()
    results = [queue.get(timeout=600) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert [child.exitcode for child in children] == [0] * NUM_PROCESSES
    assert all(result == results[0] for result in results), "processes saw different entries"
    assert len({path for path, _ in results[0]}) == NUM_KERNELS
    assert sorted(p.name for p in (jit_cache / "kernels").iterdir()) == sorted(Path(p).name for p, _ in results[0])
    assert [e.path for e in compile_many(_specs())] == [Path(p) for p, _ in results[0]]  # all verify, all hits
    assert not [p for p in (jit_cache / "tmp").iterdir() if p.name.startswith(("build-", "ninja-"))]


def test_clear_while_another_process_compiles_keeps_its_builds(jit_cache):
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from kernels import jit_specs; from deep_ep.jit import compile_many;"
        " e = compile_many([jit_specs.scalars(32 * (i + 1)) for i in range(12)], jobs=1);"
        " print(sum(x.read_binary() != b'' for x in e))"
    )
    tests_dir = str(Path(__file__).resolve().parent)
    child = subprocess.Popen([sys.executable, "-c", script, tests_dir], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "EP_JIT_CACHE_DIR": str(jit_cache)})  # fmt: skip
    cleared = 0
    while child.poll() is None:
        cache.clear()  # what `deep-ep jit clear` does
        cleared += 1
    out, err = child.communicate()
    assert child.returncode == 0, err
    assert out.strip() == "12" and cleared > 0
    assert [e.read_binary() != b"" for e in compile_many([jit_specs.scalars(32 * (i + 1)) for i in range(12)])]


def test_clear_removes_what_dead_processes_left(jit_cache):
    mine = cache.new_build_dir()
    dead = cache.new_build_dir()
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (dead / cache.OWNER).write_text(f"{exited.stdout.strip()} {os.uname().nodename}\n")
    unmarked = jit_cache / "tmp" / "build-from-an-old-version"
    unmarked.mkdir()
    os.utime(unmarked, (0, 0))  # long ago
    cache.clear()
    assert mine.is_dir() and not dead.exists() and not unmarked.exists()


def test_an_entry_copied_under_another_key_is_never_loaded(jit_cache):
    entry = compile_spec(jit_specs.spill())
    foreign = jit_cache / "kernels" / ("f" * 64)
    shutil.copytree(entry.path, foreign)  # e.g. built by another nvcc or NCCL: its meta.json names its own key
    assert cache.lookup("kernels", "f" * 64) is None and not foreign.exists()
    assert json.loads((entry.path / "meta.json").read_text())["key"] == entry.key


def test_a_root_that_cannot_be_written_is_read_and_new_kernels_go_elsewhere(tmp_path, monkeypatch):
    configured = tmp_path / "shared-cache"
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(configured))
    monkeypatch.setattr(cache, "fallback_root", lambda: tmp_path / "fallback")  # this test's own fallback
    prebuilt = compile_spec(jit_specs.spill())  # a warm cache, e.g. shipped in an image
    shutil.rmtree(configured / "tmp")
    (configured / "tmp").write_text("not a folder")  # nothing can be built or published here now
    cache._writable.clear()  # a new process
    compiles = stats().get("compile", 0)
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        again = compile_spec(jit_specs.spill())
        built = compile_spec(jit_specs.scalars(96))
    assert again.path == prebuilt.path and stats().get("compile", 0) == compiles + 1  # a hit, then one compile
    assert built.path.parent.parent == tmp_path / "fallback"
    assert compile_spec(jit_specs.scalars(96)).path == built.path  # found there next time


def test_no_writable_root_at_all_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(cache, "fallback_root", lambda: tmp_path / "file" / "fallback")
    cache._writable.clear()
    with pytest.raises(OSError, match="cannot be written; point EP_JIT_CACHE_DIR at a writable folder"):
        compile_spec(jit_specs.spill())
