"""Shared fixtures: a private JIT cache for the session (never ~/.cache), a target arch on CPU, and enough
CUDA hardware queues for virtual ranks."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch.distributed

# Virtual ranks (deep_ep.loopback) need a hardware queue per stream and every kernel loaded when CUDA
# starts (a lazy load waits for the running kernels); both must be set before CUDA starts
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def nvcc_missing_reason() -> str | None:
    """Why nvcc (the CUDA toolkit) cannot be used here, or `None` when `deep_ep.jit` finds one."""
    from deep_ep.jit import compiler
    from deep_ep.jit.errors import JITError

    try:
        compiler.find_nvcc()
    except JITError as error:
        return f"needs nvcc and the CUDA toolkit to compile kernels: {error}"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip, with the reason, the tests that compile (marker `nvcc`, or the `sm90a_checked_cache` fixture)
    where nvcc is not found, instead of failing them."""
    if item.get_closest_marker("nvcc") is None and "sm90a_checked_cache" not in getattr(item, "fixturenames", ()):
        return
    reason = nvcc_missing_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True, scope="session")
def _jit_session_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point EP_JIT_CACHE_DIR at a session folder; without a GPU, compile for sm_90a (EP_JIT_ARCH)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("EP_JIT_CACHE_DIR", str(tmp_path_factory.mktemp("jit-cache")))
    if not os.environ.get("EP_JIT_ARCH") and not _gpu_available():
        patch.setenv("EP_JIT_ARCH", "sm_90a")
    yield
    patch.undo()


@pytest.fixture(scope="module")
def group() -> Iterator[torch.distributed.ProcessGroup]:
    """A process group of one CPU rank (gloo), for the tests of one buffer's own checks."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.fixture
def jit_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty JIT cache folder for one test (EP_JIT_CACHE_DIR points at it)."""
    path = tmp_path / "jit-cache"
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(path))
    return path


@pytest.fixture
def sm90a_checked_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Compile for sm_90a with ptxas checks (no local memory, no spills: EP_JIT_PTXAS_CHECK) into one
    cache folder that every compile test of the session shares (a kernel is compiled once)."""
    path = tmp_path_factory.getbasetemp() / "jit-sm90a-checked"
    monkeypatch.setenv("EP_JIT_ARCH", "sm_90a")
    monkeypatch.setenv("EP_JIT_PTXAS_CHECK", "1")
    monkeypatch.setenv("EP_JIT_CACHE_DIR", str(path))
    return path
