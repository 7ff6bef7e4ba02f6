"""deep_ep.jit.kernel, the part that needs no GPU: launch configs for cuLaunchKernelEx and stream handles."""

from __future__ import annotations

import threading

import pytest
from cuda.bindings import driver as cuda
from deep_ep.jit import driver
from deep_ep.jit.kernel import Kernel, _dims

ATTR = cuda.CUlaunchAttributeID


def bare_kernel() -> Kernel:
    """A Kernel with no module behind it: enough to build launch configs (no driver call below 48 KiB)."""
    kernel = Kernel.__new__(Kernel)
    kernel.name, kernel._configs, kernel._lock = "test", {}, threading.Lock()
    kernel._dynamic_smem_limit = 48 * 1024
    return kernel


def test_config_carries_geometry_stream_and_every_launch_attribute():
    kernel = bare_kernel()
    config = kernel._make_config(((8, 2), 128, 4096, True, (2,), True, 0x1234))
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (8, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (128, 1, 1)
    assert config.sharedMemBytes == 4096 and int(config.hStream) == 0x1234
    assert config.numAttrs == 3
    cooperative, cluster, pdl = config.attrs
    assert cooperative.id == ATTR.CU_LAUNCH_ATTRIBUTE_COOPERATIVE and cooperative.value.cooperative == 1
    assert cluster.id == ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z) == (2, 1, 1)
    assert pdl.id == ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert pdl.value.programmaticStreamSerializationAllowed == 1
    plain = kernel._make_config((1, 32, 0, False, None, False, 0))
    assert plain.numAttrs == 0 and len(kernel._configs) == 2


def test_bad_geometry_is_refused_before_the_driver():
    kernel = bare_kernel()
    with pytest.raises(ValueError, match="multiple of cluster"):
        kernel._make_config((7, 32, 0, False, 2, False, 0))
    with pytest.raises(ValueError, match="grid must be"):
        kernel._make_config((0, 32, 0, False, None, False, 0))
    with pytest.raises(ValueError, match="shared_mem"):
        kernel._make_config((1, 32, -1, False, None, False, 0))
    assert _dims(5, "grid") == (5, 1, 1) and _dims((2, 3), "grid") == (2, 3, 1)
    with pytest.raises(ValueError):
        _dims((1, 1, 1, 1), "block")


def test_stream_handles_from_ints_torch_like_objects_and_the_protocol():
    class TorchLike:
        cuda_stream = 0xABC

    class Protocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0xDEF)

    assert driver.stream_handle(7) == 7
    assert driver.stream_handle(TorchLike()) == 0xABC
    assert driver.stream_handle(Protocol()) == 0xDEF
    assert driver.stream_handle(cuda.CUstream(0x42)) == 0x42
    with pytest.raises(TypeError, match="stream handle"):
        driver.stream_handle("stream")


def test_driver_errors_are_checked():
    error = driver.error_from(cuda.CUresult.CUDA_ERROR_INVALID_VALUE, "cuTest", "context")
    assert error.code == 1 and error.call == "cuTest" and "cuTest failed (context)" in str(error)
    with pytest.raises(type(error)):
        driver.check((cuda.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuTest")
    assert driver.check((cuda.CUresult.CUDA_SUCCESS, 5), "cuTest") == 5
    assert driver.check((cuda.CUresult.CUDA_SUCCESS,), "cuTest") is None
