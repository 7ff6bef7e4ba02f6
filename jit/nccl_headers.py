"""Find the NCCL headers that match the libnccl this process uses, and check their versions.

The device structs of NCCL (`ncclDevComm`, ...) change size between releases, so kernels and host
shims must be compiled against the headers of the *loaded* library. Where we look, in order:

1. a libnccl already mapped into this process (`/proc/self/maps`; torch maps one on import):
   its folder's sibling `../include` (the wheel layout `nvidia/nccl/{lib,include}`);
2. the installed `nvidia-nccl-cu13` / `nvidia-nccl-cu12` wheel (the `nvidia.nccl` package folder).

`EP_JIT_NCCL_ROOT` (compile only) overrides both with the `nvidia/nccl` folder of another release,
so that CI can compile every kernel and shim against several NCCL versions; nothing built so may
be loaded (`deep_ep.jit.host.load_host_library` refuses), since this process runs another libnccl.

We never fall back to a system NCCL (`/usr/include/nccl.h`): if neither is found, that is an error.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from . import env
from .errors import NCCLHeadersError, NCCLVersionMismatchError

_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
_LIBNCCL = re.compile(r"/libnccl\.so(\.\d+)*$")
_VERSION_CODE = re.compile(r"^\s*#\s*define\s+NCCL_VERSION_CODE\s+(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class NcclInstall:
    """Where the NCCL headers and library are.

    Attributes:
        include_dir: folder holding `nccl.h`, `nccl_device.h` and `nccl_device/`.
        lib_path: the libnccl shared library that goes with it (`None` if the wheel has none).
        origin: how it was found: `"loaded"` (mapped in this process) or `"wheel <dist> <version>"`.
        header_version: `NCCL_VERSION_CODE` of `include_dir/nccl.h`, e.g. 22809 for 2.28.9.
    """

    include_dir: Path
    lib_path: Path | None
    origin: str
    header_version: int


def version_string(code: int) -> str:
    """Turn an `NCCL_VERSION_CODE` into `major.minor.patch` (e.g. 22809 -> `2.28.9`)."""
    # NCCL_VERSION(X,Y,Z) is X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after.
    if code < 20900:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def parse_version_code(nccl_h: Path) -> int:
    """Return the `NCCL_VERSION_CODE` that `nccl_h` defines.

    Raises:
        NCCLHeadersError: when the file has no such define.
    """
    match = _VERSION_CODE.search(nccl_h.read_text(errors="replace"))
    if match is None:
        raise NCCLHeadersError(f"{nccl_h} does not define NCCL_VERSION_CODE")
    return int(match.group(1))


def loaded_libraries() -> list[Path]:
    """Return the libnccl files mapped into this process, in first-mapped order, deduplicated."""
    found: list[Path] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if _LIBNCCL.search(path):
                    resolved = Path(path)
                    if resolved not in found:
                        found.append(resolved)
    except OSError:  # not Linux, or /proc not mounted: only the wheel lookup remains
        pass
    return found


def wheel_distribution() -> tuple[str, str] | None:
    """Return (distribution name, version) of the installed NCCL wheel, or `None`."""
    for name in _WHEELS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _wheel_root() -> Path | None:
    """The `nvidia/nccl` folder of the installed wheel (it holds `include/` and `lib/`)."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        if (Path(location) / "include" / "nccl.h").is_file():
            return Path(location)
    return None


def _from_loaded(lib: Path) -> NcclInstall | None:
    include_dir = lib.parent.parent / "include"
    if not (include_dir / "nccl.h").is_file():
        return None
    return NcclInstall(include_dir.resolve(), lib, "loaded", parse_version_code(include_dir / "nccl.h"))


def _install_at(root: Path, origin: str) -> NcclInstall:
    """The install of an `nvidia/nccl` folder: `include/`, and the library in `lib/` if there is one."""
    include_dir = (root / "include").resolve()
    libs = sorted((root / "lib").glob("libnccl.so*"))
    return NcclInstall(
        include_dir, libs[0].resolve() if libs else None, origin, parse_version_code(include_dir / "nccl.h")
    )


