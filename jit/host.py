"""Build, cache and load a small host-side C++ shared library ("host shim").

Some host structs are version-dependent (NCCL's `ncclDevCommRequirements` and `ncclDevComm`
change size between releases), so code that fills them is compiled at run time against the
headers of the loaded libnccl, like the kernels. The shim is compiled by nvcc as a `.cpp` file
(host code only; nvcc adds the CUDA include folders and uses its host compiler) and linked
against the loaded libnccl by its full path, with an rpath to that folder; that libnccl is loaded
first (RTLD_GLOBAL), so at dlopen the shim binds to the very copy this process already uses.
Entries are cached with the same key scheme as kernels, under `host/<key>/`.
"""

from __future__ import annotations

import ctypes
import functools
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import cache, compiler, env
from .cache import CacheEntry
from .deps import headers_digest, included_headers
from .errors import JITCompileError, NCCLHeadersError
from .nccl_headers import check_versions, compile_only_root, find_nccl, load_library, tree_digest, version_string
from .spec import nccl_version_guard

KIND = "host"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_libraries: dict[tuple[object, ...], ctypes.CDLL] = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _host_compiler_version() -> str:
    """The version of the host compiler nvcc drives (`g++` on PATH): it shapes the binary too."""
    found = shutil.which("g++") or shutil.which("c++")
    if found is None:
        return "unknown"
    result = subprocess.run([found, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else "unknown"


def build_host_library(
    name: str,
    source: str,
    *,
    use_nccl: bool = True,
    include_dirs: Sequence[str | Path] = (),
    extra_flags: Sequence[str] = (),
    link_flags: Sequence[str] = (),
    std: str = "c++17",
    binary_name: str | None = None,
    key_extra: Mapping[str, object] | None = None,
) -> CacheEntry:
    """Compile `source` into `lib<name>.so` in the cache (or find it there); no GPU needed.

    Arguments:
        name: library name (an identifier), used for the file names.
        source: C++ source text; export functions with `extern "C"` to call them through ctypes.
        use_nccl: compile against the NCCL headers of the loaded libnccl and link it. A guard
            (`#error` unless `NCCL_VERSION_CODE` is the expected one) is prepended to the source.
        include_dirs: more `-I` folders (after the NCCL headers).
        extra_flags: more nvcc flags (part of the cache key).
        link_flags: more flags after the source (libraries; part of the cache key).
        std: the C++ standard.
        binary_name: the file name of the library (default `lib<name>.so`).
        key_extra: more facts the binary depends on (versions of what it links against). With it the
            headers of `include_dirs` are not digested: `key_extra` must name what they belong to.

    Returns:
        The cache entry; `entry.binary_path` is the shared library.

    Raises:
        JITCompileError: with the full command and stderr when the compile fails.
    """
    if not _NAME.match(name):
        raise ValueError(f"host library name {name!r} must be a C identifier")
    nvcc = compiler.find_nvcc()
    nccl = find_nccl() if use_nccl else None
    full_source = (nccl_version_guard(nccl.header_version) if nccl else "") + source
    flags = [f"-std={std}", "-O2", "-shared", "-Xcompiler", "-fPIC", *extra_flags]
    link: list[str] = list(link_flags)
    if nccl is not None:
        if nccl.lib_path is None:
            raise JITCompileError(f"host library {name}: no libnccl next to {nccl.include_dir} to link against")
        link += ["-Xlinker", str(nccl.lib_path), "-Xlinker", "-rpath", "-Xlinker", str(nccl.lib_path.parent)]
    dirs = [str(Path(d).resolve()) for d in include_dirs]
    facts: dict[str, object] = {}
    if key_extra is not None or link_flags or binary_name is not None:  # (absent: the keys of plain shims stay)
        facts = {"extra": None if key_extra is None else dict(key_extra), "link": link, "binary": binary_name}
    key = cache.make_key(
        {
            **facts,
            "kind": KIND,
            "name": name,
            "source": full_source,
            "headers": headers_digest(included_headers(full_source, dirs), dirs) if key_extra is None else None,
            "nccl": None
            if nccl is None
            else {"version": nccl.header_version, "tree": tree_digest(nccl.include_dir), "lib": str(nccl.lib_path)},
            "flags": flags,
            "nvcc": compiler.nvcc_version(nvcc),
            "host_compiler": _host_compiler_version(),
        }
    )
    entry = cache.lookup(KIND, key)
    if entry is not None:
        cache.count("hit")
        env.debug(f"cache hit host library {name} {key[:16]}")
        return entry
    cache.count("miss")
    build_dir = cache.new_build_dir()
    source_path = build_dir / f"{name}.cpp"
    source_path.write_text(full_source)
    binary = binary_name or f"lib{name}.so"
    includes = compiler.include_flags(dirs, nccl.include_dir if nccl else None)
    command = [str(nvcc), *includes, *flags, "-o", str(build_dir / binary), str(source_path), *link]
    started = time.perf_counter()
    try:
        compiler.run_compiler(command, f"host library {name}", full_source)
    except JITCompileError:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise
    cache.count("compile")
    seconds = time.perf_counter() - started
    cache.write_metadata(
        build_dir,
        KIND,
        key,
        binary,
        {
            "name": name,
            "nvcc": str(nvcc),
            "nvcc_release": compiler.nvcc_release(nvcc),
            "nccl_version": None if nccl is None else version_string(nccl.header_version),
            "nccl_lib": None if nccl is None else str(nccl.lib_path),
            "flags": flags,
            "command": command,
            "compile_seconds": round(seconds, 3),
        },
    )
    entry = cache.publish(build_dir, KIND, key)
    env.debug(f"compiled host library {name} in {seconds:.2f} s -> {entry.path}")
    return entry


def load_host_library(
    name: str,
    source: str,
    *,
    use_nccl: bool = True,
    include_dirs: Sequence[str | Path] = (),
    extra_flags: Sequence[str] = (),
) -> ctypes.CDLL:
    """Build (or find in the cache) and load a host shim; memoized per process.

    Arguments are those of `build_host_library`. With `use_nccl`, the NCCL headers and the loaded
    libnccl must be the same release (checked), and libnccl is loaded before the shim so the shim
    binds to it.

    Returns:
        The loaded library (`ctypes.CDLL`); set `restype`/`argtypes` of its functions before use.

    Raises:
        JITCompileError: when the compile fails.
        NCCLVersionMismatchError: when NCCL headers and library differ.
        NCCLHeadersError: when `EP_JIT_NCCL_ROOT` (compile only) is set.
    """
    if use_nccl and compile_only_root() is not None:
        raise NCCLHeadersError(
            f"host library {name}: {env.NCCL_ROOT} is set, which is for compiling only (the NCCL it names is not the "
            "libnccl this process may load); unset it to load NCCL shims"
        )
    memo = (name, source, use_nccl, tuple(map(str, include_dirs)), tuple(extra_flags))
    with _lock:
        library = _libraries.get(memo)
        if library is None:
            if use_nccl:
                install = check_versions(find_nccl())
                load_library(install)
            # A `clear()` of the cache between the build and the load takes the file away: build again
            for attempt in range(3):
                entry = build_host_library(
                    name, source, use_nccl=use_nccl, include_dirs=include_dirs, extra_flags=extra_flags
                )
                try:
                    library = ctypes.CDLL(str(entry.binary_path))
                    break
                except OSError:
                    if entry.binary_path.exists() or attempt == 2:
                        raise
            _libraries[memo] = library
    return library
