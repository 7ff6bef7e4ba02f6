"""Exceptions the library raises on top of Python's own `ValueError`/`TypeError`."""

from __future__ import annotations


class EPError(RuntimeError):
    """Base class of deep_ep's runtime errors (NCCL, CUDA driver, device faults)."""


class EPTimeoutError(EPError):
    """A device-side or host-side wait passed its deadline.

    The message names the phase, this rank, the peer it waited for and the counter values. The
    buffer that raised it is unusable afterwards: destroy it and create a new one.
    """


class EPPeerError(EPError):
    """Another rank of the buffer rejected its input or raised inside an operation, and told every
    peer instead of leaving them waiting. The message names that rank and carries its error's text.
    On the kernels backend the buffer is unusable afterwards on every rank (destroy it and create a
    new one on the same group); on the reference backend nothing was exchanged and it stays usable."""


class NCCLError(EPError):
    """An NCCL host call failed; the message carries NCCL's own error string."""


class EPOperationMismatchError(EPError):
    """The ranks of a buffer ran different operations at the same step (a dispatch against a combine,
    or different sizes): every rank's kernels check their peers' signatures and stop. The buffer
    that raised it is unusable afterwards: destroy it and create a new one."""
