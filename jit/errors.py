"""Exceptions raised by `deep_ep.jit`.

They derive from `RuntimeError` and carry the tool's own words: the nvcc command line and its
stderr, the CUDA driver's error name and string, or the two NCCL versions that disagree.
"""

from __future__ import annotations

from collections.abc import Sequence


class JITError(RuntimeError):
    """Base class of every error `deep_ep.jit` raises on purpose."""


class JITCompileError(JITError):
    """nvcc (or the host compiler) failed, or a compiled kernel broke a build-time rule.

    Attributes:
        command: the full compiler command line, as a list of arguments.
        stderr: everything the compiler wrote to stderr.
        returncode: the compiler's exit status (`None` when it did not run or the rule was ours).
    """

    def __init__(self, message: str, *, command: Sequence[str] = (), stderr: str = "", returncode: int | None = None):
        super().__init__(message)
        self.command = list(command)
        self.stderr = stderr
        self.returncode = returncode


class PtxasCheckError(JITCompileError):
    """`EP_JIT_PTXAS_CHECK` is set and a kernel uses a stack frame, local memory or spills registers."""


class CUDADriverError(JITError):
    """A CUDA driver call returned an error.

    Attributes:
        call: the driver function that failed, e.g. `cuLaunchKernelEx`.
        name: the driver's error name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        description: the driver's error string.
        code: the numeric `CUresult`.
    """

    def __init__(self, call: str, code: int, name: str, description: str, context: str = ""):
        where = f" ({context})" if context else ""
        super().__init__(f"{call} failed{where}: {name} ({code}): {description}")
        self.call = call
        self.code = code
        self.name = name
        self.description = description


class NCCLHeadersError(JITError):
    """No usable NCCL headers were found (we never fall back to a system NCCL)."""


class NCCLVersionMismatchError(JITError):
    """The NCCL headers we compile against and the loaded libnccl are different releases."""
