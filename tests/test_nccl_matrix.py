"""Every kernel and host shim that includes NCCL compiles against each NCCL release we support
(`EP_JIT_NCCL_ROOT`, compile only): 2.28.9 (the GPU machine's), 2.30.4 (the scale-out floor), 2.31.2
and 2.32.3; every kernel of one MoE shape over GIN, per GIN backend, from 2.30.4 on. The headers come
from the `nvidia-nccl-cu12` wheels on PyPI, downloaded once per session (or taken from
`EP_TEST_NCCL_MATRIX_DIR/<version>/nvidia/nccl` where a run has them unpacked already)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from deep_ep.jit import JITCompileError, NCCLHeadersError, compile_many, compile_spec, load_host_library
from deep_ep.jit.host import build_host_library
from deep_ep.jit.nccl_headers import find_nccl, version_string
from test_gin_links import compile_layout_probe

from deep_ep.backends.kernels import specs as kernel_specs
from deep_ep.backends.kernels.nccl import device_comm

NCCL_MATRIX = ("2.28.9", "2.30.4", "2.31.2", "2.32.3")
GIN_MATRIX = ("2.30.4", "2.31.2", "2.32.3")
# The GIN backends CI compiles every kernel for (GPI and EFA_GDA build the same way, one backend at a time)
GIN_CI_BACKENDS = ("PROXY", "GDAKI")
# The stack frame NCCL 2.30.4's PROXY path needs (measured on the MoE shape below: 8 or 16 bytes per
# kernel, no spills, no local memory); every other (release, backend) needs none. 2.30.4's proxy
# `ncclGin` calls keep a small struct on the stack that later releases keep in registers.
GIN_STACK_ALLOWANCE = {("2.30.4", "PROXY"): 16}


def _matrix_root(version: str) -> Path | None:
    """`EP_TEST_NCCL_MATRIX_DIR`'s `nvidia/nccl` folder of `version`, when it has one."""
    base = os.environ.get("EP_TEST_NCCL_MATRIX_DIR")
    root = Path(base) / version / "nvidia" / "nccl" if base else None
    return root if root is not None and (root / "include" / "nccl.h").is_file() else None


@pytest.fixture(scope="session")
def nccl_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`version -> nvidia/nccl folder` of each release of the matrix (headers and library)."""
    base = tmp_path_factory.mktemp("nccl-matrix")
    roots = {}
    for version in NCCL_MATRIX:
        unpacked = _matrix_root(version)
        if unpacked is not None:
            roots[version] = unpacked
            continue
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


def test_nccl_2_28_9_refuses_the_gin_transport(nccl_roots, sm90a_checked_cache, monkeypatch):
    monkeypatch.setenv("EP_JIT_NCCL_ROOT", str(nccl_roots["2.28.9"]))
    for transport in ("gin-proxy", "gin-gdaki"):
        with pytest.raises(JITCompileError, match=r"GIN transport needs NCCL >= 2\.30\.4"):
            compile_spec(kernel_specs.transport_ping_spec(transport))


def _gin_specs(version: str, backend: str) -> list:
    """Every kernel of one MoE shape (EP8, hidden 4096, top-8, 64 experts, BF16 and FP8 with per-128
    scales) over `gin-<backend>`, the fault post, the transport self-test and Engram's fetch; with rank
    masking and hybrid mode's dispatches too on the primary release (2.32.3) only, to keep CI's 2 cores
    within budget."""
    transport = f"gin-{backend.lower()}"
    specs = kernel_specs.moe_specs(8, 4096, 8, 64, (128,), False, transport)
    specs += [kernel_specs.post_fault_spec(transport), kernel_specs.transport_ping_spec(transport),
              kernel_specs.engram_fetch_spec("int64", transport)]  # fmt: skip
    if version == "2.32.3":
        specs += kernel_specs.moe_specs(8, 4096, 8, 64, (128,), True, transport)
        # Hybrid mode's dispatches (issue 17), fresh and cached, BF16 (FP8 differs in its scales' bytes), its
        # forwarding combines and its node-stage combine epilogue
        specs += [kernel_specs.dispatch_spec(8, 8192, 0, 8, cached, False, f"hybrid-{transport}")
                  for cached in (False, True)]  # fmt: skip
        specs += [kernel_specs.combine_spec(8, 4096, 8, 1, expand, False, f"hybrid-{transport}")
                  for expand in (False, True)]  # fmt: skip
        specs.append(kernel_specs.combine_epilogue_spec(8, 4096, 8, 1, False, f"hybrid-{transport}"))
    return list(dict.fromkeys(specs))


@pytest.mark.parametrize("version", GIN_MATRIX)
def test_every_kernel_compiles_over_each_gin_backend(nccl_roots, version, sm90a_checked_cache, monkeypatch,
                                                    tmp_path):  # fmt: skip
    """Each GIN backend alone (`specs.GIN_BACKENDS`), every kernel of one MoE shape, in parallel
    (ninja, both cores): EP_JIT_PTXAS_CHECK (no stack, no spills, no local memory), except the stack
    frame NCCL 2.30.4's PROXY path needs (`GIN_STACK_ALLOWANCE`, still no spills). Compiling gin.cuh
    also checks its `Gin::Args` layout against the host's (static_asserts), and a probe checks the
    host's formula (`gin_links.gin_args_layout`) against the struct of this release."""
    monkeypatch.setenv("EP_JIT_NCCL_ROOT", str(nccl_roots[version]))
    assert version_string(find_nccl().header_version) == version
    compile_layout_probe(tmp_path)
    for allowance in (False, True):  # the checked kernels, then those with a stack allowance
        backends = [b for b in GIN_CI_BACKENDS if ((version, b) in GIN_STACK_ALLOWANCE) is allowance]
        if not backends:
            continue
        monkeypatch.setenv("EP_JIT_PTXAS_CHECK", "0" if allowance else "1")
        specs = [(backend, spec) for backend in backends for spec in _gin_specs(version, backend)]
        entries = compile_many([spec for _, spec in specs], jobs=2)
        for (backend, spec), entry in zip(specs, entries, strict=True):
            allowed_stack = GIN_STACK_ALLOWANCE.get((version, backend), 0)
            assert entry.metadata["nccl_version"] == version, entry.metadata
            assert f"-DNCCL_GIN_{backend}_ENABLE=1" in entry.metadata["flags"], entry.metadata["flags"]
            for resources in entry.metadata["resources"].values():
                where = (version, backend, spec.display_name, resources)
                assert resources["spill_stores"] == resources["spill_loads"] == resources["local_memory"] == 0, where
                assert resources["stack_frame"] <= allowed_stack, where


def test_an_override_without_headers_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("EP_JIT_NCCL_ROOT", str(tmp_path))
    with pytest.raises(NCCLHeadersError, match=r"no include/nccl\.h there"):
        find_nccl()
