"""deep_ep.jit.cache: content-addressed entries, hits without a compiler, atomic publish, corrupt entries rebuilt."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
from deep_ep.jit import KernelSpec, cache, compile_spec, plan_build, stats
from deep_ep.jit.compiler import invocation_count
from deep_ep.jit.deps import included_headers
from kernels import jit_specs

from deep_ep.paths import get_include_dir


def peer_pointers_spec() -> KernelSpec:
    """The library's one kernel built against NCCL's device headers."""
    return KernelSpec(
        header="deep_ep/kernels/nccl_peer_pointers.cuh",
        name="deep_ep::nccl_peer_pointers_impl",
        template_args=(256,),
        param_types=("ncclWindow_t", "int", "uint64_t*"),
        include_dirs=(str(get_include_dir()),),
        use_nccl=True,
    )


def entry_dirs(root: Path) -> list[Path]:
    return sorted((root / "kernels").iterdir()) if (root / "kernels").is_dir() else []


@pytest.mark.nvcc
def test_miss_compiles_with_nvcc_then_hit_runs_no_compiler(jit_cache):
    before, compiles = invocation_count(), stats().get("compile", 0)
    first = compile_spec(jit_specs.spill())
    assert stats().get("compile", 0) == compiles + 1 and invocation_count() > before
    assert entry_dirs(jit_cache) == [first.path]

    after_first, hits = invocation_count(), stats().get("hit", 0)
    second = compile_spec(jit_specs.spill())
    assert invocation_count() == after_first  # not even `nvcc --version` ran again
    assert stats().get("hit", 0) == hits + 1 and stats().get("compile", 0) == compiles + 1
    assert second.path == first.path and second.metadata == first.metadata


@pytest.mark.parametrize("damage", ["truncate_cubin", "flip_cubin_byte", "delete_cubin", "garbage_metadata"])
@pytest.mark.nvcc
def test_a_damaged_entry_is_detected_removed_and_rebuilt(jit_cache, damage):
    entry = compile_spec(jit_specs.spill())
    cubin = entry.binary_path
    good = cubin.read_bytes()
    if damage == "truncate_cubin":
        cubin.write_bytes(good[: len(good) // 2])
    elif damage == "flip_cubin_byte":
        cubin.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    elif damage == "delete_cubin":
        cubin.unlink()
    else:
        (entry.path / "meta.json").write_text('{"schema": 1, "kind": "kern')
    corrupt, compiles = stats().get("corrupt", 0), stats().get("compile", 0)
    rebuilt = compile_spec(jit_specs.spill())
    assert stats().get("corrupt", 0) == corrupt + 1 and stats().get("compile", 0) == compiles + 1
    assert rebuilt.path == entry.path and rebuilt.read_binary() == good
    assert entry_dirs(jit_cache) == [entry.path]


def _compile_in_child(barrier: multiprocessing.synchronize.Barrier, queue: multiprocessing.Queue) -> None:
    barrier.wait(timeout=60)
    entry = compile_spec(peer_pointers_spec())
    queue.put((str(entry.path), hashlib.sha256(entry.read_binary()).hexdigest(), stats().get("compile", 0)))


@pytest.mark.nvcc
def test_two_processes_compiling_the_same_spec_leave_one_valid_entry(jit_cache):
    context = multiprocessing.get_context("spawn")
    barrier, queue = context.Barrier(2), context.Queue()
    children = [context.Process(target=_compile_in_child, args=(barrier, queue)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=180)
    assert [child.exitcode for child in children] == [0, 0]
    results = [queue.get(timeout=5) for _ in children]
    (path,) = {r[0] for r in results}
    assert len({r[1] for r in results}) == 1
    assert entry_dirs(jit_cache) == [Path(path)]
    assert not any((jit_cache / "tmp").iterdir())  # the loser discarded its build
    assert compile_spec(peer_pointers_spec()).path == Path(path)  # and the entry verifies
    print(f"compiles per process: {[r[2] for r in results]}")


def _write_entry(key: str, payload: bytes) -> Path:
    build = cache.new_build_dir()
    (build / "kernel.cubin").write_bytes(payload)
    cache.write_metadata(build, "kernels", key, "kernel.cubin", {"name": "test", "symbol": "x"})
    return build


def test_publish_keeps_the_first_entry_and_discards_a_late_copy(jit_cache):
    key = "ab" * 32
    first = cache.publish(_write_entry(key, b"first"), "kernels", key)
    late = _write_entry(key, b"second")
    lost = stats().get("lost_race", 0)
    assert cache.publish(late, "kernels", key).read_binary() == b"first"
    assert stats().get("lost_race", 0) == lost + 1 and not late.exists()
    assert first.path == cache.entry_dir("kernels", key)
    # A corrupt entry in the way is replaced by the new one.
    (first.path / "kernel.cubin").write_bytes(b"firs")
    assert cache.publish(_write_entry(key, b"third"), "kernels", key).read_binary() == b"third"


@pytest.mark.nvcc
def test_key_follows_header_contents_transitively(tmp_path):
    include = tmp_path / "include"
    (include / "demo").mkdir(parents=True)
    (include / "demo" / "kernel.cuh").write_text(
        '#pragma once\n#include "detail.cuh"\n#include <cstdint>\n'
        "namespace demo {\ntemplate <int k> __global__ void k_impl(int* o) { o[0] = detail() + k; }\n}\n"
    )
    (include / "demo" / "detail.cuh").write_text(
        "#pragma once\n#include <demo/more.cuh>\n__device__ int detail() { return more(); }\n"
    )
    (include / "demo" / "more.cuh").write_text("#pragma once\n__device__ int more() { return 1; }\n")
    spec = KernelSpec("demo/kernel.cuh", "demo::k_impl", (1,), ("int*",), (str(include),))
    headers = {p.name for p in included_headers(plan_build(spec).source, spec.include_dirs)}
    assert headers == {"kernel.cuh", "detail.cuh", "more.cuh"}
    before = plan_build(spec).key
    (include / "demo" / "more.cuh").write_text("#pragma once\n__device__ int more() { return 2; }\n")
    assert plan_build(spec).key != before
    # Entries are content-addressed: the same headers in another folder give the same key.
    copy = tmp_path / "copy"
    shutil.copytree(include, copy)
    moved = KernelSpec("demo/kernel.cuh", "demo::k_impl", (1,), ("int*",), (str(copy),))
    assert plan_build(moved).key == plan_build(spec).key


@pytest.mark.nvcc
def test_entries_usage_and_clear(jit_cache):
    entry = compile_spec(jit_specs.spill())
    (jit_cache / "tmp" / "build-leftover").mkdir()
    os.utime(jit_cache / "tmp" / "build-leftover", (0, 0))  # left long ago by a process of an old version
    listed = cache.entries()
    assert [e.path for e in listed] == [entry.path]
    assert json.loads((entry.path / "meta.json").read_text())["sha256"] == entry.metadata["sha256"]
    count, size = cache.usage()
    assert count == 1 and size >= entry.metadata["size"]
    assert cache.clear() == 1
    assert cache.entries() == [] and not any((jit_cache / "tmp").iterdir())  # the leftover went
