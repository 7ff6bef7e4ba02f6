"""The steady path of dispatch and combine on the kernels backend: a call of a shape seen before
costs one call into C++ (`steady.cpp`), not a few dozen torch and driver calls from Python.

An eager caller (Megatron's dispatcher, prefill in vLLM and SGLang) repeats a handful of shapes
thousands of times, and on a GPU machine's CPU every torch call from Python costs 5-10 us
(bench/NOTES.md, sessions 13-14). So:

- The first call of a shape (its `key`: the arguments that are not tensors, the handle's shape and
  `x`'s shape and dtype) takes the Python path, which validates everything, with a `Recorder` on the
  runtime: it sees each allocation (`NvlinkRuntime.empty`), each launch with its parameter bytes
  (`NvlinkRuntime.launch`) and each tensor whose address went into a parameter (`data_ptr`).
- From that, `describe_program` describes a `Program`: the inputs' dtypes, sizes and strides, the
  allocations, the returned views, and each launch with the offsets where the addresses of the
  inputs and allocations go. It declines (the shape stays on the Python path) when an address is
  ambiguous (two inputs at one address, an empty tensor) or comes from a tensor that is neither an
  input, an allocation of the call nor one of the runtime's own (a copy made inside the call).
- Every call goes first to the buffer's `Front` (`steady_front.cpp`, `steady_calls.cpp`), which
  makes its key (or finds the last call like it), finds the key's entry and gathers the inputs, all
  in C++ (in Python they cost the host 10-14 us per call on the GPU machine). A call whose key has
  a program goes to `Program.run`, which compares every input tensor with the recording (dtype,
  sizes, strides, device) and returns `None` on any difference: the call then takes the Python
  path, whose checks raise the error a bad input deserves. Otherwise it makes V2's stream
  choreography, allocates and launches; the handle and results are copies of the recorded ones
  with the new tensors in place.
- A CPU-sync dispatch is two programs (`Part`): up to the host's wait for the counts, and after it,
  where the output rows, the received tokens and the epilogue's grid are the call's values (sizes
  and parameter fields that follow them). A cached dispatch or a combine with a CPU-sync handle takes
  the handle's row counts the same way, so one program serves every step of a training loop.

What stays on the Python path: CPU-sync dispatches with column-major scales (their column stride
follows the counts), cached dispatches that update `cumulative_local_expert_recv_stats`, calls with
`previous_event_before_epilogue`, calls inside a CUDA graph capture, buffers with rank masking, hybrid
mode or peers outside the scale-up domain, outputs with guard bytes (`LoopbackWorld(guard_bytes=)`)
and `EP_CHECK_VALUES=1`. `EP_STEADY=0` turns the steady path off for new buffers.
`EP_AVOID_RECORD_STREAM` is read when a shape is recorded.

Memory: the steady path allocates what the Python path does, from torch's CUDA caching allocator as
V2 does (the compute stream's pool unless `allocate_on_comm_stream`, `record_stream` only in
asynchronous calls; no pool of its own: a freed output's block is the allocator's to reuse, and
10,000 calls of each operation leave the allocated bytes unchanged); the small tensors of a call
(`recv_topk_idx`, `recv_topk_weights` and the tensors a handle keeps: slots, counts, metadata, its
copy of `topk_idx`) share one allocation, freed when the last of them dies; `recv_x` and its scales
have their own. A program keeps alive only the runtime's own scratch tensors it points at.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from deep_ep.event import EventHandle, EventOverlap, avoid_record_stream
from deep_ep.handle import EPHandle
from deep_ep.jit import JITCompileError, param_bytes

from . import specs
from .dispatch import raise_rejected_routing
from .runtime import INPUT_ERROR_WORD, NvlinkRuntime, track_pointers

SOURCES = tuple(Path(__file__).with_name(name) for name in ("steady.cpp", "steady_graph.cpp", "steady_front.cpp",
                                                                 "steady_calls.cpp", "steady_floor.cpp"))  # fmt: skip
# Programs per buffer; past it the oldest go (a job cycling through more shapes pays the Python path)
MAX_PROGRAMS = 64
ENV_SWITCH = "EP_STEADY"
# Replays launch each program's kernels as one CUDA graph (steady_graph.cpp) unless this is "0"
GRAPH_SWITCH = "EP_STEADY_GRAPHS"
# The phases of a replay whose host nanoseconds a program sums (`Program.phase_ns`, steady.cpp)
PHASES = ("checks", "stream wait", "allocations", "launches", "end event and record_stream", "outputs to Python")
# The phases of a replayed call in the front (`Front.phase_ns`, steady_front.cpp); "programs" holds `PHASES`
FRONT_PHASES = ("key", "inputs", "programs", "count wait", "results")

# The tensors a fresh dispatch returns, in the order `dispatch_sources` lists them: the results, the
# new handle's, and its backend state's
RESULT_FIELDS = ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights")
HANDLE_FIELDS = (
    "topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
    "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx", "num_masked_lanes",
)  # fmt: skip
STATE_FIELDS = ("slot_idx", "num_tokens_per_rank", "node_slot_idx", "num_tokens_per_node", "forward_map",
                "forward_counts")  # fmt: skip
# A handle's fields that decide the shapes of a cached dispatch or combine with it, read in one call
# (the front's keys); a CPU-sync handle's row counts are not among them: they are the call's values
_SHAPE_FIELDS = ("num_tokens", "do_expand", "num_experts", "num_max_tokens_per_rank", "expert_alignment", "num_sms",
                 "hidden", "num_topk", "do_cpu_sync", "scale_kind")  # fmt: skip
_synced_shape = operator.attrgetter(*_SHAPE_FIELDS)
_exact_shape = operator.attrgetter(*_SHAPE_FIELDS, "num_recv_tokens", "num_expanded_tokens")


@functools.cache
def steady_module() -> tuple[ModuleType | None, str | None]:
    """The compiled `SOURCES` (one unit, built once per torch and Python, then cached), or `None` and
    why."""
    from deep_ep.jit import load_torch_extension

    try:
        return load_torch_extension("deep_ep_steady", "\n".join(path.read_text() for path in SOURCES)), None
    except (JITCompileError, ImportError, OSError) as error:
        return None, f"{type(error).__name__}: {error}"


def steady_enabled() -> bool:
    """Whether new buffers take the steady path (`EP_STEADY`, default on)."""
    return os.environ.get(ENV_SWITCH, "1") not in ("", "0")


def graphs_enabled() -> bool:
    """Whether new buffers' replays launch their kernels as one graph (`EP_STEADY_GRAPHS`, default on)."""
    return os.environ.get(GRAPH_SWITCH, "1") not in ("", "0")


