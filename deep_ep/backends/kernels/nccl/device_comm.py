"""The NCCL device communicator (`ncclDevComm`), created through a JIT-built host shim.

`ncclDevCommRequirements` and `ncclDevComm` change size and fields between NCCL releases (2.28 has
no initializer macro, 2.29+ requires `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER`), so the shim is
compiled against the headers of the loaded NCCL and hands the struct back as raw bytes, which the
kernels receive by value. Only LSA resources are requested: asking for GIN on a machine without a
NIC fails and poisons the communicator for every later device-communicator creation.
"""

from __future__ import annotations

import ctypes
import functools

from .communicator import Communicator

_SHIM_SOURCE = r"""
#include <cstring>
#include <nccl.h>
#include <nccl_device.h>

extern "C" int ep_dev_comm_bytes() { return static_cast<int>(sizeof(ncclDevComm)); }

extern "C" int ep_dev_comm_create(ncclComm_t comm, int lsa_barrier_count, void* out, int* lsa_rank, int* lsa_size) {
#if NCCL_VERSION_CODE >= 22900
    ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));
#endif
    // LSA only: barrierCount implies GIN from 2.29.4 on, so it stays zero
    reqs.lsaBarrierCount = lsa_barrier_count;
    ncclDevComm dev_comm;
    std::memset(&dev_comm, 0, sizeof(dev_comm));
    const ncclResult_t result = ncclDevCommCreate(comm, &reqs, &dev_comm);
    if (result != ncclSuccess) return static_cast<int>(result);
    std::memcpy(out, &dev_comm, sizeof(dev_comm));
    *lsa_rank = dev_comm.lsaRank;
    *lsa_size = dev_comm.lsaSize;
    return 0;
}

extern "C" int ep_dev_comm_destroy(ncclComm_t comm, const void* bytes) {
    ncclDevComm dev_comm;
    std::memcpy(&dev_comm, bytes, sizeof(dev_comm));
    return static_cast<int>(ncclDevCommDestroy(comm, &dev_comm));
}
"""


@functools.cache
def _shim() -> ctypes.CDLL:
    from deep_ep.jit import load_host_library

    lib = load_host_library("deep_ep_nccl_shim", _SHIM_SOURCE, use_nccl=True)
    lib.ep_dev_comm_create.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.ep_dev_comm_destroy.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


class DeviceCommunicator:
    """An LSA-only `ncclDevComm` for `comm`, kept as the raw bytes kernels take by value.

    Arguments:
        comm: the host communicator; creation is collective over its ranks.
        lsa_barrier_count: NCCL LSA barriers to reserve (our kernels synchronise through the
            window's own semaphores, so 1 is enough).
    """

    def __init__(self, comm: Communicator, lsa_barrier_count: int = 1) -> None:
        shim = _shim()
        self.comm = comm
        self.num_bytes = int(shim.ep_dev_comm_bytes())
        self._storage = (ctypes.c_byte * self.num_bytes)()
        lsa_rank, lsa_size = ctypes.c_int(), ctypes.c_int()
        comm.lib.check(
            shim.ep_dev_comm_create(
                ctypes.c_void_p(comm.handle),
                lsa_barrier_count,
                ctypes.addressof(self._storage),
                ctypes.byref(lsa_rank),
                ctypes.byref(lsa_size),
            ),
            "ncclDevCommCreate",
            comm.handle,
        )
        self.lsa_rank, self.lsa_size = lsa_rank.value, lsa_size.value
        self.alive = True

    @property
    def raw(self) -> bytes:
        """The `ncclDevComm` struct bytes, to pass by value to a kernel."""
        return bytes(self._storage)

    def destroy(self) -> None:
        """Release the device communicator; idempotent."""
        if self.alive:
            self.comm.lib.check(
                _shim().ep_dev_comm_destroy(ctypes.c_void_p(self.comm.handle), ctypes.addressof(self._storage)),
                "ncclDevCommDestroy",
                self.comm.handle,
            )
            self.alive = False
