"""The `EP_JIT_*` environment switches, read in one place.

Every switch is read when it is used (not at import), so a test or a user can change it at run
time. Switches that change the compiled binary (`EP_JIT_WITH_LINEINFO`, `EP_JIT_ARCH`) become part
of the cache key through the nvcc flags; the others only change what is printed or checked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CACHE_DIR = "EP_JIT_CACHE_DIR"
ARCH = "EP_JIT_ARCH"
NVCC_COMPILER = "EP_JIT_NVCC_COMPILER"
DEBUG = "EP_JIT_DEBUG"
PRINT_COMPILER_COMMAND = "EP_JIT_PRINT_COMPILER_COMMAND"
PTXAS_VERBOSE = "EP_JIT_PTXAS_VERBOSE"
PTXAS_CHECK = "EP_JIT_PTXAS_CHECK"
DUMP_SASS = "EP_JIT_DUMP_SASS"
WITH_LINEINFO = "EP_JIT_WITH_LINEINFO"
# Compile-only: the `nvidia/nccl` folder (`include/`, `lib/`) of another NCCL release to compile against
NCCL_ROOT = "EP_JIT_NCCL_ROOT"

_FALSE_WORDS = ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """Return whether the switch `name` is on: set to anything but empty, `0`, `false`, `no`, `off`."""
    return os.environ.get(name, "").strip().lower() not in _FALSE_WORDS


def value(name: str) -> str | None:
    """Return the stripped value of `name`, or `None` when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    return text or None


def cache_dir() -> Path:
    """Return the JIT cache root: `EP_JIT_CACHE_DIR`, else `~/.cache/deep_ep/jit`."""
    configured = value(CACHE_DIR)
    if configured is not None:
        return Path(configured).expanduser().resolve()
    return Path.home() / ".cache" / "deep_ep" / "jit"


def debug(message: str) -> None:
    """Print `message` to stderr when `EP_JIT_DEBUG` is on."""
    if flag(DEBUG):
        print(f"[deep_ep.jit] {message}", file=sys.stderr, flush=True)