class Recorder:
    """What one call of the Python path allocated and launched (set as `NvlinkRuntime.recorder`).

    Attributes:
        allocs: the call's allocations, in order; `rows`: per allocation, what its first dimension
            counts when the host learns it during the call (`'out'`: the output rows, `'meta'`: the
            received tokens), else `None`.
        launches: per launch its function, grid, block, attributes, parameter bytes and stream.
        pointers: the tensors whose addresses went into parameters.
        split: `(allocations, launches)` before the host's wait for a CPU-sync dispatch's counts.
        drain: with CPU sync, what the call does when its routing was rejected on the device.
    """

    def __init__(self) -> None:
        self.allocs: list[torch.Tensor] = []
        self.rows: list[str | None] = []
        self.launches: list[tuple] = []
        self.pointers: list[torch.Tensor] = []
        self.problem: str | None = None
        self.split: tuple[int, int] | None = None
        self.drain: Callable[[], None] | None = None

    def allocated(self, tensor: torch.Tensor, rows: str | None = None) -> None:
        self.allocs.append(tensor)
        self.rows.append(rows)

    def waiting_for_counts(self) -> None:
        if self.split is not None:
            self.problem = "two waits for counts in one call"
        self.split = (len(self.allocs), len(self.launches))

    def launched(self, kernel: Any, launch: dict[str, Any]) -> None:
        if launch.get("shared_mem", 0) or launch.get("cluster") is not None:
            self.problem = "a launch with dynamic shared memory or clusters"
        dims = [tuple(d) if isinstance(d, (tuple, list)) else (d,) for d in (launch["grid"], launch["block"])]
        grid, block = ((*d, *(1,) * (3 - len(d))) for d in dims)
        self.launches.append((kernel.handle, grid, block, bool(launch.get("cooperative", False)),
                              bool(launch.get("pdl", False)), tuple(param_bytes(launch["args"])),
                              launch.get("stream")))  # fmt: skip


