"""The NCCL host library: the copy already loaded in this process, bound with ctypes.

Torch loads libnccl when it is imported; a second, different libnccl in the same process would
own different communicators and symmetric memory, so we never load one of our own choosing while
another is mapped. Only the C API with stable signatures is bound here; the version-dependent
device-communicator structs go through the JIT-built shim (`deep_ep.backends.kernels.nccl.device_comm`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from deep_ep.errors import NCCLError

NCCL_WIN_COLL_SYMMETRIC = 0x01
# In nccl.h from 2.30.4: the window's VA signals are ordered after the puts before them (GIN needs it).
# Older releases have no such flag: it must never reach their `ncclCommWindowRegister`
NCCL_WIN_STRICT_ORDERING = 0x02
NCCL_WIN_STRICT_ORDERING_SINCE = 23004
NCCL_UNIQUE_ID_BYTES = 128


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclLibrary:
    """ctypes binding of the loaded libnccl; every call checks its result and raises `NCCLError`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        c_void_pp = ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "ncclGetVersion": [ctypes.POINTER(ctypes.c_int)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRank": [c_void_pp, ctypes.c_int, UniqueId, ctypes.c_int],
            "ncclCommDestroy": [ctypes.c_void_p],
            "ncclCommUserRank": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)],
            "ncclCommCount": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)],
            "ncclMemAlloc": [c_void_pp, ctypes.c_size_t],
            "ncclMemFree": [ctypes.c_void_p],
            "ncclCommWindowRegister": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, c_void_pp, ctypes.c_int],
            "ncclCommWindowDeregister": [ctypes.c_void_p, ctypes.c_void_p],
        }
        for name, argtypes in signatures.items():
            fn = getattr(self._lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self._lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        self._lib.ncclGetErrorString.restype = ctypes.c_char_p
        self._lib.ncclGetLastError.argtypes = [ctypes.c_void_p]
        self._lib.ncclGetLastError.restype = ctypes.c_char_p

    def check(self, result: int, what: str, comm: int | None = None) -> None:
        if result == 0:
            return
        message = self._lib.ncclGetErrorString(result).decode(errors="replace")
        detail = self._lib.ncclGetLastError(comm).decode(errors="replace") if comm else ""
        raise NCCLError(f"{what} failed: NCCL error {result} ({message}){': ' + detail if detail else ''}")

    def call(self, name: str, *args: object, comm: int | None = None) -> None:
        self.check(getattr(self._lib, name)(*args), name, comm)

    def version(self) -> int:
        """`ncclGetVersion()`: the `NCCL_VERSION_CODE` of this library, e.g. 23203 for 2.32.3."""
        code = ctypes.c_int()
        self.call("ncclGetVersion", ctypes.byref(code))
        return code.value


@functools.cache
def get_nccl_library() -> NcclLibrary:
    """Bind the libnccl already loaded in this process (torch's), else the installed wheel's.

    Raises `NCCLVersionMismatchError` when that library is not the release whose headers the JIT
    compiles against (device structs differ between releases).
    """
    import torch  # noqa: F401  (torch maps its libnccl at import: bind that very file)

    from deep_ep.jit.nccl_headers import check_versions

    install = check_versions()
    if install.lib_path is None:
        raise NCCLError(f"no libnccl next to the NCCL headers in {install.include_dir}")
    return NcclLibrary(install.lib_path)
