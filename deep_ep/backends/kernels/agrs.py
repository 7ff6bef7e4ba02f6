"""AGRS sessions inside one NVLink domain on the kernels backend (agrs.cuh, docs/semantics.md).

A session's calls take consecutive blocks of the window's data region (the session's bytes, as
`deep_ep.agrs` counts them). A call copies this rank's data with the copy engines straight into
every peer's window, at the place that peer's block keeps for this rank: all of it for an
all-gather, row `p` to rank `p` for a reduce-scatter. Then one small kernel on the same stream
tells each peer that the copies are complete (a flag per source in the workspace, set to the
call's signature and number) and waits, with the device deadline, for every peer's flag: an
all-gather's output is then the block itself, a view of the window; a reduce-scatter's kernel then
sums the rows it received. So an all-gather uses no SM to move data, and a reduce-scatter only for
its sum. The host agrees on nothing per call: a peer whose call had other shapes or dtypes (another
signature) fails the buffer on the device (`EPOperationMismatchError`).

A session begins and ends with a barrier on the stream, across the ranks: before it no peer
writes into a window whose dispatch or combine may still be read, after it no dispatch writes into
a block a peer still reads. Gathered views are valid until the session ends (as DeepEP V2's). A
call returns once its work is queued; its `wait()` polls until the data is there (with the host
deadline, raising what the device recorded), and the session's end waits for its barrier.
"""

from __future__ import annotations

import torch

from deep_ep.jit import Opaque
from deep_ep.records import WORKSPACE_BYTES

from . import specs
from .runtime import NvlinkRuntime, data_ptr

# CTAs of a reduce-scatter's sum: enough to read the rows at a good fraction of HBM's rate
MAX_REDUCE_CTAS = 16
ELEMENT_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def reduce_ctas(num_elements: int) -> int:
    """CTAs of a reduce-scatter's sum of rows of `num_elements`: a thread per element (or per 16-byte
    vector of them), at most `MAX_REDUCE_CTAS`."""
    return max(1, min(MAX_REDUCE_CTAS, -(-num_elements // specs.AGRS_THREADS)))


class NvlinkAgrs:
    """The AGRS calls of one buffer whose peers are all reached by stores (no scale-out region)."""

    def __init__(self, runtime: NvlinkRuntime) -> None:
        self.runtime = runtime
        self._sequence = 0  # the calls so far: every rank counts the same (the flags' signatures check it)

    @property
    def num_region_bytes(self) -> int:
        """What a session may hold: the window's data region, less what PP and Engram keep at its end."""
        return self.runtime.tail.free_end - WORKSPACE_BYTES

    def begin_session(self, stream: torch.cuda.Stream) -> None:
        """Queue the barrier that opens a session on `stream` (collective). Loads the calls' kernels
        first, where every rank is and none has queued a wait for a peer (virtual ranks load together)."""
        self.runtime.share.load([specs.agrs_spec(element) for element in specs.AGRS_ELEMENTS])
        self.runtime.barrier(stream)

    def reject(self, op: str, error: BaseException) -> None:
        """This rank rejected the arguments of a call its peers may be making: stop the buffer on every
        rank now (their waits raise `EPPeerError` with `error`'s text) instead of at their deadline."""
        self.runtime.post_fault(op, error)

    def end_session(self, stream: torch.cuda.Stream) -> None:
        """Close a session on `stream` (collective): its barrier, waited for on the host."""
        self.runtime.barrier(stream)
        self.wait(stream, "destroy_agrs_session's barrier")

    def wait(self, stream: torch.cuda.Stream, what: str) -> None:
        """Wait on the host, by polling and with the host deadline, until the work queued on `stream`
        has run; raise what a device wait recorded (`EPTimeoutError` naming the peer). A poll never
        blocks inside the driver, so a virtual rank waiting here never holds back a peer's launch."""
        self.runtime.wait(stream, what)

    def all_gather(self, x: torch.Tensor, offset: int, stream: torch.cuda.Stream, signature: int) -> torch.Tensor:
        """Gather every rank's `x` into the session's block at `offset`; returns the block as
        `[num_ranks, *x.shape]` of `x.dtype`, a view of this rank's window. `signature`: the call's
        (32 bits), which every peer's must equal."""
        runtime = self.runtime
        num_bytes = x.numel() * x.element_size()
        block = self._block(offset, runtime.num_ranks * num_bytes, "all_gather")
        # Every rank's block gets our tensor at our place in it (ours included)
        runtime.copy_async(stream, [(base + block + runtime.rank * num_bytes, data_ptr(x), num_bytes)
                                    for base in runtime.windows.peer_ptrs])  # fmt: skip
        self._launch(stream, None, 1, 0, 0, 0, signature)
        gathered = runtime.windows.bytes[block : block + runtime.num_ranks * num_bytes]
        return gathered.view(x.dtype).view(runtime.num_ranks, *x.shape)

    def reduce_scatter(self, x: torch.Tensor, offset: int, stream: torch.cuda.Stream, signature: int) -> torch.Tensor:
        """Send row `p` of `x` (`[num_ranks, *S]`) to rank `p` into the session's block at `offset`
        and sum the rows the ranks sent us; returns `[*S]` of `x.dtype` (a new tensor). `signature`:
        as `all_gather`'s."""
        runtime = self.runtime
        num_elements = x[0].numel()
        row_bytes = num_elements * x.element_size()
        block = self._block(offset, runtime.num_ranks * row_bytes, "reduce_scatter")
        # Rank p's block gets our row p at our place in it (ours included)
        runtime.copy_async(stream, [(base + block + runtime.rank * row_bytes, data_ptr(x) + peer * row_bytes, row_bytes)
                                    for peer, base in enumerate(runtime.windows.peer_ptrs)])  # fmt: skip
        out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
        num_ctas = reduce_ctas(num_elements)
        self._launch(stream, ELEMENT_NAMES[x.dtype], num_ctas, data_ptr(runtime.windows.bytes) + block,
                     data_ptr(out), num_elements, signature)  # fmt: skip
        return out

    # ---------------------------------------------------------------- the steps of a call

    def _block(self, offset: int, num_bytes: int, op: str) -> int:
        """The window offset of a call's block, or `ValueError` when the data region cannot hold it."""
        if offset + num_bytes > self.num_region_bytes:
            raise ValueError(
                f"{op}: the session's data would end at {offset + num_bytes} bytes and the buffer's window holds "
                f"{self.num_region_bytes} for sessions (its num_bytes less the {WORKSPACE_BYTES}-byte workspace); "
                "size the buffer with get_agrs_buffer_size_hint"
            )
        return WORKSPACE_BYTES + offset

    def _launch(self, stream: torch.cuda.Stream, element: str | None, num_ctas: int, rows: int, out: int,
                num_elements: int, signature: int) -> None:  # fmt: skip
        runtime = self.runtime
        runtime.check_error()
        (kernel,) = runtime.share.load([specs.agrs_spec(element)])
        # The flags are int32 words compared as differences (arrivals.cuh), so the number may wrap
        self._sequence = (self._sequence + 1 + 2**31) % 2**32 - 2**31
        args = specs.AgrsArgs(window=runtime.windows.ptr, error_block=data_ptr(runtime.error_block),
                              timeout_ns=runtime.timeout_ns, rows=rows, out=out, num_elements=num_elements,
                              sequence=self._sequence, rank=runtime.rank, num_ranks=runtime.num_ranks,
                              signature=signature)  # fmt: skip
        kernel.launch(grid=(num_ctas,), block=(specs.AGRS_THREADS,), stream=stream, args=(Opaque(bytes(args)),))
