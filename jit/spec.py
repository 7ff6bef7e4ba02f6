"""Kernel specs and the tiny `.cu` file generated from each.

A `KernelSpec` names one instantiation of one `__global__` function template that lives in a
header: the header, the template, its template arguments and its C++ parameter list. The
generated source includes the header and explicitly instantiates exactly that template, so the
cubin holds exactly one kernel and its mangled name can be read back from the ELF symbol table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

# A template argument: a C++ int, a C++ bool, or verbatim C++ text (a type name or expression).
TemplateArg = bool | int | str

_QUALIFIED_NAME = re.compile(r"^(::)?[A-Za-z_]\w*(::[A-Za-z_]\w*)*$")


def render_template_arg(arg: TemplateArg) -> str:
    """Render one template argument as C++ text.

    `bool` becomes `true`/`false`, `int` its decimal value, `str` is used verbatim (type names
    such as `"float"` or `"__nv_bfloat16"`, or any constant expression). Anything else is a
    `TypeError`: floats cannot be non-type template arguments in C++17.
    """
    # NOTES: bool is tested first because it is a subclass of int.
    if isinstance(arg, bool):
        return "true" if arg else "false"
    if isinstance(arg, int):
        return str(arg)
    if isinstance(arg, str):
        if not arg.strip() or "\n" in arg:
            raise ValueError(f"template argument {arg!r} must be non-empty, single-line C++ text")
        return arg.strip()
    raise TypeError(f"template argument {arg!r} has type {type(arg).__name__}; expected bool, int or str (C++ text)")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: which template in which header, instantiated how, compiled with what.

    Arguments:
        header: header path relative to one of `include_dirs`, e.g. `"deep_ep/kernels/peer_store.cuh"`.
        name: fully qualified template name, e.g. `"deep_ep::peer_store_impl"`.
        template_args: the template arguments (`bool`, `int`, or C++ text for types).
        param_types: the kernel's C++ parameter types, as written in its declaration, e.g.
            `("ncclDevComm", "ncclWindow_t", "uint64_t", "const int4*", "uint64_t")`.
        include_dirs: folders passed to nvcc with `-I` (after the NCCL headers when `use_nccl`).
        extra_flags: extra nvcc flags, e.g. `("-DkDebug=1",)`; they are part of the cache key.
        use_nccl: compile against the NCCL headers of the loaded (or installed wheel) libnccl.
    """

    header: str
    name: str
    template_args: tuple[TemplateArg, ...] = ()
    param_types: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()
    extra_flags: tuple[str, ...] = ()
    use_nccl: bool = False
    # Rendered once; not part of equality (it is derived from the fields above).
    _rendered_args: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so specs hash and compare by value.
        for attr in ("template_args", "param_types", "include_dirs", "extra_flags"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))
        object.__setattr__(self, "include_dirs", tuple(str(Path(d).resolve()) for d in self.include_dirs))
        if not _QUALIFIED_NAME.match(self.name):
            raise ValueError(f"kernel name {self.name!r} is not a qualified C++ identifier (e.g. 'ns::kernel_impl')")
        header = PurePosixPath(self.header)
        if header.is_absolute() or ".." in header.parts or not self.header:
            raise ValueError(f"header {self.header!r} must be a relative path inside an include dir")
        for text in self.param_types:
            if not isinstance(text, str) or not text.strip() or "\n" in text:
                raise ValueError(f"parameter type {text!r} must be non-empty, single-line C++ text")
        for flag in self.extra_flags:
            if not isinstance(flag, str):
                raise TypeError(f"extra flag {flag!r} must be a str")
        object.__setattr__(self, "_rendered_args", tuple(render_template_arg(a) for a in self.template_args))

    @property
    def display_name(self) -> str:
        """The instantiation as C++ reads it, e.g. `deep_ep::peer_store_impl<512>`."""
        return f"{self.name}<{', '.join(self._rendered_args)}>"

    def find_header(self) -> Path:
        """Return the header's path in the first include dir that has it.

        Raises:
            FileNotFoundError: when no include dir holds the header.
        """
        for include_dir in self.include_dirs:
            candidate = Path(include_dir) / self.header
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"kernel header {self.header!r} not found in include dirs {list(self.include_dirs)}")

    def to_json(self) -> dict[str, object]:
        """A JSON-ready description, stored in the cache entry's metadata."""
        return {
            "header": self.header,
            "name": self.name,
            "template_args": list(self._rendered_args),
            "param_types": list(self.param_types),
            "include_dirs": list(self.include_dirs),
            "extra_flags": list(self.extra_flags),
            "use_nccl": self.use_nccl,
        }


def nccl_version_guard(expected_code: int) -> str:
    """C preprocessor lines that stop the build when `nccl.h` is not NCCL `expected_code`.

    nvcc resolves `<nccl.h>` itself; the guard proves the header it found is the one whose version
    the Python side read (a stale `/usr/include/nccl.h` could otherwise win silently).
    """
    return (
        "#include <nccl.h>\n"
        f"#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE != {int(expected_code)}\n"
        f'#error "deep_ep.jit: the nccl.h nvcc found is not NCCL_VERSION_CODE {int(expected_code)}, '
        'the version deep_ep.jit selected: another nccl.h (e.g. /usr/include) shadows the NCCL wheel headers"\n'
        "#endif\n"
    )


def generate_source(spec: KernelSpec, nccl_version_code: int | None = None) -> str:
    """Return the `.cu` text that explicitly instantiates exactly the kernel of `spec`.

    Arguments:
        spec: the kernel.
        nccl_version_code: the `NCCL_VERSION_CODE` the included `nccl.h` must have; required
            when `spec.use_nccl`, ignored otherwise.

    Returns:
        The source text, e.g. `template __global__ void ns::k<512>(int, const int4*);` after the
        includes.
    """
    lines = [f"// Generated by deep_ep.jit for {spec.display_name}: one explicit instantiation, nothing else."]
    if spec.use_nccl:
        if nccl_version_code is None:
            raise ValueError(f"{spec.display_name} uses NCCL: the expected NCCL_VERSION_CODE is required")
        lines.append(nccl_version_guard(nccl_version_code).rstrip("\n"))
    lines.append(f"#include <{spec.header}>")
    lines.append("")
    params = ", ".join(spec.param_types)
    lines.append(f"template __global__ void {spec.display_name}({params});")
    return "\n".join(lines) + "\n"
