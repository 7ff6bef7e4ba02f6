"""Load a cached cubin onto a device and launch its kernel.

Loading goes through `cuda.core` (`ObjectCode.from_cubin` + `get_kernel`, context-independent
library loading, and the driver's parameter layout via `Kernel.arguments_info`). Launching goes
through `cuda.bindings.driver.cuLaunchKernelEx` directly, because `cuda.core.launch` (up to 1.2)
cannot pass a struct by value (its argument marshalling rejects ctypes structs and bytes, and
the NCCL device communicator travels that way) and it re-marshals every argument on every call,
whereas we reuse a prebuilt launch config and a prebuilt argument buffer to keep host overhead low.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from cuda.bindings import driver as cuda

from . import driver
from .args import ArgumentPlan
from .build import compile_spec
from .cache import CacheEntry
from .nccl_headers import check_versions
from .spec import KernelSpec

Dims = int | tuple[int, ...]

# Without opting in, a kernel may use at most 48 KiB of dynamic shared memory.
_DEFAULT_DYNAMIC_SMEM = 48 * 1024
_MAX_CONFIGS = 256

_ATTR = cuda.CUlaunchAttributeID
_MAX_DYNAMIC_SMEM = cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _dims(value: Dims, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"{what} must be a positive int or 1-3 positive ints, got {value!r}")
    return (*dims, *(1,) * (3 - len(dims)))  # type: ignore[return-value]


def _torch_current_stream() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.current_stream


class Kernel:
    """One kernel loaded on one device. Build it with `get_kernel(spec)` (or `load_kernel(entry)`).

    Attributes:
        name: the instantiation, e.g. `deep_ep::peer_store_impl<512>`.
        symbol: the mangled name.
        device: the device ordinal it is loaded on.
        entry: the cache entry it came from.
        param_sizes: the byte size of each parameter (from the driver), or `None` if unknown.
    """

    def __init__(self, entry: CacheEntry, device: int = 0) -> None:
        from cuda.core import ObjectCode

        if entry.symbol is None:
            raise ValueError(f"cache entry {entry.path} is not a kernel")
        self.entry = entry
        self.name = entry.name
        self.symbol: str = entry.symbol
        self.device = device
        binary = entry.read_binary()  # verified against the entry's size and sha256
        driver.init()
        with driver.current_context(device):
            self._object_code = ObjectCode.from_cubin(binary)
            self._core_kernel = self._object_code.get_kernel(self.symbol)
            # A CUfunction of the device's primary context: launches then run in that context
            # whatever context happens to be current on the launching thread.
            self._function = driver.check(
                cuda.cuKernelGetFunction(cuda.CUkernel(int(self._core_kernel.handle))), "cuKernelGetFunction", self.name
            )
            self.param_sizes: list[int] | None = self._read_param_sizes()
        self._dynamic_smem_limit = _DEFAULT_DYNAMIC_SMEM
        self._configs: dict[tuple[Any, ...], Any] = {}
        self._plans: dict[tuple[type, ...], ArgumentPlan] = {}
        self._lock = threading.Lock()
        self._current_stream = _torch_current_stream()

    def __repr__(self) -> str:
        return f"Kernel({self.name}, device={self.device})"

    def _read_param_sizes(self) -> list[int] | None:
        """Byte size of each kernel parameter, asked of the driver (needs a current context).

        cuFuncGetParamInfo answers CUDA_ERROR_INVALID_VALUE past the last parameter; a driver
        older than 12.4 has no such call, and sizes are then not checked.
        """
        get_info = getattr(cuda, "cuFuncGetParamInfo", None)
        if get_info is None:
            return None
        sizes: list[int] = []
        while True:
            result = get_info(self._function, len(sizes))
            if result[0] == cuda.CUresult.CUDA_ERROR_INVALID_VALUE:
                return sizes
            if result[0]:
                return None
            sizes.append(int(result[2]))

    def occupancy(self, block_size: int, shared_mem: int = 0) -> int:
        """Maximum resident blocks per SM for this block size and dynamic shared memory."""
        with driver.current_context(self.device):
            return int(
                driver.check(
                    cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._function, block_size, shared_mem),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                    self.name,
                )
            )

    def attribute(self, attribute: cuda.CUfunction_attribute) -> int:
        """Read a function attribute (e.g. `CU_FUNC_ATTRIBUTE_NUM_REGS`) of the loaded kernel."""
        with driver.current_context(self.device):
            return int(
                driver.check(cuda.cuFuncGetAttribute(attribute, self._function), "cuFuncGetAttribute", self.name)
            )

    @property
    def handle(self) -> int:
        """The loaded `CUfunction` as an int, for launches made outside Python (`cuLaunchKernelEx`)."""
        return int(self._function)

    def default_stream(self) -> int:
        """The handle of torch's current stream on this device (the legacy stream 0 without torch)."""
        if self._current_stream is None:
            return 0
        return self._current_stream(self.device).cuda_stream

    def _make_config(self, key: tuple[Any, ...]) -> Any:
        grid, block, shared_mem, cooperative, cluster, pdl, stream = key
        grid_dims, block_dims = _dims(grid, "grid"), _dims(block, "block")
        if not isinstance(shared_mem, int) or shared_mem < 0:
            raise ValueError(f"shared_mem must be a non-negative int, got {shared_mem!r}")
        config = cuda.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid_dims
        config.blockDimX, config.blockDimY, config.blockDimZ = block_dims
        config.sharedMemBytes = shared_mem
        config.hStream = cuda.CUstream(stream)
        attributes = []
        if cooperative:
            attribute = cuda.CUlaunchAttribute()
            attribute.id = _ATTR.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attribute.value.cooperative = 1
            attributes.append(attribute)
        if cluster is not None:
            cluster_dims = _dims(cluster, "cluster")
            if any(g % c for g, c in zip(grid_dims, cluster_dims, strict=True)):
                raise ValueError(f"grid {grid_dims} is not a multiple of cluster {cluster_dims} in every dimension")
            attribute = cuda.CUlaunchAttribute()
            attribute.id = _ATTR.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster_dims
            attributes.append(attribute)
        if pdl:
            attribute = cuda.CUlaunchAttribute()
            attribute.id = _ATTR.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        if attributes:
            config.attrs = attributes
            config.numAttrs = len(attributes)
        if shared_mem > self._dynamic_smem_limit:
            # Opt in to more than 48 KiB of dynamic shared memory (once per size increase).
            driver.check(
                cuda.cuFuncSetAttribute(self._function, _MAX_DYNAMIC_SMEM, shared_mem), "cuFuncSetAttribute", self.name
            )
            self._dynamic_smem_limit = shared_mem
        if len(self._configs) >= _MAX_CONFIGS:
            self._configs.clear()
        self._configs[key] = config
        return config

    def launch(
        self,
        grid: Dims,
        block: Dims,
        args: Sequence[object] = (),
        *,
        stream: object = None,
        shared_mem: int = 0,
        cooperative: bool = False,
        cluster: Dims | None = None,
        pdl: bool = False,
    ) -> None:
        """Launch the kernel (asynchronously, on `stream`).

        Arguments:
            grid: blocks per grid, an int or a 1-3 tuple (in blocks, also with clusters).
            block: threads per block, an int or a 1-3 tuple.
            args: one value per kernel parameter: a torch tensor or `Pointer` for `T*`, `I32`,
                `U32`, `I64`, `U64`, `F32`, `F64`, `Bool`, ... for scalars, `Opaque(bytes)` for a
                struct by value. Plain Python numbers are refused (their width is ambiguous).
            stream: torch stream, raw `CUstream` int, or `None` for torch's current stream.
            shared_mem: dynamic shared memory per block in bytes (above 48 KiB is opted into).
            cooperative: cooperative launch (grid-wide sync; all blocks must be co-resident).
            cluster: thread-block cluster dims (the grid must be a multiple of them).
            pdl: allow programmatic dependent launch: this kernel may start before the previous
                kernel on the stream finishes; it must `griddepcontrol.wait` before reading its output.

        Raises:
            CUDADriverError: when the driver rejects the launch.
            TypeError, ValueError: for arguments that do not fit the kernel's parameters.
        """
        handle = (
            self.default_stream() if stream is None else stream if type(stream) is int else driver.stream_handle(stream)
        )
        key = (grid, block, shared_mem, cooperative, cluster, pdl, handle)
        try:
            config = self._configs.get(key)
        except TypeError:  # lists for dims: use tuples in the key
            key = tuple(tuple(k) if isinstance(k, list) else k for k in key)
            config = self._configs.get(key)
        if config is None:
            with self._lock:
                config = self._make_config(key)
        signature = tuple(map(type, args))
        plan = self._plans.get(signature)
        if plan is None:
            plan = self._plans.setdefault(signature, ArgumentPlan(args, self.param_sizes, self.name))
        with plan.lock:
            result = cuda.cuLaunchKernelEx(config, self._function, plan.pack(args), 0)
        if result[0]:
            raise driver.error_from(result[0], "cuLaunchKernelEx", f"{self.name}, grid {grid}, block {block}")


