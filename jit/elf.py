"""Read kernel names out of a cubin's ELF symbol table, without a GPU.

nvcc puts each `__global__` function in its own section `.text.<mangled name>` and gives it a
`STT_FUNC` symbol of the same name; non-inlined device functions it calls share that section
under a different (local) name. So "STT_FUNC symbol whose section is `.text.<symbol>`" selects
exactly the kernels.
"""

from __future__ import annotations

import struct

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_SHT_SYMTAB = 2
_STT_FUNC = 2
_SHN_LORESERVE = 0xFF00

# ELF64 little-endian layouts (see the System V ABI): section header and symbol table entry.
_SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # name type flags addr offset size link info align entsize
_SYMBOL = struct.Struct("<IBBHQQ")  # name info other shndx value size


class ELFError(ValueError):
    """The bytes are not a well-formed 64-bit little-endian ELF file."""


def _c_string(table: bytes, offset: int) -> str:
    end = table.find(b"\0", offset)
    if end < 0:
        raise ELFError(f"string at offset {offset} is not NUL-terminated")
    return table[offset:end].decode("utf-8", errors="replace")


def _sections(data: bytes) -> list[tuple[int, int, int, int, int, int]]:
    """Return (name_offset, type, offset, size, link, entsize) of every section."""
    if len(data) < 64 or data[:4] != _ELF_MAGIC:
        raise ELFError("not an ELF file (bad magic or shorter than an ELF header)")
    if data[4] != _ELFCLASS64 or data[5] != _ELFDATA2LSB:
        raise ELFError("only 64-bit little-endian ELF (what nvcc writes) is supported")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shentsize != _SECTION_HEADER.size or shoff + shnum * shentsize > len(data):
        raise ELFError("section header table is truncated or malformed")
    result = []
    for index in range(shnum):
        name, kind, _flags, _addr, offset, size, link, _info, _align, entsize = _SECTION_HEADER.unpack_from(
            data, shoff + index * shentsize
        )
        if kind != 8 and offset + size > len(data):  # 8 = SHT_NOBITS occupies no file space
            raise ELFError(f"section {index} extends past the end of the file (truncated?)")
        result.append((name, kind, offset, size, link, entsize))
    return result


def kernel_symbols(data: bytes) -> list[str]:
    """Return the mangled names of the kernels (`__global__` functions) in a cubin.

    Arguments:
        data: the cubin's bytes.

    Returns:
        The names, in symbol-table order.

    Raises:
        ELFError: when `data` is not a well-formed ELF64 file or has no symbol table.
    """
    sections = _sections(data)
    (shstrndx,) = struct.unpack_from("<H", data, 0x3E)
    if shstrndx >= len(sections):
        raise ELFError("section name table index out of range")
    _, _, shstr_offset, shstr_size, _, _ = sections[shstrndx]
    shstrtab = data[shstr_offset : shstr_offset + shstr_size]
    section_names = [_c_string(shstrtab, s[0]) for s in sections]

    symtabs = [s for s in sections if s[1] == _SHT_SYMTAB]
    if not symtabs:
        raise ELFError("no symbol table (.symtab) in the cubin")
    names: list[str] = []
    for _, _, offset, size, link, entsize in symtabs:
        if entsize != _SYMBOL.size or link >= len(sections):
            raise ELFError("malformed symbol table")
        _, _, str_offset, str_size, _, _ = sections[link]
        strtab = data[str_offset : str_offset + str_size]
        for position in range(offset, offset + size - entsize + 1, entsize):
            name_offset, info, _other, shndx, _value, _size = _SYMBOL.unpack_from(data, position)
            if info & 0xF != _STT_FUNC or shndx == 0 or shndx >= min(len(sections), _SHN_LORESERVE):
                continue
            name = _c_string(strtab, name_offset)
            if section_names[shndx] == f".text.{name}":
                names.append(name)
    return names


def single_kernel_symbol(data: bytes, what: str = "cubin") -> str:
    """Return the mangled name of the only kernel in a cubin.

    Raises:
        ELFError: when the cubin holds no kernel or more than one (a spec must produce one).
    """
    names = kernel_symbols(data)
    if len(names) != 1:
        raise ELFError(
            f"{what}: expected exactly one kernel in the cubin, found {len(names)}: {names}; a header used by a "
            "spec must not define non-template kernels or instantiate other kernel templates"
        )
    return names[0]