def _runtime_tensors(runtime: NvlinkRuntime) -> list[torch.Tensor]:
    """The tensors the runtime owns (error block, scratch, count blocks): constant addresses."""
    return [value for value in vars(runtime).values() if isinstance(value, torch.Tensor)]


@dataclass(frozen=True)
class Part:
    """The part of a recording a program repeats (all of it by default), and what in it follows the
    values a call passes (`Program.run`'s `values`): a CPU-sync dispatch is two programs, before and
    after the host reads the counts.

    Attributes:
        allocs, launches: the slices of the recording's allocations and launches.
        begins, ends: whether the part starts the call (the stream wait) and ends it (the event).
        values: the names of the call's values, in order.
        rows: the recording's row names (`Recorder.rows`) that are values: a value's index per name.
        inputs: per input (index), the value name of its first dimension (a handle's rows).
        fields: per launch (index in the recording), `(param, offset, width, value name)` of the
            parameter fields that take a value.
        grids: per launch (index in the recording), the value name of its grid's x dimension.
    """

    allocs: slice = field(default_factory=lambda: slice(None))
    launches: slice = field(default_factory=lambda: slice(None))
    begins: bool = True
    ends: bool = True
    values: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    inputs: dict[int, str] = field(default_factory=dict)
    fields: dict[int, tuple[tuple[int, int, int, str], ...]] = field(default_factory=dict)
    grids: dict[int, str] = field(default_factory=dict)


