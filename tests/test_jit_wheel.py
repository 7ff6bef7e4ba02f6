"""deep_ep.paths + packaging: the CUDA headers ship in the wheel and are found there; an editable install finds the checkout's."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

from deep_ep.paths import get_include_dir

REPO = Path(__file__).resolve().parents[1]
HEADER = Path("deep_ep/kernels/peer_store.cuh")


def _setuptools_is_recent() -> bool:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0]) >= 77
    except importlib.metadata.PackageNotFoundError:
        return False


def _run(command: list[str], cwd: Path | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_editable_install_finds_the_checkout_headers():
    assert get_include_dir() == REPO / "include"
    assert (get_include_dir() / HEADER).is_file()


def test_wheel_installed_in_a_bare_venv_finds_its_own_headers(tmp_path):
    # Build from a copy so the shared checkout gets no build/ or egg-info folders.
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("deep_ep", "jit", "include"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    # Offline when this environment's setuptools can build the project, else with an isolated build env.
    isolation = ["--no-build-isolation"] if _setuptools_is_recent() else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(wheels), str(source)])
    (wheel,) = wheels.glob("deep_ep-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])  # no system site packages
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)])
    probe = "import sys, deep_ep.paths as p; print(p.get_include_dir()); print(sys.prefix); print(sys.path)"
    include_line, prefix, path = _run([str(python), "-c", probe], cwd=tmp_path).splitlines()
    include_dir = Path(include_line)
    assert include_dir.is_relative_to(venv) and Path(prefix) == venv
    assert str(REPO) not in path and sys.prefix not in path.replace(str(venv), "")  # nothing leaks in
    assert include_dir.parent.name == "deep_ep" and include_dir.name == "include"
    assert (include_dir / HEADER).read_bytes() == (REPO / "include" / HEADER).read_bytes()
    assert (include_dir / "deep_ep" / "common" / "ptx.cuh").is_file()


def test_every_python_package_of_the_checkout_is_listed_for_the_wheel():
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(("deep_ep", *p.parent.relative_to(REPO / "deep_ep").parts))
        for p in (REPO / "deep_ep").rglob("__init__.py")
    }
    found |= {
        ".".join(("deep_ep.jit", *p.parent.relative_to(REPO / "jit").parts))
        for p in (REPO / "jit").rglob("__init__.py")
    }
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
