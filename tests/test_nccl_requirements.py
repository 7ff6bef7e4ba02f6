"""The device-communicator requirements: a single-node buffer's set no GIN field, a GIN buffer's set
only its contexts and connection (CPU: the shim is built against the NCCL headers CI installs and
only fills structs; no communicator is made)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
from deep_ep.jit.nccl_headers import find_nccl

from deep_ep.backends.kernels.nccl import device_comm, gin

# Every test here compiles with nvcc (skipped with the reason where it is not found: tests/conftest.py)
pytestmark = pytest.mark.nvcc


@pytest.fixture
def shim(jit_cache):
    device_comm._shim.cache_clear()  # built into this test's cache
    yield device_comm._shim()
    device_comm._shim.cache_clear()


def _gin_offsets(shim) -> dict[str, tuple[int, int]]:
    offsets = (ctypes.c_longlong * (2 * len(device_comm.GIN_FIELDS)))()
    count = shim.ep_dev_comm_gin_fields(offsets)
    return {name: (offsets[2 * i], offsets[2 * i + 1]) for i, name in enumerate(device_comm.GIN_FIELDS[:count])}


def test_lsa_requirements_set_lsa_barriers_and_no_gin_field(shim):
    requirements = device_comm.lsa_requirements(1)
    assert len(requirements) == shim.ep_dev_comm_requirements_bytes() > 0
    offset = shim.ep_dev_comm_lsa_barrier_count_offset()
    assert int.from_bytes(requirements[offset : offset + 4], "little", signed=True) == 1
    assert device_comm.gin_fields_set(requirements) == []
    fields = _gin_offsets(shim)
    version = find_nccl().header_version
    assert len(fields) == (13 if version >= 23102 else 12 if version >= 23004 else 8)


@pytest.mark.parametrize("name", ["ginForceEnable", "ginContextCount", "barrierCount", "resourceRequirementsList"])
def test_any_gin_field_that_differs_is_named(shim, name):
    requirements = bytearray(device_comm.lsa_requirements(1))
    begin, size = _gin_offsets(shim)[name]
    requirements[begin] ^= 0x01  # a flag raised, a count or a pointer changed
    assert device_comm.gin_fields_set(bytes(requirements)) == [name]
    assert size >= 1


def _int_at(requirements: bytes, field: tuple[int, int]) -> int:
    begin, size = field
    return int.from_bytes(requirements[begin : begin + size], "little", signed=True)


needs_gin_headers = pytest.mark.skipif(
    find_nccl().header_version < 23004, reason="the NCCL headers here are older than 2.30.4 (no GIN connection fields)"
)


@needs_gin_headers
@pytest.mark.parametrize(("num_contexts", "mode"), [(17, "direct"), (129, "hybrid"), (65, "direct")])
def test_gin_requirements_set_only_contexts_and_connection(shim, num_contexts, mode):
    requirements = device_comm.gin_requirements(num_contexts, mode)
    fields = _gin_offsets(shim)
    assert device_comm.gin_fields_set(requirements) == ["ginContextCount", "ginConnectionType", "ginExclusiveContexts"]
    assert _int_at(requirements, fields["ginContextCount"]) == num_contexts  # one context per QP
    assert _int_at(requirements, fields["ginConnectionType"]) == device_comm.GIN_CONNECTIONS[mode]
    assert _int_at(requirements, fields["ginExclusiveContexts"]) == 1
    offset = shim.ep_dev_comm_lsa_barrier_count_offset()
    assert int.from_bytes(requirements[offset : offset + 4], "little", signed=True) == 1
    # VA signals only (no GIN signals or counters), no NCCL barriers, no forced GIN
    baseline = device_comm.baseline_requirements()
    for name in ("ginSignalCount", "ginCounterCount", "barrierCount", "railGinBarrierCount", "worldGinBarrierCount",
                 "ginForceEnable", "ginQueueDepth", "resourceRequirementsList", "teamRequirementsList"):  # fmt: skip
        assert _int_at(requirements, fields[name]) == _int_at(baseline, fields[name]), name


@needs_gin_headers
def test_gin_requirements_refuse_bad_arguments(shim):
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="`num_contexts` must be an int >= 1"):
            device_comm.gin_requirements(bad)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        device_comm.gin_requirements(17, "rail")


class _RecordingShim:
    """The real shim, except that `ncclDevCommCreate` (which needs a communicator) only records the
    requirements it was given and answers LSA (rank, size) = (0, 2)."""

    def __init__(self, shim) -> None:
        self._shim = shim
        self.created: list[bytes] = []

    def __getattr__(self, name: str):
        return getattr(self._shim, name)

    def ep_dev_comm_create(self, comm, requirements, out, lsa_rank, lsa_size) -> int:
        self.created.append(bytes(requirements))
        lsa_rank._obj.value, lsa_size._obj.value = 0, 2
        return 0


@pytest.mark.parametrize("lsa_barrier_count", [1, 4])
def test_a_single_node_device_communicator_passes_no_gin_field_to_nccl(shim, lsa_barrier_count):
    """`DeviceCommunicator` without GIN contexts (one node: its only path on 2.28.9, and on torch's
    communicator) hands `ncclDevCommCreate` requirements with no GIN field set, whatever the headers."""
    recording = _RecordingShim(shim)
    with pytest.MonkeyPatch.context() as patch:  # undone before `shim` rebuilds the real one
        patch.setattr(device_comm, "_shim", lambda: recording)
        for is_own in (False, True):
            comm = SimpleNamespace(is_own=is_own, handle=0x1234, lib=SimpleNamespace(check=lambda *args: None))
            dev_comm = device_comm.DeviceCommunicator(comm, lsa_barrier_count=lsa_barrier_count)
            assert (dev_comm.lsa_rank, dev_comm.lsa_size) == (0, 2)
            assert len(dev_comm.raw) == shim.ep_dev_comm_bytes()
        assert len(recording.created) == 2
        offset = shim.ep_dev_comm_lsa_barrier_count_offset()
        for requirements in recording.created:
            assert device_comm.gin_fields_set(requirements) == []
            assert int.from_bytes(requirements[offset : offset + 4], "little", signed=True) == lsa_barrier_count


def test_gin_contexts_are_refused_on_torchs_communicator_before_any_nccl_call():
    borrowed = SimpleNamespace(is_own=False, handle=0x1234, lib=None)
    with pytest.raises(ValueError, match="GIN contexts need a communicator of our own"):
        device_comm.DeviceCommunicator(borrowed, gin_contexts=17)


def test_gin_properties_say_which_backend_or_why_none():
    proxy = gin.GinProperties.from_words((1, 2, 2, 0b001100))
    assert proxy.usable and proxy.gin_type == "proxy" and proxy.supported == ("proxy", "gdaki")
    assert proxy.reason() == "GIN over NCCL's proxy backend across 2 LSA teams (supported: proxy, gdaki)"
    none = gin.GinProperties.from_words((1, 0, 1, -1))
    assert not none.usable and none.supported is None and "no GIN backend here" in none.reason()
    assert not gin.GinProperties.from_words((0, 3, 2, 8)).usable
    assert "device API is not available" in gin.GinProperties.from_words((0, 3, 2, 8)).reason()