def describe_program(
    runtime_tensors: Sequence[torch.Tensor], comm_stream: Any, recorder: Recorder,
    inputs: Sequence[torch.Tensor | None], results: Sequence[torch.Tensor | None],
    async_with_compute_stream: bool, allocate_on_comm_stream: bool, part: Part | None = None,
    grouped: Sequence[int] = (), group_unreturned: bool = False,
) -> tuple[tuple, list[torch.Tensor]] | str:  # fmt: skip
    """The description of a `Program` (steady.cpp's `parse_program`) that repeats the recorded call
    for other tensors of the same shapes.

    Arguments:
        runtime_tensors: the tensors the runtime owns (their addresses stay in the program).
        comm_stream: the communication stream (`torch.cuda.Stream`) every launch must be on.
        inputs: the call's tensors (or `None`) in the order `Program.run` will get them.
        results: the tensors the call returns (or `None`), each an input or a view of an allocation.
        part: which part of the recording, and what in it follows the call's values.
        grouped: the results (indices) whose allocations share one (a handle's tensors: they live and
            die together, and one allocation costs the host less than several);
            `group_unreturned`: also the allocations no result returns.

    Returns:
        `(description, keep)`: the description ends with where each result comes from (`k >= 0`: the
        program's output `k`, `-1 - i`: input `i`, `None`: none), so that `Program.run` returns the
        results in order; `keep`, the runtime tensors the program points at. Or the reason it cannot
        be made.
    """
    if recorder.problem is not None:
        return recorder.problem
    part = part or Part()
    value_of = {name: index for index, name in enumerate(part.values)}
    recorded_allocs = recorder.allocs[part.allocs]
    alloc_rows = recorder.rows[part.allocs]
    first_launch = range(len(recorder.launches))[part.launches].start if recorder.launches else 0
    sources: dict[int, int] = {}  # address -> input i (>= 0) or allocation j (-1 - j)
    for index, tensor in enumerate(inputs):
        if tensor is not None:
            sources.setdefault(tensor.data_ptr(), index)
            if tensor.data_ptr() == 0 or sources[tensor.data_ptr()] != index:
                return "an empty input, or two inputs at one address"
    for index, tensor in enumerate(recorded_allocs):
        if tensor.data_ptr() == 0 or tensor.data_ptr() in sources:
            return "an empty allocation"
        sources[tensor.data_ptr()] = -1 - index
    # Every allocation of the recording (a part's launches point only at its own and its inputs)
    made = {t.data_ptr() for t in recorder.allocs}
    keep = []
    for tensor in recorder.pointers:
        if tensor.data_ptr() in sources or tensor.data_ptr() in made:
            continue
        if not any(tensor is t for t in runtime_tensors):
            return "a kernel argument points at a tensor made inside the call"
        keep.append(tensor)
    launches = []
    for number, (handle, grid, block, cooperative, pdl, params, stream) in enumerate(recorder.launches[part.launches]):
        if stream is None or stream.cuda_stream != comm_stream.cuda_stream:
            return "a launch off the communication stream"
        patches = []
        for param_idx, raw in enumerate(params):
            for offset in range(0, len(raw) - 7, 8):
                source = sources.get(int.from_bytes(raw[offset : offset + 8], "little"))
                if source is not None:
                    patches.append((param_idx, offset, source))
        fields = tuple((p, offset, width, value_of[name]) for p, offset, width, name in
                       part.fields.get(first_launch + number, ()))  # fmt: skip
        grid_value = part.grids.get(first_launch + number)
        if grid_value is not None:
            grid = (-1 - value_of[grid_value], *grid[1:])
        launches.append((handle, grid, block, cooperative, pdl, params, tuple(patches), fields))
    allocs = []
    for tensor, rows in zip(recorded_allocs, alloc_rows, strict=True):
        shape = tuple(tensor.shape)
        if rows in part.rows:  # its first dimension is the call's value (its strides do not depend on it)
            shape = (-1 - value_of[rows], *shape[1:])
        allocs.append((tensor.dtype, shape, tuple(tensor.stride())))
    outputs, result_sources, output_of = [], [], {}
    storages = {t.untyped_storage().data_ptr(): j for j, t in enumerate(recorded_allocs)}
    for index, tensor in enumerate(results):
        if tensor is None:
            result_sources.append(None)
            continue
        given = next((i for i, t in enumerate(inputs) if t is tensor), None)
        if given is not None:
            result_sources.append(-1 - given)
            continue
        alloc = storages.get(tensor.untyped_storage().data_ptr())
        if alloc is None:
            return "a result that is neither an input nor an allocation of the call"
        shape = tuple(tensor.shape)
        if any(dim < 0 for dim in allocs[alloc][1]):  # rows that are the call's value: only returned whole
            whole = recorded_allocs[alloc]
            if shape != tuple(whole.shape) or tensor.stride() != whole.stride() or tensor.storage_offset() != 0:
                return "a view of an allocation whose size is the call's"
            shape = allocs[alloc][1]
        outputs.append((alloc, shape, tuple(tensor.stride()), tensor.storage_offset()))
        result_sources.append(len(outputs) - 1)
        output_of.setdefault(alloc, set()).add(index)
    groups = [(group_unreturned if j not in output_of else output_of[j] <= set(grouped)) for j in range(len(allocs))]
    allocs = [(*spec, group) for spec, group in zip(allocs, groups, strict=True)]
    input_specs = tuple(
        None if t is None else
        (t.dtype, ((-1 - value_of[part.inputs[i]], *t.shape[1:]) if i in part.inputs else tuple(t.shape)),
         tuple(t.stride()))
        for i, t in enumerate(inputs)
    )  # fmt: skip
    description = (
        comm_stream.device_index,
        (comm_stream.stream_id, comm_stream.device_index, comm_stream.device_type, comm_stream.cuda_stream),
        async_with_compute_stream, allocate_on_comm_stream, not avoid_record_stream(), input_specs, tuple(allocs),
        tuple(outputs), tuple(launches), part.begins, part.ends, len(part.values), tuple(result_sources),
    )  # fmt: skip
    return description, keep


class Entry:
    """A recorded shape: its program (which returns the call's results in order) and the templates
    of the objects a call returns. A CPU-sync dispatch has two programs: `first` (up to the host's wait
    for the counts) and `program` (the rest), and what its replay does with rejected routing
    (`drain`), and what its epilogue's grid is made of (`NvlinkRuntime.epilogue_terms`)."""

    __slots__ = ("drain", "epilogue_terms", "first", "handle", "keep", "program", "state")

    def __init__(self, program: Any, keep: list[torch.Tensor], handle: EPHandle | None = None,
                 state: Any = None) -> None:  # fmt: skip
        self.program, self.keep = program, keep
        self.handle, self.state = handle, state
        self.first: Any = None
        self.drain: Callable[[], None] | None = None
        self.epilogue_terms = (1, 1, 0)


