"""The import graph of `deep_ep`: no cycles, and the facade imports no backend.

The graph is built statically: every `deep_ep/**/*.py` (and `jit/**/*.py`, importable as
`deep_ep.jit`) is parsed, and each `import` / `from ... import` of a `deep_ep` module is an edge,
relative and function-level imports included; imports under `if TYPE_CHECKING:` are skipped (they
never run). Names imported by string (`importlib.import_module`, the backend registry) are not edges.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each importable package's sources live in a checkout
SOURCES = {"deep_ep": ROOT / "deep_ep", "deep_ep.jit": ROOT / "jit"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, whether it is a package's `__init__.py`)."""
    modules = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [prefix, *path.relative_to(folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below `node`, at any depth, except the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for statement in child.orelse:
                yield from _imports(ast.Module(body=[statement], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _imports(child)


def _resolve(name: str, modules: dict) -> str | None:
    """The module `name` names, or the nearest package above it that is ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the `deep_ep` modules it imports."""
    modules = _modules()
    graph = {}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        targets = set()
        for statement in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(statement, ast.Import):
                names = [alias.name for alias in statement.names]
            else:
                base = statement.module or ""
                if statement.level:
                    anchor = package.split(".")[: len(package.split(".")) - statement.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from package import submodule` imports the submodule
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in statement.names
                ]
            targets.update(target for name in names if (target := _resolve(name, modules)) is not None)
        targets.discard(module)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or `None` (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(step) == 1:
                return [*path[path.index(step) :], step]
            elif step not in state:
                state[step] = 1
                path.append(step)
                stack.append(iter(sorted(graph.get(step, ()))))
    return None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "deep_ep.backends.kernels.specs" in graph["deep_ep.backends.kernels.runtime"]  # from . import specs
    assert "deep_ep.planner" in graph["deep_ep.backends.base"]  # from deep_ep import planner
    assert "deep_ep.backends.kernels.transport" in graph["deep_ep.loopback.world"]  # inside a function
    assert "deep_ep.backends.base" not in graph["deep_ep.handle"]  # under TYPE_CHECKING only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_deep_ep_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_importing_the_facade_imports_no_backend():
    code = "import sys, deep_ep.buffer; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    modules = loaded.stdout.split()
    assert "deep_ep.buffer" in modules and "deep_ep.backends.registry" in modules
    unwanted = ("deep_ep.backends.kernels", "deep_ep.backends.reference", "deep_ep.jit", "deep_ep.loopback")
    pulled = [m for m in modules if m.startswith(unwanted)]
    assert not pulled, f"importing deep_ep.buffer imported {pulled}"