def load_kernel(entry: CacheEntry, device: int = 0) -> Kernel:
    """Load a kernel cache entry on `device` (no memoization; see `get_kernel`)."""
    return Kernel(entry, device)


_kernels: dict[tuple[KernelSpec, int, str | None], Kernel] = {}
_kernels_lock = threading.Lock()
_nccl_checked = False


def _current_device() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def get_kernel(spec: KernelSpec, *, device: int | None = None, arch: str | None = None) -> Kernel:
    """Compile (or find in the cache), load and memoize the kernel of `spec` on `device`.

    Arguments:
        spec: the kernel.
        device: device ordinal (default: torch's current device).
        arch: compile target (default: `EP_JIT_ARCH`, else the device's own).

    Returns:
        The loaded kernel; the same object for the same (spec, device, arch) in this process.

    Raises:
        JITCompileError: when nvcc fails.
        NCCLVersionMismatchError: for an NCCL spec, when headers and loaded libnccl differ.
        CUDADriverError: when loading fails.
    """
    global _nccl_checked
    ordinal = _current_device() if device is None else device
    key = (spec, ordinal, arch)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _kernels_lock:
        kernel = _kernels.get(key)
        if kernel is None:
            from .compiler import resolve_arch

            entry = compile_spec(spec, arch=resolve_arch(arch, ordinal))
            if spec.use_nccl and not _nccl_checked:
                check_versions()  # kernels read NCCL structs: headers and library must agree
                _nccl_checked = True
            kernel = _kernels[key] = load_kernel(entry, ordinal)
    return kernel


