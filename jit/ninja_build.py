"""Compile many kernel specs in parallel: one generated ninja file, one ninja run.

Each spec is planned (source + key) and looked up first; only the misses go into the ninja file,
one nvcc command each, writing into its own build folder. Every command writes its cubin under a
temporary name and renames it when nvcc succeeds, so an existing cubin means a finished compile.
Ninja runs with `-k 0` (keep going), the successes are published into the cache exactly like
single compiles, and the failures are reported together afterwards.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from . import cache, compiler, env
from .build import CUBIN_NAME, KIND, SOURCE_NAME, BuildPlan, after_lookup, finish_build, plan_build
from .cache import CacheEntry
from .compiler import Arch
from .errors import JITCompileError, JITError
from .spec import KernelSpec

_STATUS = re.compile(r"^\[(\d+)/(\d+)\]")


def find_ninja() -> str:
    """Return the ninja binary: the `ninja` Python package's, else `ninja` on PATH.

    Raises:
        JITError: when neither exists.
    """
    try:
        import ninja

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("ninja")
    if found is None:
        raise JITError("ninja not found: `pip install ninja`")
    return found


def _escape(text: str) -> str:
    """Escape for a ninja file: `$`, and also `:` and spaces so paths work in build lines."""
    return text.replace("$", "$$").replace(":", "$:").replace(" ", "$ ").replace("\n", " ")


def _progress(done: int, total: int, width: int = 30) -> None:
    filled = width * done // max(total, 1)
    print(
        f"\r[deep_ep.jit] [{'#' * filled}{'.' * (width - filled)}] {done}/{total} kernels",
        end="",
        file=sys.stderr,
        flush=True,
    )


def _write_ninja_file(folder: Path, plans: list[BuildPlan]) -> list[list[str]]:
    """Write `build.ninja` with one nvcc command per plan; return the commands (for error messages)."""
    lines = ["ninja_required_version = 1.3", "rule nvcc", "  command = $cmd", "  description = $desc", ""]
    commands = []
    for index, plan in enumerate(plans):
        work = folder / str(index)
        work.mkdir()
        (work / SOURCE_NAME).write_text(plan.source)
        partial = work / f"{CUBIN_NAME}.partial"
        command = plan.command(work / SOURCE_NAME, partial)
        commands.append(command)
        compiler.print_command(command)
        # stderr (the ptxas report or the errors) goes to a file we read back either way.
        shell = f"{shlex.join(command)} 2> {shlex.quote(str(work / 'stderr.log'))} && mv {shlex.quote(str(partial))} {shlex.quote(str(work / CUBIN_NAME))}"
        lines += [
            f"build {_escape(str(work / CUBIN_NAME))}: nvcc {_escape(str(work / SOURCE_NAME))}",
            f"  cmd = {shell.replace('$', '$$')}",
            f"  desc = {plan.spec.display_name.replace('$', '$$')}",
            "",
        ]
    (folder / "build.ninja").write_text("\n".join(lines))
    return commands


def compile_many(
    specs: Iterable[KernelSpec],
    *,
    arch: str | Arch | None = None,
    jobs: int | None = None,
    progress: bool = False,
) -> list[CacheEntry]:
    """Compile every spec that is not cached yet, in parallel through ninja; works without a GPU.

    Arguments:
        specs: the kernels (duplicates are compiled once).
        arch: target such as `"sm_90a"` (default: `EP_JIT_ARCH`, else the current GPU).
        jobs: parallel nvcc processes (default: the number of CPUs).
        progress: draw a text progress bar on stderr.

    Returns:
        The cache entries, in the order of `specs`.

    Raises:
        JITCompileError: after publishing every success, if any compile failed; the message holds
            each failed command line and its stderr.
    """
    target = compiler.resolve_arch(arch)
    plans = [plan_build(spec, arch=target) for spec in specs]
    entries: dict[str, CacheEntry] = {}
    misses: dict[str, BuildPlan] = {}
    for plan in plans:
        if plan.key in entries or plan.key in misses:
            continue
        entry = cache.lookup(KIND, plan.key)
        if entry is not None:
            cache.count("hit")
            entries[plan.key] = entry
        else:
            cache.count("miss")
            misses[plan.key] = plan
    env.debug(f"compile_many: {len(plans)} specs, {len(entries)} cached, {len(misses)} to compile")
    if misses:
        entries.update(_run_ninja(list(misses.values()), jobs, progress))
    return [after_lookup(entries[plan.key]) for plan in plans]


def _run_ninja(plans: list[BuildPlan], jobs: int | None, progress: bool) -> dict[str, CacheEntry]:
    folder = cache.new_private_dir("ninja-")
    try:
        commands = _write_ninja_file(folder, plans)
        ninja = [find_ninja(), "-C", str(folder), "-k", "0", "-j", str(jobs or os.cpu_count() or 1)]
        started = time.perf_counter()
        if progress:
            _progress(0, len(plans))
        process = subprocess.Popen(
            ninja,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "NINJA_STATUS": "[%f/%t] "},
        )
        assert process.stdout is not None
        output = []
        for line in process.stdout:
            output.append(line)
            match = _STATUS.match(line)
            if progress and match:
                _progress(int(match.group(1)), len(plans))
        process.wait()
        if progress:
            print(file=sys.stderr, flush=True)
        seconds = time.perf_counter() - started
        compiler.count_invocation()  # ninja itself; each nvcc below it is counted per plan
        published: dict[str, CacheEntry] = {}
        failures = []
        for index, (plan, command) in enumerate(zip(plans, commands, strict=True)):
            compiler.count_invocation()
            work = folder / str(index)
            log_path = work / "stderr.log"
            log = log_path.read_text(errors="replace") if log_path.exists() else ""
            if not (work / CUBIN_NAME).is_file():
                failures.append(
                    compiler.compile_error(plan.spec.display_name, command, log or "".join(output), None, plan.source)
                )
                continue
            cache.count("compile")
            build_dir = cache.new_build_dir()
            shutil.move(str(work / CUBIN_NAME), build_dir / CUBIN_NAME)
            shutil.move(str(work / SOURCE_NAME), build_dir / SOURCE_NAME)
            # The wall time of the whole ninja run, shared by its kernels.
            published[plan.key] = finish_build(plan, build_dir, log, command, seconds)
        if failures:
            message = f"{len(failures)} of {len(plans)} kernels failed to compile:\n\n" + "\n\n".join(
                map(str, failures)
            )
            raise JITCompileError(message, command=failures[0].command, stderr=failures[0].stderr)
        return published
    finally:
        shutil.rmtree(folder, ignore_errors=True)
