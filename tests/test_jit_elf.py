"""deep_ep.jit.elf: kernel names come from the cubin's symbol table; one spec must give one kernel."""

from __future__ import annotations

import pytest
from deep_ep.jit import JITCompileError, compile_spec
from deep_ep.jit.elf import ELFError, kernel_symbols, single_kernel_symbol
from kernels import jit_specs

# Every test here compiles with nvcc (skipped with the reason where it is not found: tests/conftest.py)
pytestmark = pytest.mark.nvcc


def test_symbols_of_a_real_cubin_and_malformed_input(jit_cache):
    data = compile_spec(jit_specs.coop()).binary_path.read_bytes()
    assert single_kernel_symbol(data) == "_ZN8jit_test9coop_implILi4EEEvPiPx"
    with pytest.raises(ELFError, match="truncated"):
        kernel_symbols(data[: len(data) // 2])
    with pytest.raises(ELFError, match="not an ELF"):
        kernel_symbols(b"\0" * 128)
    with pytest.raises(ELFError, match="64-bit little-endian"):
        kernel_symbols(data[:4] + b"\x01" + data[5:])


def test_a_header_with_a_second_kernel_is_rejected(jit_cache):
    with pytest.raises(JITCompileError, match="exactly one kernel") as caught:
        compile_spec(jit_specs.two_kernels())
    assert "stray_kernel" in str(caught.value) and "wanted_impl" in str(caught.value)
    assert not (jit_cache / "kernels").exists() or not any((jit_cache / "kernels").iterdir())
