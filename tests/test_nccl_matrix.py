"""Every kernel and host shim that includes NCCL compiles against each NCCL release we support
(`EP_JIT_NCCL_ROOT`, compile only): 2.28.9 (the GPU machine's), 2.30.4 (the scale-out floor), 2.31.2
and 2.32.3. The headers come from the `nvidia-nccl-cu12` wheels on PyPI, downloaded once per session."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deep_ep.jit import JITCompileError, NCCLHeadersError, compile_spec, load_host_library
from deep_ep.jit.host import build_host_library
from deep_ep.jit.nccl_headers import find_nccl, version_string

from deep_ep.backends.kernels import specs as kernel_specs
from deep_ep.backends.kernels.nccl import device_comm

NCCL_MATRIX = ("2.28.9", "2.30.4", "2.31.2", "2.32.3")


@pytest.fixture(scope="session")
def nccl_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`version -> nvidia/nccl folder` of each release of the matrix (headers and library)."""
    base = tmp_path_factory.mktemp("nccl-matrix")
    roots = {}
    for version in NCCL_MATRIX:
        folder = base / version
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder),
                        f"nvidia-nccl-cu12=={version}"], check=True, timeout=600)  # fmt: skip
        (wheel,) = folder.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(folder, [n for n in archive.namelist() if n.startswith(("nvidia/nccl/include/",
                                                                                      "nvidia/nccl/lib/"))])  # fmt: skip
        wheel.unlink()
        roots[version] = folder / "nvidia" / "nccl"
    return roots


@pytest.mark.parametrize("version", NCCL_MATRIX)
def test_nccl_kernels_and_shims_compile_against_each_release(nccl_roots, version, sm90a_checked_cache, monkeypatch):
    monkeypatch.setenv("EP_JIT_NCCL_ROOT", str(nccl_roots[version]))
    install = find_nccl()
    assert version_string(install.header_version) == version and "compile only" in install.origin
    nccl_specs = [spec for spec in kernel_specs.warmup_specs() if spec.use_nccl]
    assert nccl_specs, "no kernel includes NCCL"
    for spec in nccl_specs:
        entry = compile_spec(spec)  # EP_JIT_PTXAS_CHECK is on: no stack, no spills
        assert entry.metadata["nccl_version"] == version, entry.metadata
    shim = build_host_library("deep_ep_nccl_shim", device_comm._SHIM_SOURCE)
    assert shim.metadata["nccl_version"] == version and shim.binary_path.stat().st_size > 0
    with pytest.raises(NCCLHeadersError, match="for compiling only"):
        load_host_library("deep_ep_nccl_shim", device_comm._SHIM_SOURCE)


@pytest.mark.parametrize("version", NCCL_MATRIX)
def test_the_gin_transport_compiles_per_backend_from_nccl_2_30_4(nccl_roots, version, sm90a_checked_cache,
                                                                 monkeypatch):  # fmt: skip
    """The transport self-test over GIN (transport/gin.cuh), each GIN backend alone: no spills and no
    stack, except the 8 bytes NCCL 2.30.4's proxy path needs (transport.md); 2.28.9 is refused."""
    monkeypatch.setenv("EP_JIT_NCCL_ROOT", str(nccl_roots[version]))
    if version == "2.28.9":
        with pytest.raises(JITCompileError, match=r"GIN transport needs NCCL >= 2\.30\.4"):
            compile_spec(kernel_specs.transport_ping_spec("gin", "PROXY"))
        return
    for backend in ("PROXY", "GDAKI"):
        allowed_stack = 8 if (version, backend) == ("2.30.4", "PROXY") else 0
        monkeypatch.setenv("EP_JIT_PTXAS_CHECK", "0" if allowed_stack else "1")
        entry = compile_spec(kernel_specs.transport_ping_spec("gin", backend))
        assert entry.metadata["nccl_version"] == version, entry.metadata
        for resources in entry.metadata["resources"].values():
            assert resources["spill_stores"] == resources["local_memory"] == 0, (version, backend, resources)
            assert resources["stack_frame"] <= allowed_stack, (version, backend, resources)


def test_an_override_without_headers_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("EP_JIT_NCCL_ROOT", str(tmp_path))
    with pytest.raises(NCCLHeadersError, match=r"no include/nccl\.h there"):
        find_nccl()
