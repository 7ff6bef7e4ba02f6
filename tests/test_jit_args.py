"""deep_ep.jit.args: explicit-width kernel arguments packed into the kernelParams array (no GPU needed)."""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch
from deep_ep.jit import F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, Bool, Opaque, Pointer
from deep_ep.jit.args import ArgumentPlan, signature


def read_params(address: int, sizes: list[int]) -> list[bytes]:
    """Follow the void*[] array the driver would read and return each parameter's bytes."""
    pointers = (ctypes.c_void_p * len(sizes)).from_address(address)
    return [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]


def test_every_kind_lands_with_its_width_and_value():
    tensor = torch.arange(4, dtype=torch.int32)
    blob = bytes(range(200))
    args = [
        I8(-2), U8(250), I16(-300), U16(60000), I32(-(2**31)), U32(2**32 - 1), I64(-(2**63)), U64(2**64 - 1),
        F32(1.5), F64(-2.25), Bool(True), Pointer(0xDEADBEEF000), Pointer(tensor), tensor, Opaque(blob),
    ]  # fmt: skip
    sizes = [1, 1, 2, 2, 4, 4, 8, 8, 4, 8, 1, 8, 8, 8, 200]
    plan = ArgumentPlan(args, sizes, "test")
    raw = read_params(plan.pack(args), sizes)
    expected = [
        struct.pack("<b", -2), struct.pack("<B", 250), struct.pack("<h", -300), struct.pack("<H", 60000),
        struct.pack("<i", -(2**31)), struct.pack("<I", 2**32 - 1), struct.pack("<q", -(2**63)),
        struct.pack("<Q", 2**64 - 1), struct.pack("<f", 1.5), struct.pack("<d", -2.25), b"\x01",
        struct.pack("<Q", 0xDEADBEEF000), struct.pack("<Q", tensor.data_ptr()), struct.pack("<Q", tensor.data_ptr()),
        blob,
    ]  # fmt: skip
    assert raw == expected
    # The plan is reused: new values of the same types overwrite the same buffer.
    args[4], args[14] = I32(7), Opaque(bytes(200))
    assert read_params(plan.pack(args), sizes)[4] == struct.pack("<i", 7)
    assert read_params(plan.pack(args), sizes)[14] == bytes(200)


def test_sizes_must_match_the_kernel_parameters():
    with pytest.raises(TypeError, match=r"argument 1 is U32 \(4 bytes\) but the kernel's parameter 1 is 8 bytes"):
        ArgumentPlan([U64(1), U32(2)], [8, 8], "k")
    with pytest.raises(TypeError, match="takes 2 arguments, 1 were given"):
        ArgumentPlan([U64(1)], [8, 8], "k")
    with pytest.raises(TypeError, match=r"Opaque\(248 bytes\) \(248 bytes\) but the kernel's parameter 0 is 200"):
        ArgumentPlan([Opaque(bytes(248))], [200], "k")
    # Unknown parameter sizes (old driver): packing still works, nothing is checked.
    ArgumentPlan([U64(1), U32(2)], None, "k")


@pytest.mark.parametrize("value", [3, 2.5, True])
def test_plain_python_numbers_are_refused(value):
    with pytest.raises(TypeError, match="ambiguous"):
        ArgumentPlan([value], [4], "k")


def test_unsupported_types_and_bad_values():
    with pytest.raises(TypeError, match="unsupported type str"):
        ArgumentPlan(["x"], None, "k")
    plan = ArgumentPlan([I32(0), U32(0)], [4, 4], "k")
    with pytest.raises(ValueError, match=r"argument 1: U32\(-1\)"):
        plan.pack([I32(1), U32(-1)])
    with pytest.raises(ValueError, match="does not fit int32_t"):
        I32(2**31).check()
    opaque = ArgumentPlan([Opaque(bytes(16))], [16], "k")
    with pytest.raises(TypeError, match="expects 16 bytes"):
        opaque.pack([Opaque(bytes(8))])  # struct would silently pad it: refused
    with pytest.raises(ValueError):
        Opaque(b"")


def test_opaque_from_a_ctypes_struct_and_an_empty_argument_list():
    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint32), ("b", ctypes.c_uint64)]

    value = Opaque(Pair(1, 2))
    assert value.data == struct.pack("<IxxxxQ", 1, 2) and len(value.data) == ctypes.sizeof(Pair)
    assert ArgumentPlan([], [], "k").pack([]) == 0  # a kernel without parameters gets NULL
    assert signature([I32(1), Opaque(b"x")]) == (I32, Opaque)
