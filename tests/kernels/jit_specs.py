"""Kernel specs of the test-only headers in tests/kernels/jit_test/ (shared by the JIT tests)."""

from __future__ import annotations

from pathlib import Path

from deep_ep.jit import KernelSpec

INCLUDE_DIR = str(Path(__file__).resolve().parent)
OPAQUE_BYTES = 200


def spec(header: str, name: str, template_args: tuple[object, ...], param_types: tuple[str, ...]) -> KernelSpec:
    """A spec for `jit_test/<header>` with the test include dir."""
    return KernelSpec(
        header=f"jit_test/{header}",
        name=f"jit_test::{name}",
        template_args=template_args,
        param_types=param_types,
        include_dirs=(INCLUDE_DIR,),
    )


def spill() -> KernelSpec:
    return spec("spill.cuh", "spill_impl", (1024,), ("const int*", "int*"))


def broken() -> KernelSpec:
    return spec("syntax_error.cuh", "broken_impl", (3,), ("int*",))


def scalars(num_threads: int = 128) -> KernelSpec:
    params = ("const int*", "int64_t*", "int", "int32_t", "uint32_t", "int64_t", "uint64_t", "float", "double", "bool")
    return spec("scalars.cuh", "scalars_impl", (num_threads,), params)


def coop(num_rounds: int = 4) -> KernelSpec:
    return spec("coop.cuh", "coop_impl", (num_rounds,), ("int*", "long long*"))


def cluster(num_threads: int = 64) -> KernelSpec:
    return spec("cluster.cuh", "cluster_impl", (num_threads,), ("int*",))


def pdl_producer(num_threads: int = 256) -> KernelSpec:
    return spec(
        "pdl.cuh", "pdl_producer_impl", (num_threads,), ("int*", "int", "int", "uint64_t", "unsigned long long*")
    )


def pdl_consumer(num_threads: int = 256) -> KernelSpec:
    return spec("pdl.cuh", "pdl_consumer_impl", (num_threads,), ("const int*", "int*", "int", "unsigned long long*"))


def opaque(num_bytes: int = OPAQUE_BYTES) -> KernelSpec:
    blob = f"jit_test::Blob<{num_bytes}>"
    return spec("opaque.cuh", "opaque_impl", (num_bytes,), (blob, "uint64_t", "unsigned char*", "uint64_t*"))


def empty() -> KernelSpec:
    return spec("empty.cuh", "empty_impl", (0,), ())


def empty_args(num_bytes: int = OPAQUE_BYTES) -> KernelSpec:
    blob = f"jit_test::Blob<{num_bytes}>"
    return spec("empty.cuh", "empty_args_impl", (num_bytes,), (blob, "uint64_t", "const int*", "int", "uint64_t"))


def smem(num_threads: int = 256) -> KernelSpec:
    return spec("smem.cuh", "smem_impl", (num_threads,), ("long long*", "int"))


def gpu_test_specs() -> list[KernelSpec]:
    """Every spec the GPU tests launch (the CPU suite compiles them all, so they are known to build)."""
    return [scalars(), coop(), cluster(), pdl_producer(), pdl_consumer(), opaque(), empty(), empty_args(), smem()]


def two_kernels() -> KernelSpec:
    return spec("two_kernels.cuh", "wanted_impl", (5,), ("int*",))