class SteadyPath:
    """The recorded shapes of one buffer and the calls that replay them (`ElasticBuffer.dispatch`
    and `.combine` ask it first). One thread at a time, like the buffer."""

    def __init__(self, module: ModuleType, runtime: NvlinkRuntime, comm_stream: torch.cuda.Stream,
                 buffer_id: int, own_gpu: bool = True) -> None:  # fmt: skip
        """`own_gpu`: no other rank's kernels run on this GPU (else no graphs: `graphs_refused`)."""
        self.module = module
        self.runtime = runtime
        self.comm_stream = comm_stream
        self.buffer_id = buffer_id
        self.entries: dict[tuple, Entry | None] = {}  # None: the shape cannot take the steady path
        # Building a graph may wait for the kernels on the device: with virtual ranks those can be
        # peers waiting for this rank's next launch (seen at EP4 and EP8 as timeouts), so ranks that
        # share a GPU launch kernel by kernel
        self.graphs_refused = None if own_gpu else "the GPU runs other ranks' kernels (virtual ranks)"
        self.use_graphs = graphs_enabled() and own_gpu
        self.declined: dict[tuple, str] = {}  # why, per such shape
        # The calls' way in (steady_front.cpp): keys, inputs and replays in C++, which reads the host
        # memory the device writes (error words, a CPU-sync dispatch's counts and their ready word)
        self.front = module.Front(
            steady=self, entries=self.entries, runtime=runtime, comm_stream=comm_stream,
            error_words=ctypes.addressof(runtime.error_words), counts=runtime.host_counts.data_ptr(),
            counts_ready=runtime.counts_ready.data_ptr(), num_count_words=runtime.host_counts.numel(),
            input_error_word=INPUT_ERROR_WORD, num_ranks=runtime.num_ranks, buffer_id=buffer_id, handle_type=EPHandle,
            event_handle_type=EventHandle, synced_shape=_synced_shape, exact_shape=_exact_shape,
            handle_fields=HANDLE_FIELDS, state_fields=STATE_FIELDS, event_template=EventHandle.of(None),
            overlap_template=EventOverlap(None),
        )  # fmt: skip

    @property
    def num_calls(self) -> int:
        """Calls a program served."""
        return self.front.num_calls

    @property
    def num_refused(self) -> int:
        """Calls a program refused (an input unlike its recording): the Python path took them."""
        return self.front.num_refused

    def phase_ns(self) -> dict[str, int]:
        """Host nanoseconds per phase (`PHASES`) summed over this buffer's replays so far (both
        programs of a CPU-sync dispatch), then the front's per `FRONT_PHASES` as `'front: <name>'`."""
        totals = [0] * len(PHASES)
        for program in self.programs():
            totals = [a + b for a, b in zip(totals, program.phase_ns, strict=True)]
        front = {f"front: {name}": ns for name, ns in zip(FRONT_PHASES, self.front.phase_ns, strict=True)}
        return dict(zip(PHASES, totals, strict=True)) | front

    def programs(self) -> list[Any]:
        """Every program of this buffer's recorded shapes (a CPU-sync dispatch has two)."""
        found = []
        for entry in self.entries.values():
            found += [] if entry is None else [p for p in (entry.first, entry.program) if p is not None]
        return found

    def set_graphs(self, on: bool) -> None:
        """Launch each program's kernels as one graph (`on`) or one by one, from the next call on,
        for the programs recorded so far and later ones. Builds the graphs not built yet: call it
        between collective calls. A buffer whose GPU runs other ranks' kernels stays kernel by kernel
        (`graphs_refused`)."""
        on = on and self.graphs_refused is None
        self.use_graphs = on
        for program in self.programs():
            program.use_graph = on
            if on:
                program.build_graph()

    def graph_stats(self) -> dict[str, Any]:
        """Graph launches and node parameter updates summed over this buffer's programs, and why
        programs launch kernel by kernel (`{reason: number of programs}`)."""
        launches = updates = 0
        problems: dict[str, int] = {}
        for program in self.programs():
            launched, updated = program.graph_counts
            launches, updates = launches + launched, updates + updated
            if program.graph_problem is not None:
                problems[program.graph_problem] = problems.get(program.graph_problem, 0) + 1
        return dict(launches=launches, updates=updates, problems=problems)

    def _program(self, description: tuple) -> Any:
        """A new program, its graph built now (right after the call it records launched its kernels,
        never inside a replay: `Program.build_graph`)."""
        program = self.module.Program(description)
        program.use_graph = self.use_graphs
        if self.use_graphs:
            program.build_graph()
        return program

    # ----------------------------------------------------------------------------- recording

    def start(self, key: tuple | None) -> Recorder | None:
        """Record the Python path's call of `key`: a shape without a program yet, or one whose program
        refused this call's inputs (a new layout may be there to stay). Not inside a graph capture,
        which takes the Python path every time."""
        if key is None or (key in self.entries and self.entries[key] is None):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None
        recorder = self.runtime.recorder = Recorder()
        track_pointers(recorder.pointers)
        return recorder

    def stop(self) -> None:
        self.runtime.recorder = None
        track_pointers(None)

    def record_dispatch(self, key: tuple, *args: Any) -> None:
        """Make the program of a dispatch the Python path just ran (`_record_dispatch`). The call itself
        succeeded: a recording that fails leaves the shape on the Python path (`declined` says why)."""
        try:
            self._record_dispatch(key, *args)
        except Exception as error:  # the user's call is done: only its replays are lost
            self._remember(key, f"recording failed: {type(error).__name__}: {error}")

    def record_combine(self, key: tuple, *args: Any) -> None:
        """Make the program of a combine the Python path just ran (`_record_combine`), as `record_dispatch`."""
        try:
            self._record_combine(key, *args)
        except Exception as error:  # the user's call is done: only its replays are lost
            self._remember(key, f"recording failed: {type(error).__name__}: {error}")

    def _remember(self, key: tuple, built: Any, handle: EPHandle | None = None, state: Any = None) -> None:
        """The only change of `entries` (the front's memos of the last calls' entries go with it)."""
        if isinstance(built, str) and self.entries.get(key) is not None:
            return  # a call unlike the recorded one (its inputs' layout): the recording stays
        self.front.entries_changed()
        if len(self.entries) >= MAX_PROGRAMS:
            del self.entries[next(iter(self.entries))]
        if isinstance(built, str):
            self.entries[key] = None
            self.declined[key] = built
            return
        description, keep = built
        self.entries[key] = Entry(self._program(description), keep, handle, state)

    def _record_dispatch(self, key: tuple, recorder: Recorder, inputs: tuple, result: Any, handle: EPHandle,
                        fresh: bool, request: Any, async_with_compute_stream: bool,
                        allocate_on_comm_stream: bool) -> None:  # fmt: skip
        """Make the program of a dispatch the Python path just ran (`inputs`: `dispatch_inputs`)."""
        synced = fresh and request.do_cpu_sync
        results = [getattr(result, name) for name in RESULT_FIELDS]
        if fresh:  # the handle's copy of `topk_idx` is an allocation of the call (the dispatch kernel's)
            results += [getattr(handle, name) for name in HANDLE_FIELDS]
            results += [getattr(handle.backend_state, name) for name in STATE_FIELDS]
        flags = (bool(async_with_compute_stream), bool(allocate_on_comm_stream))
        own = _runtime_tensors(self.runtime)
        first = None
        if synced:
            first, inputs, part = self._synced_parts(recorder, inputs, flags)
        elif not fresh and handle.do_cpu_sync:  # a cached dispatch whose rows are the handle's
            part = Part(values=("out", "meta", "grid"), rows=("out",), inputs={8: "meta"},
                        fields={1: _epilogue_row_fields()}, grids={1: "grid"})  # fmt: skip
            if len(recorder.launches) != 2:
                part = "not two launches in a cached dispatch"
        else:
            part = Part()
        # One allocation for the small tensors: the scales, the received routing and weights, the handle's
        # (and what no result returns); each allocation costs the host 1-2 us. `recv_x` has its own: a
        # caller frees it long before the handle, and the scales it frees with it are ~3% of its bytes
        grouped = (*(RESULT_FIELDS.index(name) for name in ("recv_scales", "recv_topk_idx", "recv_topk_weights")),
                   *range(len(RESULT_FIELDS), len(results)))  # fmt: skip
        built = part if isinstance(part, str) else describe_program(own, self.comm_stream, recorder, inputs, results,
                                                                    *flags, part, grouped, True)  # fmt: skip
        templates: tuple[Any, Any] = (None, None)
        if fresh:  # without tensors: a template must not keep the recorded call's outputs alive
            copy_with = self.module.copy_with
            state = copy_with(handle.backend_state, STATE_FIELDS, (None,) * len(STATE_FIELDS), 0)
            names = (*HANDLE_FIELDS, "backend_state")
            templates = (copy_with(handle, names, (None,) * len(names), 0), state)
            self.front.handle_summary(templates[0])  # kept in the template, so in every handle made from it
        self._remember(key, built, *templates)
        entry = self.entries.get(key)
        if entry is not None and recorder.launches:
            entry.epilogue_terms = self.runtime.epilogue_terms(recorder.launches[0][1][0] - self.runtime.nic_ctas)
        if synced and entry is not None and entry.first is None:
            entry.first, entry.drain = self._program(first[0]), recorder.drain

    def _synced_parts(self, recorder: Recorder, inputs: tuple, flags: tuple[bool, bool]) -> tuple[Any, tuple, Any]:
        """A CPU-sync dispatch's first program (up to the wait for the counts), the second's inputs
        (the call's and the first's allocations) and its `Part`; or a reason instead of the `Part`."""
        if recorder.split is None or recorder.drain is None:
            return None, inputs, "no wait for counts in the call"
        num_allocs, num_launches = recorder.split
        if len(recorder.launches) != num_launches + 1:
            return None, inputs, "not one launch after the wait for counts"
        sequence_field = (0, specs.DispatchArgs.counts_sequence.offset, specs.DispatchArgs.counts_sequence.size,
                          "sequence")  # fmt: skip
        part = Part(allocs=slice(0, num_allocs), launches=slice(0, num_launches), ends=False, values=("sequence",),
                    fields={0: (sequence_field,)})  # fmt: skip
        carried = recorder.allocs[:num_allocs]
        first = describe_program(_runtime_tensors(self.runtime), self.comm_stream, recorder, inputs, carried,
                                 *flags, part, range(len(carried)))  # fmt: skip
        if isinstance(first, str):
            return None, inputs, first
        second = Part(allocs=slice(num_allocs, None), launches=slice(num_launches, None), begins=False,
                      values=("out", "meta", "grid"), rows=("out", "meta"), fields={num_launches: _epilogue_row_fields()},
                      grids={num_launches: "grid"})  # fmt: skip
        return first, (*inputs, *carried), second

    def _record_combine(self, key: tuple, recorder: Recorder, inputs: tuple, result: Any, request: Any,
                       async_with_compute_stream: bool, allocate_on_comm_stream: bool) -> None:  # fmt: skip
        """Make the program of a combine the Python path just ran (`inputs`: `combine_inputs`)."""
        part = Part()
        if request.handle.do_cpu_sync:  # the rows of `x`, its weights and the handle's metadata are values
            rows = {0: "rows", 5: "meta"} | ({1: "rows"} if inputs[1] is not None else {})
            combine, epilogue = specs.CombineArgs, specs.CombineEpilogueArgs
            part = Part(values=("rows", "meta"), inputs=rows, fields={
                0: ((0, combine.num_x_rows.offset, combine.num_x_rows.size, "rows"),
                    (0, combine.num_meta_rows.offset, combine.num_meta_rows.size, "meta")),
                1: ((0, epilogue.num_local_rows.offset, epilogue.num_local_rows.size, "rows"),)})  # fmt: skip
        built = describe_program(_runtime_tensors(self.runtime), self.comm_stream, recorder, inputs,
                                 [result.combined_x, result.combined_topk_weights],
                                 bool(async_with_compute_stream), bool(allocate_on_comm_stream), part)  # fmt: skip
        self._remember(key, built)

    # ------------------------------------------------------------------------------- replays

    def rejected(self, entry: Entry, inputs: tuple) -> None:
        """A CPU-sync replay whose routing the device rejected (it sent nothing, but peers sent us
        theirs): drain what they sent, then raise the routing's `ValueError` (the front calls it once
        the counts say so; `inputs`: the first program's)."""
        try:
            entry.drain()
        except BaseException as error:
            self.runtime.fail_between_launches("dispatch", error)
            raise
        raise_rejected_routing(self.runtime, inputs[2], entry.handle.num_experts)


def _epilogue_row_fields() -> tuple[tuple[int, int, int, str], ...]:
    """The dispatch epilogue's fields that take the output rows and the received tokens."""
    out, meta = specs.DispatchEpilogueArgs.num_out_rows, specs.DispatchEpilogueArgs.num_meta_rows
    return (0, out.offset, out.size, "out"), (0, meta.offset, meta.size, "meta")
