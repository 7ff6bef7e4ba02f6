"""deep_ep: expert-parallel dispatch/combine for Mixture-of-Experts models.

Importing the package is cheap: torch and cuda-python load only when a name that needs them is
first used, so `deep-ep info` and the JIT tools start fast and work without a GPU.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> module that defines it (loaded on first access, PEP 562).
_LAZY = {
    "ElasticBuffer": "deep_ep.buffer",
    "EPHandle": "deep_ep.handle",
    "EventOverlap": "deep_ep.event",
    "EPTimeoutError": "deep_ep.errors",
    "topk_idx_t": "deep_ep.buffer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deep_ep' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
