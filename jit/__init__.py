"""deep_ep.jit: compile header-only CUDA kernels at run time, cache them on disk, launch them.

Generic: it knows nothing about MoE. The path of a kernel:

    KernelSpec -> generated .cu (one explicit instantiation) -> cache key (sha256 of source,
    headers, flags, nvcc, NCCL headers, arch) -> cache entry (cubin + metadata, published
    atomically) -> loaded kernel (per device, memoized) -> launch (cuLaunchKernelEx)

Compiling works without a GPU (`compile_spec`, `compile_many`); loading and launching
(`get_kernel`, `Kernel.launch`) need one. See docs/jit.md for the `EP_JIT_*` variables.

Importing this package is cheap: the CUDA driver bindings load on first use of a name that
needs them (`get_kernel`, `Kernel`, `load_kernel`, `measure_launch_overhead`).
"""

from __future__ import annotations

import importlib
from typing import Any

from .args import F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, Bool, Opaque, Pointer, param_bytes
from .build import compile_spec, plan_build
from .cache import CacheEntry, stats
from .compiler import Arch, resolve_arch
from .errors import (
    CUDADriverError,
    JITCompileError,
    JITError,
    NCCLHeadersError,
    NCCLVersionMismatchError,
    PtxasCheckError,
)
from .host import build_host_library, load_host_library
from .nccl_headers import NcclInstall, find_nccl
from .nccl_headers import check_versions as check_nccl_versions
from .nccl_headers import runtime_version as nccl_runtime_version
from .ninja_build import compile_many
from .spec import KernelSpec
from .torch_ext import build_torch_extension, load_torch_extension

# Names whose module imports cuda.bindings: loaded on first access (PEP 562).
_LAZY = {
    "Kernel": "deep_ep.jit.kernel",
    "get_kernel": "deep_ep.jit.kernel",
    "load_kernel": "deep_ep.jit.kernel",
    "measure_launch_overhead": "deep_ep.jit.kernel",
}

__all__ = [
    "F32",
    "F64",
    "I8",
    "I16",
    "I32",
    "I64",
    "U8",
    "U16",
    "U32",
    "U64",
    "Arch",
    "Bool",
    "CUDADriverError",
    "CacheEntry",
    "JITCompileError",
    "JITError",
    "Kernel",
    "KernelSpec",
    "NCCLHeadersError",
    "NCCLVersionMismatchError",
    "NcclInstall",
    "Opaque",
    "Pointer",
    "PtxasCheckError",
    "build_host_library",
    "build_torch_extension",
    "check_nccl_versions",
    "compile_many",
    "compile_spec",
    "find_nccl",
    "get_kernel",
    "load_host_library",
    "load_kernel",
    "load_torch_extension",
    "measure_launch_overhead",
    "nccl_runtime_version",
    "param_bytes",
    "plan_build",
    "resolve_arch",
    "stats",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deep_ep.jit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