def _from_wheel() -> NcclInstall | None:
    root = _wheel_root()
    if root is None:
        return None
    dist = wheel_distribution()
    return _install_at(root, f"wheel {dist[0]} {dist[1]}" if dist else "wheel nvidia.nccl")


def compile_only_root() -> Path | None:
    """The `EP_JIT_NCCL_ROOT` folder when it is set (compile only), else `None`."""
    configured = env.value(env.NCCL_ROOT)
    return None if configured is None else Path(configured).expanduser().resolve()


def _from_override(root: Path) -> NcclInstall:
    if not (root / "include" / "nccl.h").is_file():
        raise NCCLHeadersError(f"{env.NCCL_ROOT}={root}: no include/nccl.h there (give the nvidia/nccl folder)")
    return _install_at(root, f"{env.NCCL_ROOT} {root} (compile only)")


_lock = threading.Lock()
_cached: NcclInstall | None = None


def find_nccl() -> NcclInstall:
    """Return the NCCL headers (and library) to compile against; see the module docstring.

    The answer is remembered once it comes from a loaded library; a wheel answer is re-checked on
    the next call, in case a library (e.g. torch's) was loaded since.

    Raises:
        NCCLHeadersError: when neither a loaded libnccl with headers nor an NCCL wheel is found.
    """
    global _cached
    override = compile_only_root()
    if override is not None:
        return _from_override(override)
    with _lock:
        if _cached is not None and _cached.origin == "loaded":
            return _cached
        for lib in loaded_libraries():
            install = _from_loaded(lib)
            if install is not None:
                _cached = install
                return install
        install = _from_wheel()
        if install is None:
            loaded = ", ".join(map(str, loaded_libraries())) or "none"
            raise NCCLHeadersError(
                "NCCL headers not found: no libnccl loaded in this process has a sibling include/ folder "
                f"(loaded: {loaded}) and no NCCL wheel is installed; install `nvidia-nccl-cu13` (CUDA 13) or "
                "`nvidia-nccl-cu12` (CUDA 12). A system NCCL (/usr/include) is never used."
            )
        _cached = install
        return install


@functools.lru_cache(maxsize=8)
def _load_library(path: str) -> ctypes.CDLL:
    # RTLD_GLOBAL so host shims that need libnccl.so.2 bind to this very copy at dlopen time.
    return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def load_library(install: NcclInstall | None = None) -> ctypes.CDLL:
    """dlopen the libnccl of `install` (default `find_nccl()`); a no-op if it is already loaded.

    Raises:
        NCCLHeadersError: when the install has no library file.
    """
    install = install or find_nccl()
    if install.lib_path is None:
        raise NCCLHeadersError(f"no libnccl next to the NCCL headers in {install.include_dir}")
    return _load_library(str(install.lib_path))


def runtime_version(install: NcclInstall | None = None) -> int:
    """Return `ncclGetVersion()` of the loaded libnccl (loading the wheel's one if none is).

    Raises:
        NCCLHeadersError: when there is no library to ask, or `ncclGetVersion` fails.
    """
    library = load_library(install)
    version = ctypes.c_int(0)
    result = library.ncclGetVersion(ctypes.byref(version))
    if result != 0:
        raise NCCLHeadersError(f"ncclGetVersion failed with ncclResult_t {result}")
    return version.value


def check_versions(install: NcclInstall | None = None) -> NcclInstall:
    """Check that the NCCL headers and the loaded libnccl are the same release.

    Returns:
        The checked install.

    Raises:
        NCCLVersionMismatchError: naming both versions and both paths when they differ.
    """
    install = install or find_nccl()
    runtime = runtime_version(install)
    if runtime != install.header_version:
        raise NCCLVersionMismatchError(
            f"NCCL headers {version_string(install.header_version)} ({install.include_dir}) do not match the "
            f"loaded libnccl {version_string(runtime)} ({install.lib_path}); device structs differ between "
            "releases, so kernels built against these headers would misread them"
        )
    return install


@functools.lru_cache(maxsize=8)
def tree_digest(include_dir: Path) -> str:
    """sha256 over every file below the NCCL include folder (names and contents), once per process."""
    digest = hashlib.sha256()
    for path in sorted(p for p in include_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(include_dir)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()
