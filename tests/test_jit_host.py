"""deep_ep.jit.host: a host shim built against the loaded libnccl's headers, cached, bound to that libnccl."""

from __future__ import annotations

import ctypes

import pytest
from deep_ep.jit import JITCompileError, load_host_library, stats
from deep_ep.jit.host import build_host_library
from deep_ep.jit.nccl_headers import find_nccl, loaded_libraries

# Every test here compiles with nvcc (skipped with the reason where it is not found: tests/conftest.py)
pytestmark = pytest.mark.nvcc

# sizeof(ncclDevComm) per release, measured (docs: shared/docs/nccl.md).
DEV_COMM_BYTES = {22809: 200, 23007: 240, 23203: 248}

SHIM = """
#include <nccl.h>
#include <nccl_device.h>
#include <cstddef>

extern "C" int shim_nccl_version_code() { return NCCL_VERSION_CODE; }
extern "C" size_t shim_sizeof_dev_comm() { return sizeof(ncclDevComm); }
extern "C" int shim_runtime_version() {
    int version = 0;
    return ncclGetVersion(&version) == ncclSuccess ? version : -1;
}
"""


def test_shim_reports_the_header_version_and_the_device_communicator_size(jit_cache):
    library = load_host_library("test_nccl_shim", SHIM)
    library.shim_sizeof_dev_comm.restype = ctypes.c_size_t
    install = find_nccl()
    assert library.shim_nccl_version_code() == install.header_version
    assert library.shim_runtime_version() == install.header_version  # bound to the loaded libnccl
    expected = DEV_COMM_BYTES.get(install.header_version)
    size = library.shim_sizeof_dev_comm()
    assert size == expected if expected is not None else size > 0
    # One libnccl in the process: the shim did not pull in another copy.
    assert [p.resolve() for p in loaded_libraries()] == [install.lib_path.resolve()]

    compiles = stats().get("compile", 0)
    assert load_host_library("test_nccl_shim", SHIM) is library  # memoized per process
    entry = build_host_library("test_nccl_shim", SHIM)  # and cached on disk
    assert stats().get("compile", 0) == compiles and entry.binary_path.name == "libtest_nccl_shim.so"
    assert "NCCL_VERSION_CODE != " in (entry.path / "test_nccl_shim.cpp").read_text()  # the guard


def test_shim_without_nccl_and_a_failing_shim(jit_cache):
    plain = load_host_library("test_plain_shim", 'extern "C" int answer() { return 42; }', use_nccl=False)
    assert plain.answer() == 42
    with pytest.raises(JITCompileError) as caught:
        load_host_library("test_broken_shim", 'extern "C" int broken() { return missing_symbol; }', use_nccl=False)
    assert "missing_symbol" in str(caught.value) and "-shared" in str(caught.value)
    with pytest.raises(ValueError, match="C identifier"):
        load_host_library("bad name", "", use_nccl=False)
