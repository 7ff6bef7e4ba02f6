"""From a kernel spec to a verified cache entry: plan, key, look up, compile on a miss, publish.

`plan_build` does everything that needs no compiler run (source, flags, key); `compile_spec`
looks the key up and runs nvcc only on a miss. `ninja_build.compile_many` shares both ends.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import cache, compiler, env
from .cache import CacheEntry
from .compiler import Arch
from .deps import headers_digest, included_headers
from .elf import ELFError, single_kernel_symbol
from .errors import JITCompileError
from .nccl_headers import NcclInstall, find_nccl, tree_digest, version_string
from .spec import KernelSpec, generate_source

KIND = "kernels"
SOURCE_NAME = "source.cu"
CUBIN_NAME = "kernel.cubin"
SASS_NAME = "kernel.sass"


@dataclass(frozen=True)
class BuildPlan:
    """Everything needed to compile one spec, decided without running the compiler.

    Attributes:
        spec: the kernel.
        arch: the target.
        nvcc: the compiler.
        nccl: the NCCL headers (when the spec uses NCCL).
        nccl_version: the `NCCL_VERSION_CODE` the generated guard demands.
        source: the generated `.cu` text.
        flags: compiler flags without includes, input and output (they are in the key).
        key: the cache key.
    """

    spec: KernelSpec
    arch: Arch
    nvcc: Path
    nccl: NcclInstall | None
    nccl_version: int | None
    source: str
    flags: tuple[str, ...]
    key: str

    def command(self, source_path: Path, output_path: Path) -> list[str]:
        """The full nvcc command line for this build."""
        includes = compiler.include_flags(self.spec.include_dirs, self.nccl.include_dir if self.nccl else None)
        return [str(self.nvcc), *includes, *self.flags, "-o", str(output_path), str(source_path)]


def plan_build(
    spec: KernelSpec, *, arch: str | Arch | None = None, expected_nccl_version: int | None = None
) -> BuildPlan:
    """Generate the source and compute the cache key of `spec`.

    Arguments:
        spec: the kernel.
        arch: target such as `"sm_90a"` (default: `EP_JIT_ARCH`, else the current GPU).
        expected_nccl_version: `NCCL_VERSION_CODE` the generated guard demands (default: the
            version of the headers found; pass the runtime `ncclGetVersion()` to tie the build to
            the loaded library).

    Raises:
        FileNotFoundError: when the spec's header is in none of its include dirs.
        JITError: when no nvcc, no arch or (for NCCL specs) no NCCL headers are found.
    """
    spec.find_header()  # fail early and clearly when the header is missing
    target = compiler.resolve_arch(arch)
    nvcc = compiler.find_nvcc()
    nccl = find_nccl() if spec.use_nccl else None
    nccl_version = None
    if nccl is not None:
        nccl_version = nccl.header_version if expected_nccl_version is None else int(expected_nccl_version)
    source = generate_source(spec, nccl_version)
    flags = (*compiler.base_flags(target), *spec.extra_flags)
    headers = included_headers(source, spec.include_dirs)
    key = cache.make_key(
        {
            "kind": KIND,
            "source": source,
            "headers": headers_digest(headers, spec.include_dirs),
            "nccl": None if nccl is None else {"version": nccl.header_version, "tree": tree_digest(nccl.include_dir)},
            "flags": list(flags),
            "nvcc": compiler.nvcc_version(nvcc),
            "arch": target.name,
        }
    )
    return BuildPlan(spec, target, nvcc, nccl, nccl_version, source, flags, key)


def finish_build(plan: BuildPlan, build_dir: Path, ptxas_log: str, command: list[str], seconds: float) -> CacheEntry:
    """Record metadata for a compiled cubin in `build_dir` and publish it into the cache.

    Raises:
        JITCompileError: when the cubin does not hold exactly one kernel.
    """
    cubin = (build_dir / CUBIN_NAME).read_bytes()
    try:
        symbol = single_kernel_symbol(cubin, plan.spec.display_name)
    except ELFError as error:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise JITCompileError(f"{error}\ncommand: {' '.join(command)}", command=command) from error
    resources = {r.name: r.__dict__ for r in compiler.parse_ptxas(ptxas_log)}
    cache.write_metadata(
        build_dir,
        KIND,
        plan.key,
        CUBIN_NAME,
        {
            "name": plan.spec.display_name,
            "symbol": symbol,
            "arch": plan.arch.name,
            "spec": plan.spec.to_json(),
            "nvcc": str(plan.nvcc),
            "nvcc_release": compiler.nvcc_release(plan.nvcc),
            "nccl_version": None if plan.nccl_version is None else version_string(plan.nccl_version),
            "flags": list(plan.flags),
            "command": command,
            "ptxas_log": ptxas_log,
            "resources": resources,
            "compile_seconds": round(seconds, 3),
        },
    )
    entry = cache.publish(build_dir, KIND, plan.key)
    env.debug(f"compiled {plan.spec.display_name} for {plan.arch.name} in {seconds:.2f} s -> {entry.path}")
    return entry


def after_lookup(entry: CacheEntry) -> CacheEntry:
    """Apply the print/check/dump switches to an entry, whether it was just built or a hit."""
    compiler.report_ptxas(str(entry.metadata.get("ptxas_log", "")), f"{entry.name} ({entry.symbol})")
    if env.flag(env.DUMP_SASS) and not (entry.path / SASS_NAME).exists():
        compiler.dump_sass(entry.binary_path, entry.path / SASS_NAME, Path(str(entry.metadata.get("nvcc", ""))))
    return entry


def compile_spec(
    spec: KernelSpec, *, arch: str | Arch | None = None, expected_nccl_version: int | None = None
) -> CacheEntry:
    """Return the cache entry of `spec`, compiling it with nvcc on a miss. Works without a GPU.

    Arguments:
        spec: the kernel.
        arch: target such as `"sm_90a"` (default: `EP_JIT_ARCH`, else the current GPU).
        expected_nccl_version: see `plan_build`.

    Returns:
        The entry: `entry.binary_path` (the cubin), `entry.symbol` (the mangled kernel name),
        `entry.metadata` (arch, flags, ptxas report, ...).

    Raises:
        JITCompileError: when nvcc fails; the message has the full command line and stderr.
        PtxasCheckError: when `EP_JIT_PTXAS_CHECK` is on and the kernel uses local memory.
    """
    started = time.perf_counter()
    plan = plan_build(spec, arch=arch, expected_nccl_version=expected_nccl_version)
    entry = cache.lookup(KIND, plan.key)
    if entry is not None:
        cache.count("hit")
        env.debug(
            f"cache hit {spec.display_name} [{plan.arch.name}] {plan.key[:16]} ({time.perf_counter() - started:.3f} s)"
        )
        return after_lookup(entry)
    cache.count("miss")
    env.debug(f"cache miss {spec.display_name} [{plan.arch.name}] {plan.key[:16]}")
    build_dir = cache.new_build_dir()
    source_path = build_dir / SOURCE_NAME
    source_path.write_text(plan.source)
    command = plan.command(source_path, build_dir / CUBIN_NAME)
    compile_started = time.perf_counter()
    try:
        ptxas_log = compiler.run_compiler(command, spec.display_name, plan.source)
    except JITCompileError:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    cache.count("compile")
    entry = finish_build(plan, build_dir, ptxas_log, command, time.perf_counter() - compile_started)
    return after_lookup(entry)
