"""The `deep-ep` command (deep_ep/cli.py): info never crashes without a GPU; jit list/clear/warmup work on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from deep_ep.jit import compile_many
from deep_ep.jit.nccl_headers import find_nccl, version_string

from deep_ep.cli import build_parser, default_warmup_specs, warmup_specs


def deep_ep(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed `deep-ep` script (or `python -m deep_ep.cli` without one)."""
    script = Path(sys.executable).parent / "deep-ep"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "deep_ep.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=600, check=False
    )


def test_info_runs_without_a_gpu_and_reports_nccl_and_the_cache(jit_cache):
    result = deep_ep("info")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    install = find_nccl()
    assert f"NCCL library   {version_string(install.header_version)}" in out
    assert f"NCCL headers   {version_string(install.header_version)} ({install.include_dir})" in out
    assert f"JIT cache      {jit_cache} (0 entries, 0 B)" in out
    for name in ("torch", "nvcc", "cuda-bindings", "cuda-core", "GPUs"):
        assert any(line.startswith(name) for line in out.splitlines()), name
    assert "transport      none: CUDA is not available, so buffers use the reference backend" in out


def test_info_prints_not_found_instead_of_crashing(jit_cache, tmp_path):
    result = deep_ep("info", env={"EP_JIT_NVCC_COMPILER": str(tmp_path / "missing-nvcc")})
    assert result.returncode == 0, result.stderr
    (nvcc_line,) = [line for line in result.stdout.splitlines() if line.startswith("nvcc")]
    assert "not found" in nvcc_line and "EP_JIT_NVCC_COMPILER" in nvcc_line


@pytest.mark.nvcc
def test_jit_warmup_list_and_clear(jit_cache):
    first = deep_ep("jit", "warmup", "--arch", "sm_90a", "--filter", "peer_store")
    assert first.returncode == 0, first.stderr
    assert "1 kernels ready (1 compiled, 0 cached)" in first.stdout and "1/1 kernels" in first.stderr
    again = deep_ep("jit", "warmup", "--arch", "sm_90a", "--filter", "peer_store", "--no-progress")
    assert "1 kernels ready (0 compiled, 1 cached)" in again.stdout and "kernels" not in again.stderr

    listed = deep_ep("jit", "list")
    assert listed.returncode == 0 and f"{jit_cache}: 1 entries" in listed.stdout
    (row,) = [line for line in listed.stdout.splitlines() if "peer_store_impl" in line]
    assert "kernels" in row and "deep_ep::peer_store_impl<512>" in row and "sm_90a" in row and "KiB" in row

    cleared = deep_ep("jit", "clear")
    assert cleared.returncode == 0 and "removed 1 entries" in cleared.stdout
    assert f"{jit_cache}: 0 entries" in deep_ep("jit", "list").stdout


@pytest.mark.nvcc
def test_jit_warmup_dry_run_lists_the_registry_and_errors_are_clean(jit_cache):
    dry = deep_ep("jit", "warmup", "--arch", "sm_90a", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    names = [spec.display_name for spec in warmup_specs()]
    assert f"{len(names)} kernels" in dry.stdout and all(f"missing {name}" in dry.stdout for name in names)
    assert "deep_ep::peer_store_impl<512>" in names
    failed = deep_ep("jit", "warmup", "--filter", "peer_store", env={"EP_JIT_ARCH": "not-an-arch"})
    assert failed.returncode == 1 and "deep-ep: error:" in failed.stderr and "architecture" in failed.stderr


@pytest.mark.nvcc
def test_default_warmup_set_compiles_and_the_parser_has_a_place_for_more_commands(jit_cache):
    (entry,) = compile_many(default_warmup_specs())
    assert entry.name == "deep_ep::peer_store_impl<512>"
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps subcommands here
    assert {"info", "jit"} <= set(commands)


@pytest.mark.nvcc
def test_jit_warmup_compiles_the_shape_it_is_given(jit_cache):
    dry = deep_ep("jit", "warmup", "--arch", "sm_90a", "--dry-run", "--ranks", "8", "--hidden", "4096", "--topk", "6",
                  "--experts", "64")  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    names = [line.split(maxsplit=1)[1] for line in dry.stdout.splitlines() if line.startswith("  ")]
    # BF16 rows of 8192 bytes, no masking, over LSA (one NVLink domain)
    assert "deep_ep::dispatch_impl<8, 8192, 0, 6, 512, false, false, deep_ep::transport::Lsa>" in names
    assert any(name.startswith("deep_ep::dispatch_impl<8, 4096, 128,") for name in names)  # FP8, per-128 scales
    assert any(name.startswith("deep_ep::combine_impl<8, 4096, 6, 6,") for name in names)  # 8 local experts >= top-6
    assert not any("<2," in name for name in names)
    bad = deep_ep("jit", "warmup", "--dry-run", "--ranks", "3", "--experts", "64")
    assert bad.returncode == 1 and "`--experts` must be a multiple of `--ranks` (3), got 64" in bad.stderr
