"""The device-communicator requirements of a single-node buffer set no GIN field (CPU: the shim is
built against the NCCL headers CI installs and only fills structs; no communicator is made)."""

from __future__ import annotations

import ctypes

import pytest
from deep_ep.jit.nccl_headers import find_nccl

from deep_ep.backends.kernels.nccl import device_comm

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
    assert len(fields) == (13 if find_nccl().header_version >= 23200 else 8)


@pytest.mark.parametrize("name", ["ginForceEnable", "ginContextCount", "barrierCount", "resourceRequirementsList"])
def test_any_gin_field_that_differs_is_named(shim, name):
    requirements = bytearray(device_comm.lsa_requirements(1))
    begin, size = _gin_offsets(shim)[name]
    requirements[begin] ^= 0x01  # a flag raised, a count or a pointer changed
    assert device_comm.gin_fields_set(bytes(requirements)) == [name]
    assert size >= 1
