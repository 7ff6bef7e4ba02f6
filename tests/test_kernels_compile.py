"""Every NVLink kernel specialisation the GPU tests and the benchmark use compiles for sm_90a (the
NCCL one against the installed NCCL headers), with no local memory and no spills (EP_JIT_PTXAS_CHECK);
the ctypes mirrors of the kernel argument structs match the C++ structs."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import pytest
from deep_ep.jit import KernelSpec, compile_spec

from deep_ep.backends.kernels import specs as kernel_specs

# The compile tests share one sm_90a cache with ptxas checks; without nvcc they skip (tests/conftest.py)
compiles = pytest.mark.usefixtures("sm90a_checked_cache")


@compiles
def test_warmup_specs_compile_without_spills():
    specs = kernel_specs.warmup_specs()
    names = {spec.name for spec in specs}
    for kernel in ("dispatch", "dispatch_expand_rank", "dispatch_epilogue", "combine", "combine_epilogue",
                   "barrier", "peer_store", "nccl_peer_pointers", "launch_floor"):  # fmt: skip
        assert f"deep_ep::{kernel}_impl" in names, kernel
    with ThreadPoolExecutor(max_workers=2) as pool:
        entries = list(pool.map(compile_spec, specs))
    assert len(entries) == len(specs)
    for spec, entry in zip(specs, entries, strict=True):
        assert entry.binary_path.stat().st_size > 0, spec
        assert spec.name.split("::")[-1] in entry.symbol, (spec.name, entry.symbol)


@compiles
def test_rank_masking_variants_compile_without_spills():
    specs = kernel_specs.moe_specs(8, 2048, 8, 256, fp8_scale_bytes=(64,), rank_masking=True)[1:]  # no barrier
    # The masking flag, before the transport (LSA here)
    assert {s.template_args[-2:] for s in specs} == {("true", "deep_ep::transport::Lsa")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        entries = list(pool.map(compile_spec, specs))
    assert all(entry.binary_path.stat().st_size > 0 for entry in entries)


@compiles
def test_the_emulated_nic_pings_compile_without_spills():
    specs = [kernel_specs.transport_ping_spec(t) for t in kernel_specs.EMULATED_TRANSPORTS]
    assert [s.template_args[0] for s in specs] == ["deep_ep::transport::Emulated<false>",
                                                   "deep_ep::transport::Emulated<true>"]  # fmt: skip
    for spec in specs:
        assert compile_spec(spec).binary_path.stat().st_size > 0, spec


def test_moe_specs_cover_both_layouts_and_scale_formats():
    specs = kernel_specs.moe_specs(num_ranks=8, hidden=4096, num_topk=8, num_experts=256, fp8_scale_bytes=(128, 32))
    dispatch = [s for s in specs if s.name == "deep_ep::dispatch_impl"]
    assert {s.template_args[1:3] for s in dispatch} == {(8192, 0), (4096, 128), (4096, 32)}
    combine = {s.template_args[3:6] for s in specs if s.name == "deep_ep::combine_impl"}
    assert combine == {(1, 512, "false"), (1, 512, "true"), (8, 512, "true")}
    assert all(isinstance(s, KernelSpec) for s in specs)


def _mirror_assertions() -> str:
    lines = ["#include <cstddef>", "#include <deep_ep/kernels/dispatch.cuh>", "#include <deep_ep/kernels/dispatch_epilogue.cuh>",
             "#include <deep_ep/kernels/combine.cuh>", "#include <deep_ep/kernels/combine_epilogue.cuh>",
             "#include <deep_ep/kernels/transport_ping.cuh>"]  # fmt: skip
    for mirror, name in (
        (kernel_specs.DispatchArgs, "deep_ep::DispatchArgs"),
        (kernel_specs.DispatchEpilogueArgs, "deep_ep::DispatchEpilogueArgs"),
        (kernel_specs.CombineArgs, "deep_ep::CombineArgs"),
        (kernel_specs.CombineEpilogueArgs, "deep_ep::CombineEpilogueArgs"),
        (kernel_specs.TransportPingArgs, "deep_ep::TransportPingArgs"),
        (kernel_specs.LsaTransportArgs, "deep_ep::transport::Lsa::Args"),
        (kernel_specs.EmulatedTransportArgs, "deep_ep::transport::Emulated<true>::Args"),
        (kernel_specs.EmulatedTransportArgs, "deep_ep::transport::Emulated<false>::Args"),
    ):
        lines.append(f'static_assert(sizeof({name}) == {ctypes.sizeof(mirror)}, "{mirror.__name__} size");')
        for field, _ in mirror._fields_:
            offset = getattr(mirror, field).offset
            lines.append(f'static_assert(offsetof({name}, {field}) == {offset}, "{mirror.__name__}.{field}");')
    # The emulated NIC's word counts, which the host allocates
    lines.append(f"static_assert(deep_ep::transport::kNicWords == {kernel_specs.NIC_WORDS});")
    for index, word in enumerate(kernel_specs.NIC_TRAFFIC_WORDS):
        lines.append(f"static_assert(deep_ep::transport::kNicTraffic{word.capitalize()} == {index});")
    lines.append(f"static_assert(deep_ep::transport::kNicTrafficWords == {len(kernel_specs.NIC_TRAFFIC_WORDS)});")
    return "\n".join(lines)


@compiles
def test_ctypes_argument_mirrors_match_the_kernel_structs(tmp_path):
    (tmp_path / "mirror_check.cuh").write_text(
        "#pragma once\n"
        + _mirror_assertions()
        + "\ntemplate <int kUnused> __global__ void mirror_check_impl(int* out) "
        "{ *out = kUnused; }\n"
    )
    spec = KernelSpec(header="mirror_check.cuh", name="mirror_check_impl", template_args=(0,), param_types=("int*",),
                      include_dirs=(str(tmp_path), *kernel_specs.barrier_spec(2).include_dirs))  # fmt: skip
    compile_spec(spec)
