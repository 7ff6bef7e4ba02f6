"""deep_ep.jit compile path (spec -> source -> nvcc -> cubin): the real nvcc builds, errors carry the command."""

from __future__ import annotations

import struct

import pytest
from deep_ep.jit import JITCompileError, JITError, KernelSpec, PtxasCheckError, compile_spec, plan_build
from deep_ep.jit.compiler import find_disassembler, find_nvcc, parse_arch, resolve_arch
from deep_ep.jit.elf import kernel_symbols
from deep_ep.jit.nccl_headers import find_nccl
from kernels import jit_specs

from deep_ep.paths import get_include_dir

PEER_POINTERS_SYMBOL = "_ZN7deep_ep23nccl_peer_pointers_implILi512EEEvP17ncclWindow_vidmemiPm"


def peer_pointers_spec(num_threads: int = 512) -> KernelSpec:
    """The library's one kernel built against NCCL's device headers."""
    return KernelSpec(
        header="deep_ep/kernels/nccl_peer_pointers.cuh",
        name="deep_ep::nccl_peer_pointers_impl",
        template_args=(num_threads,),
        param_types=("ncclWindow_t", "int", "uint64_t*"),
        include_dirs=(str(get_include_dir()),),
        use_nccl=True,
    )


def cubin_sm(data: bytes) -> int:
    """The SM number nvcc records in a cubin's ELF e_flags (bits 8-15 from ELF ABI version 8 on)."""
    (flags,) = struct.unpack_from("<I", data, 0x30)
    return (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF


@pytest.mark.nvcc
def test_nccl_kernel_compiles_to_an_sm90a_cubin_with_its_mangled_name():
    entry = compile_spec(peer_pointers_spec())
    data = entry.binary_path.read_bytes()
    assert data[:4] == b"\x7fELF" and cubin_sm(data) == 90
    assert entry.symbol == PEER_POINTERS_SYMBOL
    assert kernel_symbols(data) == [PEER_POINTERS_SYMBOL]
    assert entry.metadata["arch"] == "sm_90a" and entry.metadata["name"] == "deep_ep::nccl_peer_pointers_impl<512>"
    assert entry.metadata["size"] == len(data)

    # The wheel's NCCL headers come first in the include order, before any other -I.
    nccl = find_nccl()
    command = entry.metadata["command"]
    assert command[0] == str(find_nvcc())
    assert command[1] == f"-I{nccl.include_dir}"
    for flag in ("-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin"):
        assert flag in command

    # The generated source: the NCCL guard, then exactly one explicit instantiation.
    source = (entry.path / "source.cu").read_text()
    assert f"NCCL_VERSION_CODE != {nccl.header_version}" in source and "#error" in source
    assert source.index("#include <nccl.h>") < source.index("#include <deep_ep/kernels/nccl_peer_pointers.cuh>")
    instantiation = "template __global__ void deep_ep::nccl_peer_pointers_impl<512>(ncclWindow_t, int, uint64_t*);"
    assert source.count("template __global__") == 1 and instantiation in source


@pytest.mark.nvcc
def test_kernel_lookup_skips_non_inlined_device_functions(jit_cache):
    entry = compile_spec(jit_specs.spill())
    data = entry.binary_path.read_bytes()
    assert kernel_symbols(data) == ["_ZN8jit_test10spill_implILi1024EEEvPKiPi"]
    assert "spill_helper" in entry.metadata["ptxas_log"]  # the helper is a separate function in the cubin


@pytest.mark.nvcc
def test_compile_error_carries_the_nvcc_command_and_stderr(jit_cache):
    with pytest.raises(JITCompileError) as caught:
        compile_spec(jit_specs.broken())
    error = caught.value
    message = str(error)
    assert str(find_nvcc()) in message and "-gencode=arch=compute_90a,code=sm_90a" in message
    assert "undeclared_name_in_broken_impl" in message and "error" in message
    assert error.returncode not in (0, None) and error.command[0] == str(find_nvcc())
    assert "undeclared_name_in_broken_impl" in error.stderr
    assert "template __global__ void jit_test::broken_impl<3>(int*);" in message  # the generated source
    # Nothing was published and no temporary build is left behind.
    assert not (jit_cache / "kernels").exists() or not any((jit_cache / "kernels").iterdir())
    assert not any((jit_cache / "tmp").iterdir())


@pytest.mark.nvcc
def test_wrong_expected_nccl_version_stops_the_build_at_the_guard(jit_cache):
    wrong = find_nccl().header_version + 1
    with pytest.raises(JITCompileError) as caught:
        compile_spec(peer_pointers_spec(), expected_nccl_version=wrong)
    assert f"is not NCCL_VERSION_CODE {wrong}" in caught.value.stderr  # our #error text, reported by nvcc
    assert "#error" in caught.value.stderr or "error" in caught.value.stderr


@pytest.mark.nvcc
def test_ptxas_check_rejects_local_memory_also_on_a_cache_hit(jit_cache, monkeypatch):
    monkeypatch.setenv("EP_JIT_PTXAS_CHECK", "1")
    with pytest.raises(PtxasCheckError) as caught:
        compile_spec(jit_specs.spill())
    message = str(caught.value)
    assert "EP_JIT_PTXAS_CHECK" in message and "spill_impl" in message and "4096 bytes stack frame" in message
    with pytest.raises(PtxasCheckError):
        compile_spec(jit_specs.spill())  # the entry is cached, its stored ptxas report still fails
    monkeypatch.delenv("EP_JIT_PTXAS_CHECK")
    assert compile_spec(jit_specs.spill()).symbol is not None


@pytest.mark.nvcc
def test_ptxas_check_accepts_the_nccl_kernel(monkeypatch):
    monkeypatch.setenv("EP_JIT_PTXAS_CHECK", "1")
    entry = compile_spec(peer_pointers_spec())
    (resources,) = entry.metadata["resources"].values()
    assert resources["stack_frame"] == resources["spill_stores"] == resources["spill_loads"] == 0


@pytest.mark.nvcc
def test_verbose_switches_print_the_command_and_the_ptxas_report(jit_cache, monkeypatch, capfd):
    monkeypatch.setenv("EP_JIT_PRINT_COMPILER_COMMAND", "1")
    monkeypatch.setenv("EP_JIT_PTXAS_VERBOSE", "1")
    monkeypatch.setenv("EP_JIT_DEBUG", "1")
    compile_spec(jit_specs.spill())
    first = capfd.readouterr().err
    assert "-gencode=arch=compute_90a,code=sm_90a" in first and "Used" in first and "registers" in first
    assert "cache miss" in first
    compile_spec(jit_specs.spill())
    second = capfd.readouterr().err
    assert "cache hit" in second and "registers" in second  # the report comes from the entry
    assert "-gencode" not in second  # no compiler ran


@pytest.mark.nvcc
def test_lineinfo_and_arch_change_the_key_but_nothing_else_does(monkeypatch):
    spec = jit_specs.spill()
    base = plan_build(spec)
    assert plan_build(jit_specs.spill()).key == base.key
    monkeypatch.setenv("EP_JIT_PTXAS_VERBOSE", "1")
    monkeypatch.setenv("EP_JIT_DEBUG", "1")
    assert plan_build(spec).key == base.key
    monkeypatch.setenv("EP_JIT_WITH_LINEINFO", "1")
    lineinfo = plan_build(spec)
    assert "-lineinfo" in lineinfo.flags and lineinfo.key != base.key
    monkeypatch.delenv("EP_JIT_WITH_LINEINFO")
    assert plan_build(spec, arch="sm_100a").key != base.key
    assert plan_build(jit_specs.spill()).key == base.key
    other = KernelSpec(spec.header, spec.name, (512,), spec.param_types, spec.include_dirs)
    assert plan_build(other).key != base.key


@pytest.mark.nvcc
def test_dump_sass_writes_sass_or_warns_without_a_disassembler(jit_cache, monkeypatch):
    monkeypatch.setenv("EP_JIT_DUMP_SASS", "1")
    if find_disassembler(find_nvcc()) is None:
        with pytest.warns(RuntimeWarning, match="cuobjdump"):
            compile_spec(jit_specs.spill())
    else:
        entry = compile_spec(jit_specs.spill())
        assert "spill_impl" in (entry.path / "kernel.sass").read_text()


def test_arch_parsing_and_the_no_gpu_error(monkeypatch):
    assert parse_arch("sm_90a").gencode == "-gencode=arch=compute_90a,code=sm_90a"
    assert parse_arch("100a").name == "sm_100a" and parse_arch("sm_80").name == "sm_80"
    with pytest.raises(ValueError, match="architecture"):
        parse_arch("hopper")
    monkeypatch.setenv("EP_JIT_ARCH", "sm_100a")
    assert resolve_arch().name == "sm_100a"
    assert resolve_arch("sm_90a").name == "sm_90a"  # an explicit argument wins
    monkeypatch.delenv("EP_JIT_ARCH")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(JITError, match="EP_JIT_ARCH"):
            resolve_arch()


def test_nvcc_selection(monkeypatch, tmp_path):
    monkeypatch.setenv("EP_JIT_NVCC_COMPILER", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(JITError, match="EP_JIT_NVCC_COMPILER"):
        find_nvcc()
    monkeypatch.delenv("EP_JIT_NVCC_COMPILER")
    real = find_nvcc()
    monkeypatch.setenv("EP_JIT_NVCC_COMPILER", str(real))
    assert find_nvcc() == real


def test_spec_validation_and_missing_header(jit_cache):
    with pytest.raises(ValueError, match="qualified C\\+\\+ identifier"):
        KernelSpec("a.cuh", "not a name")
    with pytest.raises(ValueError, match="relative path"):
        KernelSpec("/abs/a.cuh", "ns::k")
    with pytest.raises(TypeError, match="float"):
        KernelSpec("a.cuh", "ns::k", template_args=(1.5,))
    spec = KernelSpec("jit_test/no_such.cuh", "jit_test::k", (1,), ("int*",), (jit_specs.INCLUDE_DIR,))
    with pytest.raises(FileNotFoundError, match=r"no_such\.cuh"):
        compile_spec(spec)
    assert KernelSpec("a.cuh", "ns::k", template_args=(True, -3, "float")).display_name == "ns::k<true, -3, float>"
