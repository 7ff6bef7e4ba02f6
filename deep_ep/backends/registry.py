"""The backends an `ElasticBuffer` can run on, by name: the facade finds them here and nowhere else.

Each backend is registered with the module that defines its class, which is imported only when the
backend is first asked for: importing the facade imports no backend, and a CPU group never imports
the kernels (nor CUDA or NCCL code). The order of registration is the order of preference of
`backend='auto'`: the facade takes the first backend that every rank supports.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

    from deep_ep.backends.base import EPBackend


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend.

    Attributes:
        name: what `ElasticBuffer(backend=...)` calls it.
        module: the module that defines the class (imported on first use).
        class_name: the `EPBackend` subclass in `module`.
        device_types: the devices of the groups it can serve (`'cpu'`, `'cuda'`); for other groups
            it is not even imported.
    """

    name: str
    module: str
    class_name: str
    device_types: tuple[str, ...]


_ENTRIES: dict[str, BackendEntry] = {}


def register(name: str, module: str, class_name: str, device_types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Register a backend under `name` (after those registered before, in the order of preference
    of `'auto'`); registering a name again replaces its entry in place."""
    if name == "auto":
        raise ValueError("registry: `name` must not be 'auto' (it means: choose among the registered backends)")
    _ENTRIES[name] = BackendEntry(name, module, class_name, tuple(device_types))


def names() -> tuple[str, ...]:
    """The registered backends' names, in the order of preference of `'auto'`."""
    return tuple(_ENTRIES)


def entry(name: str) -> BackendEntry:
    """The entry of a registered backend (`KeyError` for an unknown name)."""
    return _ENTRIES[name]


def load(name: str) -> type[EPBackend]:
    """The class of backend `name`, importing its module (which raises `ImportError` when it cannot
    be imported here)."""
    backend = _ENTRIES[name]
    return getattr(importlib.import_module(backend.module), backend.class_name)


def supports(name: str, group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether backend `name` can serve `group`, whose tensors live on `device_type`, from this rank
    (local answer, no communication): it serves that device type, imports, and accepts the group."""
    if device_type not in _ENTRIES[name].device_types:
        return False
    try:
        backend_class = load(name)
    except ImportError:
        return False
    return bool(backend_class.is_supported(group))


register("kernels", "deep_ep.backends.kernels.backend", "NvlinkBackend", device_types=("cuda",))
register("reference", "deep_ep.backends.reference.backend", "ReferenceBackend")
