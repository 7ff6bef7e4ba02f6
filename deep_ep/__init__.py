"""deep_ep: expert-parallel dispatch/combine for Mixture-of-Experts models.

Importing the package is cheap: torch and cuda-python load only when a name that needs them is
first used, so `deep-ep info` and the JIT tools start fast and work without a GPU.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

# Public name -> module that defines it (loaded on first access, PEP 562).
_LAZY = {
    "ElasticBuffer": "deep_ep.buffer",
    "EPHandle": "deep_ep.handle",
    "EventOverlap": "deep_ep.event",
    "EventHandle": "deep_ep.event",
    "get_physical_domain_size": "deep_ep.domains",
    "get_logical_domain_size": "deep_ep.domains",
    "EPError": "deep_ep.errors",
    "EPTimeoutError": "deep_ep.errors",
    "EPOperationMismatchError": "deep_ep.errors",
    "EPPeerError": "deep_ep.errors",
    "topk_idx_t": "deep_ep.buffer",
    "ExpertParallelMoE": "deep_ep.nn",
}


class _CheckoutJitFinder(importlib.abc.MetaPathFinder):
    """Finds `deep_ep.jit` in a source checkout used without installing (`PYTHONPATH=<checkout>`).

    Installed packages hold `deep_ep/jit/`; a checkout keeps its sources in the top-level `jit/`
    folder, which setuptools maps into the package at install time.
    """

    def __init__(self, jit_dir: Path) -> None:
        self.jit_dir = jit_dir

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "deep_ep.jit":
            return None
        return importlib.util.spec_from_file_location(
            name, self.jit_dir / "__init__.py", submodule_search_locations=[str(self.jit_dir)]
        )


_package_dir = Path(__file__).resolve().parent
if not (_package_dir / "jit").is_dir() and (_package_dir.parent / "jit" / "__init__.py").is_file():
    sys.meta_path.append(_CheckoutJitFinder(_package_dir.parent / "jit"))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
