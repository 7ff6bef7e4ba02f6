"""The NCCL device communicator (`ncclDevComm`), created through a JIT-built host shim.

`ncclDevCommRequirements` and `ncclDevComm` change size and fields between NCCL releases (2.28 has
no initializer macro, 2.29+ requires `NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER`), so the shim is
compiled against the headers of the loaded NCCL and hands the struct back as raw bytes, which the
kernels receive by value. A group of one node requests LSA resources only: asking for GIN on a
machine without a NIC fails and poisons the communicator for every later device-communicator
creation. GIN contexts (`gin_requirements`, for peers on other nodes) are requested only on a
communicator of our own. The requirements are built as bytes first and checked field by field
against an untouched struct (`gin_fields_set`) before they reach `ncclDevCommCreate`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

from deep_ep.errors import NCCLError

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
// the fields that 2.28.9 lacks come last, and only where these headers are known to have them
// (2.30.4 has all but `ginType`, 2.31.2 and 2.32.3 all).
#define EP_FIELD(name) offsetof(ncclDevCommRequirements, name), sizeof(ncclDevCommRequirements::name)
extern "C" int ep_dev_comm_gin_fields(long long* out) {
    const size_t fields[] = {
        EP_FIELD(resourceRequirementsList), EP_FIELD(teamRequirementsList), EP_FIELD(barrierCount),
        EP_FIELD(railGinBarrierCount), EP_FIELD(ginForceEnable), EP_FIELD(ginContextCount),
        EP_FIELD(ginSignalCount), EP_FIELD(ginCounterCount),
#if NCCL_VERSION_CODE >= 23004
        EP_FIELD(ginConnectionType), EP_FIELD(ginExclusiveContexts), EP_FIELD(ginQueueDepth),
        EP_FIELD(worldGinBarrierCount),
#endif
#if NCCL_VERSION_CODE >= 23102
        EP_FIELD(ginType),
#endif
    };
    const int num_fields = static_cast<int>(sizeof(fields) / sizeof(fields[0]) / 2);
    for (int i = 0; i < 2 * num_fields; ++i) out[i] = static_cast<long long>(fields[i]);
    return num_fields;
}

extern "C" int ep_dev_comm_lsa_barrier_count_offset() {
    return static_cast<int>(offsetof(ncclDevCommRequirements, lsaBarrierCount));
}

// GIN (scale-out) from 2.30.4 on, DeepEP V2's floor: below it these headers lack the GIN connection
// fields and ncclCommQueryProperties, and both functions below answer -1
#if NCCL_VERSION_CODE >= 23004
static_assert(NCCL_GIN_TYPE_NONE == 0 && NCCL_GIN_TYPE_PROXY == 2 && NCCL_GIN_TYPE_GDAKI == 3, "gin.py's type ids");
static_assert(NCCL_GIN_CONNECTION_FULL == 1 && NCCL_GIN_CONNECTION_RAIL == 2, "gin.py's connection ids");
#endif

// Ours across nodes: the LSA barriers of one node, `num_contexts` exclusive GIN contexts (one per
// QP) on a FULL (direct) or RAIL (hybrid) connection, and nothing else: no GIN signals or counters
// (VA signals into our window only), no NCCL barriers (our credits and arrivals replace them), the
// default queue depth
extern "C" int ep_dev_comm_gin_requirements(int lsa_barrier_count, int num_contexts, int connection, void* out) {
#if NCCL_VERSION_CODE >= 23004
    ncclDevCommRequirements reqs;
    ep_baseline(&reqs);
    reqs.lsaBarrierCount = lsa_barrier_count;
    reqs.ginContextCount = num_contexts;
    reqs.ginExclusiveContexts = true;
    reqs.ginConnectionType = static_cast<ncclGinConnectionType_t>(connection);
    std::memcpy(out, &reqs, sizeof(reqs));
    return 0;
#else
    (void)lsa_barrier_count, (void)num_contexts, (void)connection, (void)out;
    return -1;
#endif
}

// What NCCL says of GIN on `comm` (a query, never a try): out[0] device API support, out[1] the
// GIN type it would use, out[2] LSA teams, out[3] the bit mask of supported GIN types (-1 where
// these headers have no `ginSupport`, before 2.31.2). Returns the ncclResult_t, or -1 below 2.30.4.
extern "C" int ep_comm_gin_properties(ncclComm_t comm, int* out) {
#if NCCL_VERSION_CODE >= 23004
    ncclCommProperties_t props = NCCL_COMM_PROPERTIES_INITIALIZER;
    const ncclResult_t result = ncclCommQueryProperties(comm, &props);
    if (result != ncclSuccess) return static_cast<int>(result);
    out[0] = props.deviceApiSupport ? 1 : 0;
    out[1] = static_cast<int>(props.ginType);
    out[2] = props.nLsaTeams;
    out[3] = -1;
#if NCCL_VERSION_CODE >= 23102
    out[3] = 0;
    for (int type = 0; type < 31; ++type)
        if (props.ginSupport[type]) out[3] |= 1 << type;
#endif
    return 0;
#else
    (void)comm, (void)out;
    return -1;
#endif
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
# headers older than 2.30.4 report the first eight only, older than 2.31.2 the first twelve
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
    lib.ep_dev_comm_gin_requirements.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.ep_comm_gin_properties.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
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


# `ncclGinConnectionType_t` per mode (the shim asserts the values): direct mode connects every peer,
# hybrid mode only rail peers (the same local rank on every node)
GIN_CONNECTIONS = {"direct": 1, "hybrid": 2}
# The GIN fields our GIN requirements set; every other one of `GIN_FIELDS` stays as NCCL's initializer has it
GIN_REQUIREMENT_FIELDS = ("ginContextCount", "ginConnectionType", "ginExclusiveContexts")


def gin_requirements(num_contexts: int, mode: str = "direct", lsa_barrier_count: int = 1) -> bytes:
    """The `ncclDevCommRequirements` of a buffer that reaches peers outside its node by GIN, as bytes:
    LSA barriers as for one node, `num_contexts` exclusive GIN contexts (one per QP: the buffer's
    `num_allocated_qps`), the connection of `mode`, and no GIN signal, counter or barrier.

    Raises:
        ValueError: for `num_contexts < 1` or an unknown `mode`.
        NCCLError: when the NCCL headers are older than 2.30.4 (no GIN connection fields).
        RuntimeError: when the struct sets a GIN field outside `GIN_REQUIREMENT_FIELDS`.
    """
    if isinstance(num_contexts, bool) or not isinstance(num_contexts, int) or num_contexts < 1:
        raise ValueError(f"gin_requirements: `num_contexts` must be an int >= 1 (one per QP), got {num_contexts!r}")
    if mode not in GIN_CONNECTIONS:
        raise ValueError(f"gin_requirements: `mode` must be one of {tuple(GIN_CONNECTIONS)}, got {mode!r}")
    shim = _shim()
    storage = (ctypes.c_byte * int(shim.ep_dev_comm_requirements_bytes()))()
    if shim.ep_dev_comm_gin_requirements(lsa_barrier_count, num_contexts, GIN_CONNECTIONS[mode],
                                         ctypes.addressof(storage)) != 0:  # fmt: skip
        raise NCCLError("gin_requirements: these NCCL headers are older than 2.30.4 and have no GIN connection fields")
    requirements = bytes(storage)
    unexpected = [name for name in gin_fields_set(requirements) if name not in GIN_REQUIREMENT_FIELDS]
    if unexpected:
        raise RuntimeError(f"gin_requirements: GIN requirements set {unexpected}, outside {GIN_REQUIREMENT_FIELDS}")
    return requirements


class DeviceCommunicator:
    """An `ncclDevComm` for `comm`, kept as the raw bytes kernels take by value: LSA only, or with
    GIN contexts for peers outside the node.

    Arguments:
        comm: the host communicator; creation is collective over its ranks.
        lsa_barrier_count: NCCL LSA barriers to reserve (our kernels synchronise through the
            window's own semaphores, so 1 is enough).
        gin_contexts: GIN contexts to request (`0`: none, the requirements of one node); only on a
            communicator of our own (`comm.is_own`): a failed GIN setup leaves a communicator
            unusable, and torch's is not ours to lose.
        gin_mode: `'direct'` or `'hybrid'` (`GIN_CONNECTIONS`), with `gin_contexts`.

    Raises:
        ValueError: for GIN contexts on a borrowed communicator (before any NCCL call).
    """

    def __init__(self, comm: Communicator, lsa_barrier_count: int = 1, gin_contexts: int = 0,
                 gin_mode: str = "direct") -> None:  # fmt: skip
        if gin_contexts and not comm.is_own:
            raise ValueError(
                "DeviceCommunicator: GIN contexts need a communicator of our own (Communicator(group, "
                "force_own=True)), got torch's: a failed GIN setup would leave it unusable"
            )
        shim = _shim()
        self.comm = comm
        if gin_contexts:
            requirements = gin_requirements(gin_contexts, gin_mode, lsa_barrier_count)
        else:
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
