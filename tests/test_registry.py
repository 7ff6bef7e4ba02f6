"""deep_ep.backends.registry: backends by name, imported on first use; the facade chooses through it."""

from __future__ import annotations

import subprocess
import sys
from typing import ClassVar

import pytest

from deep_ep.backends import registry
from deep_ep.backends.base import EPBackend
from deep_ep.backends.reference.backend import ReferenceBackend
from deep_ep.buffer import select_backend_class


class EchoBackend(EPBackend):
    """A backend that registers from outside the library (it moves nothing)."""

    name = "echo"
    supported: ClassVar[bool] = True

    @classmethod
    def is_supported(cls, group: object) -> bool:
        return cls.supported

    def dispatch(self, request):  # type: ignore[override]
        raise NotImplementedError

    def combine(self, request):  # type: ignore[override]
        raise NotImplementedError

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def test_builtin_backends_in_order_of_preference() -> None:
    assert registry.names() == ("kernels", "reference")
    assert registry.entry("kernels").device_types == ("cuda",)
    assert registry.entry("reference").device_types == ("cpu", "cuda")
    assert registry.load("reference") is ReferenceBackend


def test_a_cpu_group_never_imports_the_kernels() -> None:
    code = (
        "import sys\n"
        "from deep_ep.backends import registry\n"
        "assert not registry.supports('kernels', object(), 'cpu')\n"
        "print(sorted(m for m in sys.modules if m.startswith('deep_ep.backends.kernels')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_a_registered_backend_is_chosen_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    registry.register("echo", __name__, "EchoBackend")
    assert registry.names() == ("kernels", "reference", "echo")
    assert select_backend_class(object(), "echo") is EchoBackend  # type: ignore[arg-type]
    monkeypatch.setattr(EchoBackend, "supported", False)
    with pytest.raises(ValueError, match=r"`backend`='echo' does not support this group"):
        select_backend_class(object(), "echo")  # type: ignore[arg-type]
    registry.register("missing", "deep_ep.backends.no_such_backend", "MissingBackend")
    with pytest.raises(ValueError, match=r"needs deep_ep\.backends\.no_such_backend, which failed to import"):
        select_backend_class(object(), "missing")  # type: ignore[arg-type]
    assert not registry.supports("missing", object(), "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'auto'"):
        registry.register("auto", __name__, "EchoBackend")
