"""nvcc: where it is, which version, which target, which flags, how it runs, what ptxas said.

Everything here is about invoking the compiler; what to compile comes from `spec`, where the
result goes is `cache`'s business.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import env
from .errors import JITCompileError, JITError, PtxasCheckError

# How many times this process started nvcc (any command, `--version` included). Tests use it to
# prove that a cache hit runs no compiler at all.
_invocations = 0
_invocations_lock = threading.Lock()


def invocation_count() -> int:
    """Return how many compiler processes this process has started so far."""
    return _invocations


def count_invocation() -> None:
    """Record that one compiler (or build tool) process was started."""
    global _invocations
    with _invocations_lock:
        _invocations += 1


_DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")


def find_nvcc() -> Path:
    """Return the nvcc to use: `EP_JIT_NVCC_COMPILER`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on `PATH`,
    else the toolkit's default location `/usr/local/cuda/bin/nvcc`.

    Raises:
        JITError: when none of them exists.
    """
    configured = env.value(env.NVCC_COMPILER)
    if configured is not None:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise JITError(f"{env.NVCC_COMPILER}={configured} is not an executable file")
        return path.resolve()
    cuda_home = env.value("CUDA_HOME")
    if cuda_home is not None and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return (Path(cuda_home) / "bin" / "nvcc").resolve()
    found = shutil.which("nvcc")
    if found is None and _DEFAULT_NVCC.is_file():
        found = str(_DEFAULT_NVCC)
    if found is None:
        raise JITError(f"nvcc not found: set {env.NVCC_COMPILER} or CUDA_HOME, or put nvcc on PATH")
    return Path(found).resolve()


@functools.lru_cache(maxsize=8)
def _version_text(nvcc: Path) -> str:
    count_invocation()
    result = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise JITError(f"`{nvcc} --version` failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip()


def nvcc_version(nvcc: Path | None = None) -> str:
    """Return the full `nvcc --version` text (part of every cache key), once per process per nvcc."""
    return _version_text(nvcc or find_nvcc())


def nvcc_release(nvcc: Path | None = None) -> str:
    """Return the short release, e.g. `13.0, V13.0.88`, from `nvcc --version`."""
    text = nvcc_version(nvcc)
    match = re.search(r"release (\S+,? V\S+)", text)
    return match.group(1) if match else text.splitlines()[-1]


@dataclass(frozen=True)
class Arch:
    """A GPU target such as `sm_90a`: compute capability digits plus an optional `a`/`f` suffix."""

    number: int
    suffix: str = ""

    @property
    def name(self) -> str:
        """E.g. `sm_90a`."""
        return f"sm_{self.number}{self.suffix}"

    @property
    def gencode(self) -> str:
        """The nvcc flag that compiles real SASS for exactly this target."""
        return f"-gencode=arch=compute_{self.number}{self.suffix},code=sm_{self.number}{self.suffix}"


_ARCH = re.compile(r"^(?:sm_|compute_)?(\d{2,3})([af]?)$")


def parse_arch(text: str) -> Arch:
    """Parse `sm_90a`, `90a`, `sm_100a`, `sm_80`, ... into an `Arch`.

    Raises:
        ValueError: for anything else.
    """
    match = _ARCH.match(text.strip().lower())
    if match is None:
        raise ValueError(f"bad GPU architecture {text!r}; expected e.g. 'sm_90a' or 'sm_100a'")
    return Arch(int(match.group(1)), match.group(2))


def arch_for_capability(major: int, minor: int) -> Arch:
    """The target for a device of compute capability `major.minor`.

    From Hopper on we take the arch-specific variant (`sm_90a`, `sm_100a`): it is what unlocks
    wgmma, setmaxnreg and the other features our kernels may use, and we compile per device anyway.
    """
    return Arch(major * 10 + minor, "a" if major >= 9 else "")


def resolve_arch(arch: str | Arch | None = None, device: int | None = None) -> Arch:
    """Pick the compile target: `arch` if given, else `EP_JIT_ARCH`, else the GPU's (via torch).

    Raises:
        JITError: when none is given and no GPU is visible (e.g. on a CPU-only CI machine).
    """
    if isinstance(arch, Arch):
        return arch
    if arch is not None:
        return parse_arch(arch)
    configured = env.value(env.ARCH)
    if configured is not None:
        return parse_arch(configured)
    try:
        import torch

        if torch.cuda.is_available():
            index = torch.cuda.current_device() if device is None else device
            return arch_for_capability(*torch.cuda.get_device_capability(index))
    except ImportError:
        pass
    raise JITError(
        f"cannot choose a GPU architecture: no GPU is visible and {env.ARCH} is unset; "
        f"set e.g. {env.ARCH}=sm_90a to compile without a GPU"
    )


def base_flags(arch: Arch) -> list[str]:
    """Flags every kernel compile gets (besides includes and outputs); part of the cache key.

    `-Xptxas -v` is always on: it does not change the binary, and storing its report in the cache
    entry lets `EP_JIT_PTXAS_VERBOSE`/`EP_JIT_PTXAS_CHECK` work on cache hits too.
    """
    flags = ["-std=c++17", arch.gencode, "-cubin", "-Xptxas", "-v"]
    if env.flag(env.WITH_LINEINFO):
        flags.append("-lineinfo")
    return flags


def include_flags(include_dirs: Sequence[str | Path], nccl_include: Path | None) -> list[str]:
    """`-I` flags with the NCCL headers first.

    `-I` folders are searched before the system folders, and the NCCL one comes before every
    other, so `<nccl.h>` can never resolve to a stale `/usr/include/nccl.h`.
    """
    dirs = ([str(nccl_include)] if nccl_include is not None else []) + [str(d) for d in include_dirs]
    return [f"-I{d}" for d in dirs]


def print_command(command: Sequence[str]) -> None:
    """Echo a compiler command to stderr when `EP_JIT_PRINT_COMPILER_COMMAND` is on."""
    if env.flag(env.PRINT_COMPILER_COMMAND):
        print(f"[deep_ep.jit] {shlex.join(command)}", file=sys.stderr, flush=True)


def compile_error(
    what: str, command: Sequence[str], stderr: str, returncode: int | None, source: str = ""
) -> JITCompileError:
    """Build the error for a failed compile: the full command line, the full stderr, the source."""
    parts = [
        f"compiling {what} failed (exit status {returncode})",
        f"command: {shlex.join(command)}",
        "stderr:",
        stderr.rstrip(),
    ]
    if source:
        parts += ["generated source:", source.rstrip()]
    return JITCompileError("\n".join(parts), command=command, stderr=stderr, returncode=returncode)


def run_compiler(command: Sequence[str], what: str, source: str = "") -> str:
    """Run a compiler command; return its stderr (the ptxas report) on success.

    Raises:
        JITCompileError: with the command line and stderr when it exits non-zero.
    """
    print_command(command)
    count_invocation()
    result = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise compile_error(what, command, result.stderr + result.stdout, result.returncode, source)
    return result.stderr


@dataclass(frozen=True)
class FunctionResources:
    """What ptxas reported for one function."""

    name: str
    registers: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    local_memory: int = 0
    cumulative_stack: int = 0

    @property
    def uses_local_memory(self) -> bool:
        """True when the function touches local memory in any form ptxas reports."""
        return any((self.stack_frame, self.spill_stores, self.spill_loads, self.local_memory, self.cumulative_stack))


_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_USED = re.compile(r"Used (\d+) registers")
_LMEM = re.compile(r"(\d+) bytes lmem")
_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")


def parse_ptxas(log: str) -> list[FunctionResources]:
    """Parse the `-Xptxas -v` report into one record per function (kernels and device functions)."""
    records: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in log.splitlines():
        if match := _PROPERTIES.search(line):
            current = match.group(1)
            records.setdefault(current, {})
        elif (match := _FRAME.search(line)) and current is not None:
            frame, stores, loads = (int(g) for g in match.groups())
            records[current].update(stack_frame=frame, spill_stores=stores, spill_loads=loads)
        elif match := _ENTRY.search(line):
            current = match.group(1)
            records.setdefault(current, {})
        elif (match := _USED.search(line)) and current is not None:
            records[current]["registers"] = int(match.group(1))
            if lmem := _LMEM.search(line):
                records[current]["local_memory"] = int(lmem.group(1))
            if stack := _CUMULATIVE.search(line):
                records[current]["cumulative_stack"] = int(stack.group(1))
    return [FunctionResources(name, **values) for name, values in records.items()]


def report_ptxas(log: str, what: str) -> None:
    """Apply `EP_JIT_PTXAS_VERBOSE` (print the report) and `EP_JIT_PTXAS_CHECK` (reject local memory).

    Raises:
        PtxasCheckError: when the check is on and any function has a stack frame, spills or lmem.
    """
    if env.flag(env.PTXAS_VERBOSE):
        print(f"[deep_ep.jit] ptxas report for {what}:\n{log.rstrip()}", file=sys.stderr, flush=True)
    if not env.flag(env.PTXAS_CHECK):
        return
    offenders = [r for r in parse_ptxas(log) if r.uses_local_memory]
    if offenders:
        details = "; ".join(
            f"{r.name}: {r.stack_frame} bytes stack frame, {r.spill_stores} bytes spill stores, "
            f"{r.spill_loads} bytes spill loads, {r.local_memory} bytes lmem, {r.cumulative_stack} bytes cumulative stack"
            for r in offenders
        )
        raise PtxasCheckError(
            f"{env.PTXAS_CHECK}: {what} uses local memory or spills registers ({details})\nptxas report:\n{log.rstrip()}",
            stderr=log,
        )


def find_disassembler(nvcc: Path | None = None) -> list[str] | None:
    """Return a command prefix that prints SASS of a cubin (cuobjdump, else nvdisasm), or `None`."""
    folders = [nvcc.parent] if nvcc is not None else []
    for tool, args in (("cuobjdump", ["-sass"]), ("nvdisasm", ["-c"])):
        for folder in folders:
            if (folder / tool).is_file():
                return [str(folder / tool), *args]
        found = shutil.which(tool)
        if found is not None:
            return [found, *args]
    return None


def dump_sass(cubin: Path, output: Path, nvcc: Path | None = None) -> bool:
    """Write the SASS of `cubin` to `output` (atomically); warn and return False without a tool."""
    command = find_disassembler(nvcc)
    if command is None:
        warnings.warn(
            f"{env.DUMP_SASS} is set but neither cuobjdump nor nvdisasm was found", RuntimeWarning, stacklevel=3
        )
        return False
    result = subprocess.run([*command, str(cubin)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        warnings.warn(
            f"{shlex.join([*command, str(cubin)])} failed: {result.stderr.strip()}", RuntimeWarning, stacklevel=3
        )
        return False
    partial = output.with_name(f".{output.name}.{os.getpid()}")
    partial.write_text(result.stdout)
    os.replace(partial, output)
    return True
