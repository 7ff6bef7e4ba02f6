"""The NCCL device communicator (`ncclDevComm`), created through a JIT-built host shim.

`ncclDevCommRequirements` and `ncclDevComm` change size and fields between NCCL releases (2.28 has
no initializer macro, 2.29+ requires `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER`), so the shim is
compiled against the headers of the loaded NCCL and hands the struct back as raw bytes, which the
kernels receive by value. Only LSA resources are requested: asking for GIN on a machine without a
NIC fails and poisons the communicator for every later device-communicator creation. The
requirements are built as bytes first and checked field by field against an untouched struct
(`gin_fields_set`) before they reach `ncclDevCommCreate`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

from .communicator import Communicator

_SHIM_SOURCE = r"""
#include <cstddef>
#include <cstring>
#include <nccl.h>
#include <nccl_device.h>

// What an untouched requirements struct holds: the initializer's values (2.29+), else zeros.
static void ep_baseline(ncclDevCommRequirements* reqs) {
#if NCCL_VERSION_CODE >= 22900
    ncclDevCommRequirements initial = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
    *reqs = initial;
#else
    std::memset(reqs, 0, sizeof(*reqs));
#endif
}

extern "C" int ep_dev_comm_bytes() { return static_cast<int>(sizeof(ncclDevComm)); }
extern "C" int ep_dev_comm_requirements_bytes() { return static_cast<int>(sizeof(ncclDevCommRequirements)); }

extern "C" void ep_dev_comm_requirements_baseline(void* out) {
    ncclDevCommRequirements reqs;
    ep_baseline(&reqs);
    std::memcpy(out, &reqs, sizeof(reqs));
}

// Ours: LSA only. `barrierCount` implies GIN from 2.29.4 on, so it stays as it is.
extern "C" void ep_dev_comm_requirements(int lsa_barrier_count, void* out) {
    ncclDevCommRequirements reqs;
    ep_baseline(&reqs);
    reqs.lsaBarrierCount = lsa_barrier_count;
    std::memcpy(out, &reqs, sizeof(reqs));
}

// [offset, size] of every field that requests or implies GIN, in the order of GIN_FIELDS (Python);
// the fields that 2.28.9 lacks come last, and only where these headers are known to have them.
#define EP_FIELD(name) offsetof(ncclDevCommRequirements, name), sizeof(ncclDevCommRequirements::name)
extern "C" int ep_dev_comm_gin_fields(long long* out) {
    const size_t fields[] = {
        EP_FIELD(resourceRequirementsList), EP_FIELD(teamRequirementsList), EP_FIELD(barrierCount),
        EP_FIELD(railGinBarrierCount), EP_FIELD(ginForceEnable), EP_FIELD(ginContextCount),
        EP_FIELD(ginSignalCount), EP_FIELD(ginCounterCount),
#if NCCL_VERSION_CODE >= 23200
        EP_FIELD(ginConnectionType), EP_FIELD(ginExclusiveContexts), EP_FIELD(ginQueueDepth),
        EP_FIELD(worldGinBarrierCount), EP_FIELD(ginType),
#endif
    };
    const int num_fields = static_cast<int>(sizeof(fields) / sizeof(fields[0]) / 2);
    for (int i = 0; i < 2 * num_fields; ++i) out[i] = static_cast<long long>(fields[i]);
    return num_fields;
}

extern "C" int ep_dev_comm_lsa_barrier_count_offset() {
    return static_cast<int>(offsetof(ncclDevCommRequirements, lsaBarrierCount));
}

extern "C" int ep_dev_comm_create(ncclComm_t comm, const void* requirements, void* out, int* lsa_rank, int* lsa_size) {
    ncclDevCommRequirements reqs;
    std::memcpy(&reqs, requirements, sizeof(reqs));
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

# The `ncclDevCommRequirements` fields that request GIN or imply it (`ep_dev_comm_gin_fields`);
# headers older than 2.32 report the first eight only
GIN_FIELDS = (
    "resourceRequirementsList", "teamRequirementsList", "barrierCount", "railGinBarrierCount", "ginForceEnable",
    "ginContextCount", "ginSignalCount", "ginCounterCount", "ginConnectionType", "ginExclusiveContexts",
    "ginQueueDepth", "worldGinBarrierCount", "ginType",
)  # fmt: skip


@functools.cache
def _shim() -> ctypes.CDLL:
    from deep_ep.jit import load_host_library

    lib = load_host_library("deep_ep_nccl_shim", _SHIM_SOURCE, use_nccl=True)
    lib.ep_dev_comm_requirements_baseline.argtypes = [ctypes.c_void_p]
    lib.ep_dev_comm_requirements.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.ep_dev_comm_gin_fields.argtypes = [ctypes.POINTER(ctypes.c_longlong)]
    lib.ep_dev_comm_create.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.ep_dev_comm_destroy.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _struct_bytes(fill: Callable[[ctypes.Array], None]) -> bytes:
    storage = (ctypes.c_byte * int(_shim().ep_dev_comm_requirements_bytes()))()
    fill(storage)
    return bytes(storage)


def baseline_requirements() -> bytes:
    """An untouched `ncclDevCommRequirements` of the loaded headers, as bytes."""
    return _struct_bytes(lambda storage: _shim().ep_dev_comm_requirements_baseline(ctypes.addressof(storage)))


def lsa_requirements(lsa_barrier_count: int) -> bytes:
    """The `ncclDevCommRequirements` our buffers pass to `ncclDevCommCreate`, as bytes: LSA barriers only."""
    return _struct_bytes(lambda storage: _shim().ep_dev_comm_requirements(lsa_barrier_count, ctypes.addressof(storage)))


def gin_fields_set(requirements: bytes) -> list[str]:
    """The GIN fields (`GIN_FIELDS`) of `requirements` that differ from an untouched struct. Any of
    them makes NCCL connect GIN (on 2.28.9 a communicator without a NIC is then unusable), so a
    group of one NVLink domain must pass none."""
    offsets = (ctypes.c_longlong * (2 * len(GIN_FIELDS)))()
    num_fields = _shim().ep_dev_comm_gin_fields(offsets)
    baseline = baseline_requirements()
    changed = []
    for i, name in enumerate(GIN_FIELDS[:num_fields]):
        begin, size = offsets[2 * i], offsets[2 * i + 1]
        if requirements[begin : begin + size] != baseline[begin : begin + size]:
            changed.append(name)
    return changed


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
        requirements = lsa_requirements(lsa_barrier_count)
        gin_fields = gin_fields_set(requirements)
        if gin_fields:
            raise RuntimeError(f"DeviceCommunicator: LSA requirements set GIN fields {gin_fields}")
        self.num_bytes = int(shim.ep_dev_comm_bytes())
        self._storage = (ctypes.c_byte * self.num_bytes)()
        lsa_rank, lsa_size = ctypes.c_int(), ctypes.c_int()
        comm.lib.check(
            shim.ep_dev_comm_create(
                ctypes.c_void_p(comm.handle),
                requirements,
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
