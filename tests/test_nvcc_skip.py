"""Without nvcc (the CUDA toolkit) the compile tests skip with the reason and the rest of their files runs
(tests/conftest.py: the marker `nvcc` and the `sm90a_checked_cache` fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILE_TESTS = [
    "tests/test_kernels_compile.py",
    "tests/loopback/test_loopback_compile.py",
    "tests/test_jit_elf.py",
    "tests/test_jit_cache.py",
    "tests/test_layout.py",
    "tests/test_cli.py",
]


def test_compile_tests_skip_with_the_reason_when_nvcc_is_missing(tmp_path):
    env = os.environ | {"EP_JIT_NVCC_COMPILER": str(tmp_path / "no-such-nvcc")}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *COMPILE_TESTS]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and "failed" not in summary and "error" not in summary, result.stdout[-4000:]
    assert "skipped" in summary and "passed" in summary, summary  # compile tests skip, the others still run
    assert "needs nvcc and the CUDA toolkit to compile kernels: EP_JIT_NVCC_COMPILER=" in result.stdout
