"""`deep_ep.reference`: the reference backend, the oracle every other backend is checked against.

Dispatch and combine with torch ops and torch.distributed collectives on any process group, in the
documented order (`docs/semantics.md`), so results can be compared bitwise. The code lives in
`deep_ep.backends.reference` (`backend.py`: the backend; `layout.py`: where tokens go); this module
names its public parts, with the worst-case row counts of the contract (`deep_ep.backends.base`).
"""

from __future__ import annotations

from deep_ep.backends.base import worst_case_num_expanded_tokens, worst_case_num_recv_tokens
from deep_ep.backends.reference.backend import ReferenceBackend, ReferenceState
from deep_ep.backends.reference.layout import (
    RecvLayout,
    SendLayout,
    compute_recv_layout,
    compute_send_layout,
    send_offset,
)

__all__ = [
    "RecvLayout",
    "ReferenceBackend",
    "ReferenceState",
    "SendLayout",
    "compute_recv_layout",
    "compute_send_layout",
    "send_offset",
    "worst_case_num_expanded_tokens",
    "worst_case_num_recv_tokens",
]
