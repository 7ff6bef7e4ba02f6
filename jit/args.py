"""Kernel arguments: explicit-width wrappers and the packing of `kernelParams`.

A Python int has no width, so scalars must say theirs: `I32(n)`, `U64(x)`, `F32(a)`, ... A device
pointer is a torch tensor (its `data_ptr()`) or `Pointer(address)`. A struct passed by value (an
NCCL `ncclDevComm`, say) is `Opaque(raw_bytes)`. Plain Python ints, floats and bools are refused
with a `TypeError` rather than guessed.

Packing is planned once per kernel and argument-type signature: a `struct.Struct` that writes
every value at its offset in one reusable buffer, and the `void*[]` array of pointers into that
buffer that `cuLaunchKernelEx` reads. The driver copies the values during the launch call, so the
buffer can be reused right after it returns. When the kernel's parameter sizes are known (from
the driver), every argument's size is checked against them when a plan is made.
"""

from __future__ import annotations

import ctypes
import operator
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar


class Scalar:
    """Base of the explicit-width scalar wrappers; `FORMAT` is the `struct` code of the C type."""

    __slots__ = ("value",)
    FORMAT: ClassVar[str] = ""
    C_TYPE: ClassVar[str] = ""

    def __init__(self, value: Any) -> None:
        # Range and type are checked when the value is packed (at launch), which keeps building a
        # wrapper as cheap as building a tuple; `check()` validates eagerly when wanted.
        self.value = value

    def check(self) -> Scalar:
        """Raise `ValueError` now if the value does not fit the C type; return self."""
        try:
            struct.pack("<" + self.FORMAT, self.value)
        except struct.error as error:
            raise ValueError(f"{self!r} does not fit {self.C_TYPE}: {error}") from error
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.value))


class I8(Scalar):
    """`int8_t`."""

    FORMAT, C_TYPE = "b", "int8_t"


class U8(Scalar):
    """`uint8_t`."""

    FORMAT, C_TYPE = "B", "uint8_t"


class I16(Scalar):
    """`int16_t`."""

    FORMAT, C_TYPE = "h", "int16_t"


class U16(Scalar):
    """`uint16_t`."""

    FORMAT, C_TYPE = "H", "uint16_t"


class I32(Scalar):
    """`int32_t` / `int`."""

    FORMAT, C_TYPE = "i", "int32_t"


class U32(Scalar):
    """`uint32_t` / `unsigned`."""

    FORMAT, C_TYPE = "I", "uint32_t"


class I64(Scalar):
    """`int64_t` / `long long`."""

    FORMAT, C_TYPE = "q", "int64_t"


class U64(Scalar):
    """`uint64_t` / `size_t`; also any 64-bit handle such as `ncclWindow_t`."""

    FORMAT, C_TYPE = "Q", "uint64_t"


class F32(Scalar):
    """`float`."""

    FORMAT, C_TYPE = "f", "float"


class F64(Scalar):
    """`double`."""

    FORMAT, C_TYPE = "d", "double"


class Bool(Scalar):
    """`bool` (one byte)."""

    FORMAT, C_TYPE = "?", "bool"


class Pointer(Scalar):
    """A device (or host-mapped) address passed as a pointer parameter (`T*`)."""

    FORMAT, C_TYPE = "Q", "void*"

    def __init__(self, value: Any) -> None:
        # Accept anything with data_ptr() (a torch tensor) as well as a raw integer address.
        self.value = value.data_ptr() if hasattr(value, "data_ptr") else value


