"""NCCL GIN for scale-out, on the host: the NCCL release it needs, and what NCCL says of GIN on a
communicator (`ncclCommQueryProperties`: a query, never a try, since a failed GIN setup leaves a
communicator unusable). The device-communicator requirements are in `device_comm.gin_requirements`.

Compiled against NCCL 2.30.4, 2.31.2 and 2.32.3 in CI, with the kernels' GIN transport (transport/gin.cuh)
and its host side (`gin_windows`, `gin_links`). No machine here has an RDMA NIC: nothing in this module
has talked to one.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from deep_ep.errors import NCCLError
from deep_ep.jit.nccl_headers import version_string

from .communicator import Communicator
from .device_comm import _shim

# DeepEP V2's floor for scale-out, and the release vLLM and SGLang check for
GIN_FLOOR = (2, 30, 4)
# `ncclGinType_t` (the shim asserts the first three)
GIN_TYPES = {0: "none", 2: "proxy", 3: "gdaki", 4: "gpi", 5: "efa_gda"}


def version_tuple(code: int) -> tuple[int, int, int]:
    """`NCCL_VERSION_CODE` -> `(major, minor, patch)`, e.g. 22809 -> (2, 28, 9)."""
    major, minor, patch = (int(part) for part in version_string(code).split("."))
    return major, minor, patch


def scale_out_version_error(code: int) -> str | None:
    """Why NCCL `code` (the loaded libnccl's `ncclGetVersion`) cannot carry a group across hosts, or
    `None` when it can: below 2.30.4 there is no GIN with VA signals."""
    if version_tuple(code) >= GIN_FLOOR:
        return None
    floor = ".".join(map(str, GIN_FLOOR))
    return (
        f"a group across hosts needs NCCL >= {floor} (GIN with VA signals; DeepEP V2's floor), but this process "
        f"loaded NCCL {version_string(code)}: install a newer one with `pip install -U nvidia-nccl-cu12` (CUDA 12) "
        "or `pip install -U nvidia-nccl-cu13` (CUDA 13), or pass backend='reference' (torch collectives)"
    )


@dataclass(frozen=True)
class GinProperties:
    """What NCCL says of GIN on one communicator.

    Attributes:
        device_api: NCCL's device API works on it.
        gin_type: the GIN backend NCCL would use (`GIN_TYPES`: `'none'`, `'proxy'`, `'gdaki'`, ...).
        num_lsa_teams: its LSA teams (NVLink domains): one per node.
        supported: every GIN type NCCL supports there (from 2.31.2), else `None`.
    """

    device_api: bool
    gin_type: str
    num_lsa_teams: int
    supported: tuple[str, ...] | None

    @classmethod
    def from_words(cls, words: tuple[int, int, int, int]) -> GinProperties:
        """From the shim's four words: device API, GIN type, LSA teams, support bit mask (-1: no list)."""
        device_api, gin_type, num_lsa_teams, mask = words
        supported = None
        if mask >= 0:
            supported = tuple(GIN_TYPES.get(t, f"type {t}") for t in range(31) if mask >> t & 1 and t != 0)
        return cls(bool(device_api), GIN_TYPES.get(gin_type, f"type {gin_type}"), num_lsa_teams, supported)

    @property
    def usable(self) -> bool:
        """Whether the kernels could reach other nodes through GIN here."""
        return self.device_api and self.gin_type != "none"

    def reason(self) -> str:
        """One sentence: the GIN backend NCCL would use, or why there is none."""
        if not self.device_api:
            return "NCCL's device API is not available on this communicator"
        if self.gin_type == "none":
            return "NCCL has no GIN backend here (no RDMA NIC, or no GPU-initiated networking plugin)"
        listed = "" if self.supported is None else f" (supported: {', '.join(self.supported)})"
        return f"GIN over NCCL's {self.gin_type} backend across {self.num_lsa_teams} LSA teams{listed}"


def query_gin(comm: Communicator) -> GinProperties:
    """`ncclCommQueryProperties` on `comm`: nothing is set up or tried.

    Raises:
        NCCLError: when NCCL refuses the query, or its headers are older than 2.30.4.
    """
    words = (ctypes.c_int * 4)()
    result = _shim().ep_comm_gin_properties(ctypes.c_void_p(comm.handle), words)
    if result < 0:
        raise NCCLError("query_gin: these NCCL headers are older than 2.30.4 and have no ncclCommQueryProperties")
    if result != 0:
        raise NCCLError(f"ncclCommQueryProperties failed with ncclResult_t {result}")
    return GinProperties.from_words((words[0], words[1], words[2], words[3]))
