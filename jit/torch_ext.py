"""Build, cache and import a Python extension module written against torch's C++ API.

For host code whose every microsecond counts (a launch sequence called thousands of times per
second), a call from Python into C++ that takes torch tensors directly beats a chain of torch and
driver calls from Python. The module is compiled like a host shim (`deep_ep.jit.host`: nvcc drives
the host compiler, the CUDA headers are on the path) against the headers and libraries of the torch
this process imported, and cached under `host/` with the torch version, the Python ABI and the
compilers in its key. No GPU is needed to build it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

from .cache import CacheEntry
from .errors import JITCompileError
from .host import build_host_library

_modules: dict[tuple[str, str], ModuleType] = {}
_lock = threading.Lock()


def _torch_build_facts() -> tuple[list[str], list[str], dict[str, object]]:
    """Include folders, link flags and cache-key facts of the imported torch and Python."""
    import torch

    torch_dir = Path(torch.__file__).parent
    python_include = sysconfig.get_paths()["include"]
    if not (Path(python_include) / "Python.h").exists():
        raise JITCompileError(
            f"torch extension: no Python.h in {python_include}; install this Python's development headers (python3-dev)"
        )
    includes = [str(torch_dir / "include"), str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
                python_include]  # fmt: skip
    lib = torch_dir / "lib"
    link = [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-Xlinker", "-rpath", "-Xlinker", str(lib)]
    facts = {
        "torch": torch.__version__,
        "torch_dir": str(torch_dir),
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": sys.version,
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    }
    return includes, link, facts


def build_torch_extension(name: str, source: str) -> CacheEntry:
    """Compile `source` into the extension module `name` (or find it in the cache).

    Arguments:
        name: the module name; `source` must define `PyInit_<name>`.
        source: C++ source text (C++20) that may include `<Python.h>`, torch's headers and `<cuda.h>`.

    Returns:
        The cache entry; `entry.binary_path` is the module's shared library.

    Raises:
        JITCompileError: when Python's headers are missing or the compile fails.
    """
    import torch

    includes, link, facts = _torch_build_facts()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    # torch's headers warn by the hundred under nvcc's host pass; the errors stay
    flags = ["-Xcompiler", "-w", abi, "-DTORCH_API_INCLUDE_EXTENSION_H"]
    return build_host_library(name, source, use_nccl=False, include_dirs=includes, extra_flags=flags,
                              link_flags=link, std="c++20", binary_name=f"{name}{suffix}", key_extra=facts)  # fmt: skip


def load_torch_extension(name: str, source: str) -> ModuleType:
    """Build (or find in the cache) and import the extension module `name`; memoized per process.

    Raises:
        JITCompileError: when Python's headers are missing or the compile fails.
        ImportError: when the built module cannot be loaded.
    """
    memo = (name, source)
    with _lock:
        module = _modules.get(memo)
        if module is None:
            entry = build_torch_extension(name, source)
            loader = importlib.machinery.ExtensionFileLoader(name, str(entry.binary_path))
            spec = importlib.util.spec_from_file_location(name, str(entry.binary_path), loader=loader)
            if spec is None:
                raise ImportError(f"torch extension {name}: cannot load {entry.binary_path}")
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            _modules[memo] = module
    return module