class Opaque:
    """A struct passed by value, as its raw bytes (e.g. `ncclDevComm`: 200 bytes on NCCL 2.28.9)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes | bytearray | memoryview | ctypes.Structure | ctypes.Array) -> None:
        raw = bytes(data)
        if not raw:
            raise ValueError("Opaque needs at least one byte")
        self.data = raw

    def __repr__(self) -> str:
        return f"Opaque({len(self.data)} bytes)"


def _describe(arg: object) -> str:
    if isinstance(arg, Opaque):
        return f"Opaque({len(arg.data)} bytes)"
    return type(arg).__name__


class ArgumentPlan:
    """How to pack one argument-type signature for one kernel (built once, reused every launch)."""

    __slots__ = ("address", "buffer", "getters", "lock", "opaque_sizes", "pointer", "struct")

    def __init__(self, args: Sequence[object], param_sizes: Sequence[int] | None, what: str) -> None:
        if param_sizes is not None and len(args) != len(param_sizes):
            raise TypeError(f"{what} takes {len(param_sizes)} arguments, {len(args)} were given")
        fmt, offsets, getters, opaque_sizes = "<", [], [], []
        position = 0
        for index, arg in enumerate(args):
            code, size, getter = self._layout(arg, index, what)
            if isinstance(arg, Opaque):
                opaque_sizes.append((index, size))
            if param_sizes is not None and size != param_sizes[index]:
                raise TypeError(
                    f"{what}: argument {index} is {_describe(arg)} ({size} bytes) but the kernel's parameter "
                    f"{index} is {param_sizes[index]} bytes; pass a wrapper of that width"
                )
            # Host-side alignment only keeps each value tidy; the driver copies by size.
            aligned = (position + 7) // 8 * 8
            fmt += "x" * (aligned - position) + code
            offsets.append(aligned)
            position = aligned + size
            getters.append(getter)
        self.struct = struct.Struct(fmt)
        self.buffer = ctypes.create_string_buffer(max(self.struct.size, 1))
        base = ctypes.addressof(self.buffer)
        self.pointer = (ctypes.c_void_p * max(len(args), 1))(*[base + o for o in offsets])
        # NULL for a kernel without parameters, else the void*[] the driver reads.
        self.address = ctypes.addressof(self.pointer) if args else 0
        self.getters: tuple[Callable[[Any], Any], ...] = tuple(getters)
        self.opaque_sizes = tuple(opaque_sizes)
        self.lock = threading.Lock()

    @staticmethod
    def _layout(arg: object, index: int, what: str) -> tuple[str, int, Callable[[Any], Any]]:
        if isinstance(arg, Scalar):
            return arg.FORMAT, struct.calcsize("<" + arg.FORMAT), _value
        if isinstance(arg, Opaque):
            size = len(arg.data)
            return f"{size}s", size, _data
        if isinstance(arg, (bool, int, float)):
            raise TypeError(
                f"{what}: argument {index} is a plain Python {type(arg).__name__} ({arg!r}); its C width is "
                "ambiguous: wrap it as I32/U32/I64/U64/F32/F64/Bool (or Pointer for an address)"
            )
        if callable(getattr(arg, "data_ptr", None)):
            return "Q", 8, _data_ptr
        raise TypeError(
            f"{what}: argument {index} has unsupported type {type(arg).__name__}; use a tensor, Pointer, a scalar "
            "wrapper (I32, U64, F32, ...) or Opaque(bytes)"
        )

    def pack(self, args: Sequence[object]) -> int:
        """Write `args` into the buffer; return the address of the `void*[]` array.

        The caller must hold `self.lock` until the launch that reads the buffer has returned.
        """
        for index, size in self.opaque_sizes:
            # struct's "Ns" would silently pad or cut a struct of another size: refuse instead.
            if len(args[index].data) != size:  # type: ignore[attr-defined]
                raise TypeError(f"argument {index} is {args[index]!r}, but this launch plan expects {size} bytes")
        try:
            self.struct.pack_into(self.buffer, 0, *[get(arg) for get, arg in zip(self.getters, args, strict=True)])
        except struct.error as error:
            bad = [f"argument {i}: {a!r}" for i, a in enumerate(args) if isinstance(a, Scalar) and not _fits(a)]
            raise ValueError(f"kernel argument out of range for its C type ({'; '.join(bad) or error})") from error
        return self.address


def _fits(arg: Scalar) -> bool:
    try:
        arg.check()
    except ValueError:
        return False
    return True


# C-level accessors: no Python frame per argument per launch.
_value = operator.attrgetter("value")
_data = operator.attrgetter("data")
_data_ptr = operator.methodcaller("data_ptr")


def param_bytes(args: Sequence[object]) -> list[bytes]:
    """Each argument's bytes as the kernel receives them (little-endian, a pointer as 8 bytes), for
    code that replays a launch without Python (`deep_ep.backends.kernels.steady`)."""
    out = []
    for index, arg in enumerate(args):
        if isinstance(arg, Scalar):
            out.append(struct.pack("<" + arg.FORMAT, arg.value))
        elif isinstance(arg, Opaque):
            out.append(bytes(arg.data))
        elif callable(getattr(arg, "data_ptr", None)):
            out.append(struct.pack("<Q", arg.data_ptr()))  # type: ignore[attr-defined]
        else:
            raise TypeError(f"argument {index} has unsupported type {type(arg).__name__}")
    return out


def signature(args: Sequence[object]) -> tuple[type, ...]:
    """The cache key of a plan: the argument types (an `Opaque` of another size fails in `pack`)."""
    return tuple(map(type, args))