def measure_launch_overhead(
    kernel: Kernel,
    grid: Dims,
    block: Dims,
    args: Sequence[object] = (),
    *,
    iterations: int = 2000,
    warmup: int = 100,
    stream: object = None,
    **launch_options: Any,
) -> dict[str, float]:
    """Time the host side of `kernel.launch` (perf_counter around the call only).

    The stream is synchronized every 128 launches, outside the timed region, so a full launch
    queue never blocks a timed call.

    Returns:
        `median_us`, `mean_us`, `p10_us`, `p90_us`, `min_us` and `iterations`.
    """
    # The stream object goes to `launch` as given (so resolving it is part of what is timed).
    handle = kernel.default_stream() if stream is None else driver.stream_handle(stream)
    samples = []
    for index in range(warmup + iterations):
        if index % 128 == 0:
            driver.check(cuda.cuStreamSynchronize(cuda.CUstream(handle)), "cuStreamSynchronize")
        started = time.perf_counter()
        kernel.launch(grid, block, args, stream=stream, **launch_options)
        elapsed = time.perf_counter() - started
        if index >= warmup:
            samples.append(elapsed * 1e6)
    driver.check(cuda.cuStreamSynchronize(cuda.CUstream(handle)), "cuStreamSynchronize")
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "mean_us": statistics.fmean(samples),
        "p10_us": samples[len(samples) // 10],
        "p90_us": samples[len(samples) * 9 // 10],
        "min_us": samples[0],
        "iterations": float(len(samples)),
    }
