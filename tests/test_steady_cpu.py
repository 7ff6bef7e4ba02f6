"""The steady path's parts that run without a GPU (`deep_ep.backends.kernels.steady`): the C++
program compiled against this torch and its checks of a description and of the inputs, and what a
recording becomes (which parameter words are patched with which tensor's address, and when a call
is refused). Its replays run on the GPU machine (`tests/loopback/test_steady_gpu.py`)."""

from __future__ import annotations

import ctypes
import random
from types import MethodType, SimpleNamespace

import pytest
import torch
from deep_ep.jit import U64, Opaque

from deep_ep.backends.kernels.steady import (
    STATE_FIELDS,
    Entry,
    Recorder,
    SteadyPath,
    _exact_shape,
    _synced_shape,
    describe_program,
    steady_module,
)
from deep_ep.event import EventHandle
from deep_ep.handle import EPHandle

# The module is compiled with nvcc (skipped with the reason where it is not found: tests/conftest.py)
pytestmark = pytest.mark.nvcc


class _Args(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint64), ("n", ctypes.c_int), ("out", ctypes.c_uint64), ("scratch", ctypes.c_uint64)]


def _stream(handle: int = 7) -> SimpleNamespace:
    """A stand-in for the communication stream: only its identity is read here."""
    return SimpleNamespace(cuda_stream=handle, stream_id=3, device_index=0, device_type=1)


def _recording(x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, stream: SimpleNamespace) -> Recorder:
    """A recording of one launch whose struct and scalar point at `x`, `out` and `scratch`."""
    recorder = Recorder()
    recorder.allocated(out)
    recorder.pointers += [x, out, scratch]
    args = _Args(x=x.data_ptr(), n=random.randint(1, 1000), out=out.data_ptr(), scratch=scratch.data_ptr())
    recorder.launched(SimpleNamespace(handle=0x1234), dict(grid=(5,), block=(128,), stream=stream, pdl=True,
                                                            args=(Opaque(bytes(args)), U64(out.data_ptr()))))  # fmt: skip
    return recorder


def test_a_recording_becomes_patches_at_each_address_of_an_input_or_allocation():
    stream, scratch = _stream(), torch.randn(16)
    x, out = torch.randn(4, 8), torch.empty(32)
    recorder = _recording(x, out, scratch, stream)
    view = out[8:].view(4, 6)
    built = describe_program([scratch], stream, recorder, [x, None], [view, x, None], False, True)
    assert not isinstance(built, str), built
    description, keep = built
    sources = description[12]
    (handle, grid, block, cooperative, pdl, _, patches, fields) = description[8][0]
    assert fields == ()
    assert (handle, grid, block, cooperative, pdl) == (0x1234, (5, 1, 1), (128, 1, 1), False, True)
    # x's address in the struct at 0, the allocation's at 16 and in the scalar; the scratch stays
    assert patches == ((0, _Args.x.offset, 0), (0, _Args.out.offset, -1), (1, 0, -1))
    assert [k for k in keep] == [scratch]
    assert sources == (0, -1, None)  # the view is output 0; x is input 0 itself
    assert description[7] == ((0, (4, 6), (6, 1), 8),)
    assert description[5] == ((torch.float32, (4, 8), (8, 1)), None)
    assert description[2:4] == (False, True)
    assert description[6] == ((torch.float32, (32,), (1,), False),)
    # A handle's tensors share one allocation: the allocation behind result 0 joins the group, and
    # so does one no result returns
    grouped = describe_program([scratch], stream, recorder, [x, None], [view, x, None], False, True, None, [0])
    assert grouped[0][6] == ((torch.float32, (32,), (1,), True),)
    unreturned = describe_program([scratch], stream, recorder, [x, None], [x], False, True, None, (), True)
    assert unreturned[0][6] == ((torch.float32, (32,), (1,), True),)


def test_a_recording_is_refused_where_an_address_could_go_stale():
    stream, scratch = _stream(), torch.randn(16)
    x, out = torch.randn(4, 8), torch.empty(32)
    copy_made_inside = torch.randn(4, 8)
    recorder = _recording(x, out, scratch, stream)
    recorder.pointers.append(copy_made_inside)
    assert "made inside the call" in describe_program([scratch], stream, recorder, [x], [out], False, False)
    recorder = _recording(x, out, scratch, stream)
    assert "two inputs at one address" in describe_program([scratch], stream, recorder, [x, x[0]], [out], False,
                                                           False)  # fmt: skip
    recorder = _recording(x, out, scratch, _stream(8))
    assert "off the communication stream" in describe_program([scratch], stream, recorder, [x], [out], False,
                                                              False)  # fmt: skip
    recorder = _recording(x, out, scratch, stream)
    other = torch.randn(3)
    assert "neither an input nor an allocation" in describe_program([scratch], stream, recorder, [x], [other],
                                                                    False, False)  # fmt: skip


def test_the_compiled_program_checks_its_description_and_its_inputs():
    module, reason = steady_module()
    assert module is not None, reason
    stream, scratch = _stream(), torch.randn(16)
    x, out = torch.randn(4, 8), torch.empty(32)
    description, _ = describe_program([scratch], stream, _recording(x, out, scratch, stream), [x, None], [out],
                                         False, False)  # fmt: skip
    program = module.Program(description)
    assert program.num_runs == 0
    # The recorded inputs were CPU tensors and a program runs on CUDA ones: every call is refused
    # before anything is enqueued, so the caller takes the Python path
    assert program.run((x, None), None, ()) is None
    assert program.run((torch.randn(4, 9), None), None, ()) is None
    assert program.run((x, x), None, ()) is None  # `None` was recorded there
    assert program.run((None, None), None, ()) is None
    with pytest.raises(TypeError, match="expected 2 inputs and 0 values, got 1 and 0"):
        program.run((x,), None, ())
    with pytest.raises(TypeError, match="expected 2 inputs and 0 values, got 2 and 1"):
        program.run((x, None), None, (5,))
    with pytest.raises(TypeError):
        program.run([x, None], None, ())
    # Descriptions are checked when the program is made
    bad_patch = list(description)
    launch = list(description[8][0])
    launch[6] = ((0, 40, 0),)  # past the 32-byte struct
    bad_patch[8] = (tuple(launch),)
    with pytest.raises(ValueError, match="patch out of range"):
        module.Program(tuple(bad_patch))
    bad_dtype = list(description)
    bad_dtype[5] = (("float32", (4, 8), (8, 1)), None)
    with pytest.raises(ValueError, match=r"torch\.dtype"):
        module.Program(tuple(bad_dtype))
    with pytest.raises(ValueError, match="too short"):
        module.Program(description[:5])
    # With nothing to check the program reaches the driver, which this machine may not have
    bad_source = (*description[:12], (1,))  # one output only
    with pytest.raises(ValueError, match="result source out of range"):
        module.Program(bad_source)
    twice = (*description[:12], (0, 0))
    with pytest.raises(ValueError, match="two results"):
        module.Program(twice)
    empty = (0, description[1], False, False, True, (), (), (), (), True, True, 0, ())
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="libcuda"):
            module.Program(empty).run((), None, ())


def test_a_buffers_programs_launch_as_graphs_unless_switched_off(monkeypatch):
    module, reason = steady_module()
    assert module is not None, reason
    scratch, x, out = torch.randn(16), torch.randn(4, 8), torch.empty(32)
    description, keep = describe_program([scratch], _stream(), _recording(x, out, scratch, _stream()), [x, None],
                                         [out], False, False)  # fmt: skip
    program = module.Program(description)
    # Until it is built there is no graph, and nothing counted or wrong; this recording's one launch
    # overlaps the stream's earlier work (PDL), which no graph can hold (and a CPU machine has no driver)
    assert program.use_graph is True and program.graph_counts == (0, 0) and program.graph_problem is None
    program.build_graph()
    no_graph = ("its first kernel overlaps the stream's earlier work (PDL)", "libcuda.so.1 cannot be loaded")
    assert program.graph_problem == no_graph[0 if torch.cuda.is_available() else 1]
    program.use_graph = 0
    assert program.use_graph is False
    with pytest.raises(TypeError, match="cannot be deleted"):
        del program.use_graph
    # The buffer's switch: the environment for new buffers, `set_graphs` for the programs it has and makes
    for value, expected in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv("EP_STEADY_GRAPHS", value)
        assert SteadyPath(module, _Runtime(), _stream(), 1).use_graphs is expected
    steady = SteadyPath(module, _Runtime(), _stream(), random.randint(1, 1000))
    keys = [("combine", i) for i in range(3)]
    steady._remember(keys[0], (description, keep))
    steady._remember(keys[1], "declined")
    steady.set_graphs(True)
    steady._remember(keys[2], (description, keep))
    assert [p.use_graph for p in steady.programs()] == [True, True]
    steady.set_graphs(False)
    steady._remember(("dispatch", 0), (description, keep))
    assert [p.use_graph for p in steady.programs()] == [False] * 3
    # Built with graphs on: the first two programs, which say why they have none
    stats = steady.graph_stats()
    assert (stats["launches"], stats["updates"], sum(stats["problems"].values())) == (0, 0, 2), stats
    assert set(stats["problems"]) <= set(no_graph), stats


def test_the_two_parts_of_a_cpu_sync_dispatch_take_the_counts_as_values():
    from deep_ep.backends.kernels.steady import Part

    stream, scratch = _stream(), torch.randn(16)
    x, slots = torch.randn(4, 8), torch.empty(4, dtype=torch.int32)
    recorder = Recorder()
    recorder.allocated(slots)
    args = _Args(x=x.data_ptr(), n=3, out=slots.data_ptr(), scratch=scratch.data_ptr())
    launch = dict(grid=(9,), block=(128,), stream=stream, args=(Opaque(bytes(args)),))
    recorder.launched(SimpleNamespace(handle=1), dict(launch, cooperative=True))
    recorder.pointers += [x, slots, scratch]
    recorder.waiting_for_counts()
    rows, constant = torch.empty(37, 8), torch.empty(4)
    recorder.allocated(rows, "out")
    recorder.allocated(constant)
    later = _Args(x=slots.data_ptr(), n=37, out=rows.data_ptr(), scratch=constant.data_ptr())
    recorder.launched(SimpleNamespace(handle=2), dict(launch, grid=(5,), args=(Opaque(bytes(later)),), pdl=True))
    recorder.pointers += [slots, rows, constant]
    first = Part(allocs=slice(0, 1), launches=slice(0, 1), ends=False, values=("sequence",),
                 fields={0: ((0, _Args.n.offset, 4, "sequence"),)})  # fmt: skip
    built = describe_program([scratch], stream, recorder, [x], [slots], False, False, first)
    assert not isinstance(built, str), built
    description = built[0]
    assert description[6] == ((torch.int32, (4,), (1,), False),) and description[9:] == (True, False, 1, (0,))
    assert description[8][0][7] == ((0, _Args.n.offset, 4, 0),)
    second = Part(allocs=slice(1, None), launches=slice(1, None), begins=False, values=("out", "grid"), rows=("out",),
                  fields={1: ((0, _Args.n.offset, 4, "out"),)}, grids={1: "grid"})  # fmt: skip
    built = describe_program([scratch], stream, recorder, [x, slots], [rows, constant, slots], False, False, second)
    assert not isinstance(built, str), built
    description, _ = built
    # The rows' first dimension is value 0, the grid's x value 1; the first part's allocation is an input
    assert description[6] == ((torch.float32, (-1, 8), (8, 1), False), (torch.float32, (4,), (1,), False))
    assert description[7] == ((0, (-1, 8), (8, 1), 0), (1, (4,), (1,), 0))
    (_, grid, _, _, pdl, _, patches, fields) = description[8][0]
    assert grid == (-2, 1, 1) and pdl and fields == ((0, _Args.n.offset, 4, 0),)
    assert patches == ((0, _Args.x.offset, 1), (0, _Args.out.offset, -1), (0, _Args.scratch.offset, -2))
    # rows and constant are outputs 0 and 1, slots input 1 (the first part's allocation)
    assert description[9:] == (False, True, 2, (0, 1, -2))
    module, reason = steady_module()
    assert module is not None, reason
    program = module.Program(description)
    assert program.run((None, None), None, (37, 5)) is None  # x was recorded
    with pytest.raises(ValueError, match=">= 0"):
        program.run((x, slots), None, (-3, 5))
    # A view of an allocation whose rows are the call's cannot be returned
    assert "a view of an allocation" in describe_program([scratch], stream, recorder, [x, slots], [rows[:5]],
                                                         False, False, second)  # fmt: skip


def test_copy_with_makes_a_copy_of_a_template_with_the_named_fields_set():
    module, reason = steady_module()
    assert module is not None, reason
    fields = {f"field_{i}": random.random() for i in range(random.randint(3, 9))}
    template = _Template()
    template.__dict__.update(fields)
    names = tuple(random.sample(sorted(fields), 2))
    values = tuple(torch.randn(2) for _ in range(5))
    start = random.randint(0, 3)
    copy = module.copy_with(template, names, values, start)
    assert type(copy) is _Template and copy is not template
    assert copy.__dict__ == fields | {names[0]: values[start], names[1]: values[start + 1]}
    assert template.__dict__ == fields  # the template is left as it was
    copy.other = 1  # the copy has a dict of its own
    assert not hasattr(template, "other")
    assert module.copy_with(template, (), (), 0).__dict__ == fields
    with pytest.raises(ValueError, match="fewer than start"):
        module.copy_with(template, names, values, 4)
    with pytest.raises(ValueError, match="fewer than start"):
        module.copy_with(template, names, values, -1)
    with pytest.raises(TypeError, match="copy_with"):
        module.copy_with(template, list(names), values, 0)
    with pytest.raises(TypeError, match="names must be strings"):
        module.copy_with(template, (1, 2), values, 0)


class _Template:
    """A plain class, as `EPHandle` and the kernels' handle state are."""


# ------------------------------------------------------------------------------------ the front


def _handle(buffer_id: int, do_cpu_sync: bool, num_recv_tokens: int, **fields: object) -> EPHandle:
    """A handle of `buffer_id` with random tensors where a dispatch's would be."""
    num_tokens, num_topk = random.randint(1, 64), random.randint(1, 8)
    state = _Template()
    state.__dict__.update({name: torch.randn(3) for name in STATE_FIELDS})
    values = dict(do_expand=False, num_experts=64, expert_alignment=1, num_max_tokens_per_rank=64, num_sms=8,
                  topk_idx=torch.randint(0, 64, (num_tokens, num_topk)), num_recv_tokens=num_recv_tokens,
                  num_expanded_tokens=num_recv_tokens, num_recv_tokens_per_expert_list=[],
                  psum_num_recv_tokens_per_scaleup_rank=torch.randn(2), psum_num_recv_tokens_per_expert=torch.randn(2),
                  num_unaligned_recv_tokens_per_expert=torch.randn(2), recv_src_metadata=torch.randn(4),
                  dst_buffer_slot_idx=torch.randn(2), num_tokens=num_tokens, num_topk=num_topk, hidden=128,
                  buffer_id=buffer_id, do_cpu_sync=do_cpu_sync, scale_kind=None, backend_state=state)  # fmt: skip
    values.update(fields)
    return EPHandle(**values)


class _Runtime:
    """What the front reads of a runtime: its error words, counts, `dead_reason` and checks."""

    def __init__(self) -> None:
        self.error_words = (ctypes.c_int64 * 8)()
        self.host_counts = torch.zeros(16, dtype=torch.int32)
        self.counts_ready = torch.zeros(1, dtype=torch.int64)
        self.num_ranks = 2
        self.dead_reason: str | None = None
        self.num_checks = 0

    def check_error(self) -> None:
        self.num_checks += 1
        raise RuntimeError(f"the runtime's check: {self.dead_reason}")


def _dispatch_args(x: object, **given: object) -> list:
    """`ElasticBuffer.dispatch`'s arguments in order, its defaults where not given."""
    defaults = dict(topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
                    num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, previous_event=None,
                    previous_event_before_epilogue=None, async_with_compute_stream=False,
                    allocate_on_comm_stream=False, handle=None, do_handle_copy=True, do_cpu_sync=None, do_expand=False,
                    do_zero_padding=False, use_tma_aligned_col_major_sf=False)  # fmt: skip
    unknown = set(given) - set(defaults)
    assert not unknown, unknown
    return [x, *(given.get(name, value) for name, value in defaults.items())]


def _combine_args(x: object, handle: object, **given: object) -> list:
    defaults = dict(topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                    previous_event_before_epilogue=None, async_with_compute_stream=False,
                    allocate_on_comm_stream=False)  # fmt: skip
    return [x, handle, *(given.get(name, value) for name, value in defaults.items())]


def test_the_fronts_keys_tell_apart_every_call_that_records_differently():
    module, reason = steady_module()
    assert module is not None, reason
    buffer_id = random.randint(1, 1000)
    front = SteadyPath(module, _Runtime(), _stream(), buffer_id).front
    tokens, hidden = random.randint(1, 64), 16 * random.randint(1, 8)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    idx = torch.randint(0, 64, (tokens, 8))
    fresh = dict(topk_idx=idx, num_experts=64, do_cpu_sync=False)
    key = front.dispatch_key(*_dispatch_args(x, **fresh))
    assert key is not None and hash(key) == hash(front.dispatch_key(*_dispatch_args(x.clone(), **fresh)))
    # Another shape, dtype, scalar or scalar type, or a None in another place: another key
    others = [
        front.dispatch_key(*_dispatch_args(x[:-1] if tokens > 1 else torch.randn(2, hidden).bfloat16(), **fresh)),
        front.dispatch_key(*_dispatch_args(x.float(), **fresh)),
        front.dispatch_key(*_dispatch_args(x, **(fresh | dict(num_experts=64.0)))),
        front.dispatch_key(*_dispatch_args(x, **(fresh | dict(num_sms=random.randint(1, 100))))),
        front.dispatch_key(*_dispatch_args(x, **(fresh | dict(do_expand=1)))),
        front.dispatch_key(*_dispatch_args(x, **(fresh | dict(topk_weights=torch.rand(tokens, 8))))),
        front.dispatch_key(*_dispatch_args((x, torch.randn(tokens, 1)), **fresh)),
        front.dispatch_key(*_dispatch_args(x, **(fresh | dict(previous_event=EventHandle(use_cuda=False))))),
    ]
    assert all(other is not None and other != key for other in others)
    assert len(set(others)) == len(others)
    # Calls that take the Python path every time: no key
    assert front.dispatch_key(*_dispatch_args(x, **(fresh | dict(previous_event_before_epilogue=object())))) is None
    assert front.dispatch_key(*_dispatch_args(x, **(fresh | dict(previous_event=object())))) is None
    assert (
        front.dispatch_key(*_dispatch_args(x, topk_idx=idx, num_experts=64, use_tma_aligned_col_major_sf=True)) is None
    )
    assert front.dispatch_key(*_dispatch_args([x], **fresh)) is None
    assert front.dispatch_key(*_dispatch_args((x, x, x), **fresh)) is None
    # Cached: the handle's shape is in the key, a CPU-sync handle's rows are not
    synced = _handle(buffer_id, True, random.randint(1, 100))
    cached = front.dispatch_key(*_dispatch_args(x, handle=synced))
    rows = synced.num_recv_tokens + random.randint(1, 100)
    assert cached == front.dispatch_key(*_dispatch_args(x, handle=_handle(buffer_id, True, rows,
                                                                          num_tokens=synced.num_tokens,
                                                                          num_topk=synced.num_topk)))  # fmt: skip
    exact = _handle(buffer_id, False, 7, num_tokens=synced.num_tokens, num_topk=synced.num_topk)
    assert front.dispatch_key(*_dispatch_args(x, handle=exact)) != front.dispatch_key(
        *_dispatch_args(x, handle=_handle(buffer_id, False, 8, num_tokens=synced.num_tokens, num_topk=synced.num_topk))
    )
    assert front.dispatch_key(*_dispatch_args(x, handle=_handle(buffer_id + 1, True, 5))) is None  # another buffer's
    assert front.dispatch_key(*_dispatch_args(x, handle=synced, cumulative_local_expert_recv_stats=idx)) is None
    assert front.dispatch_key(*_dispatch_args(x, handle=synced, use_tma_aligned_col_major_sf=True)) is None
    # Combine
    y = torch.randn(synced.num_recv_tokens, hidden).to(torch.bfloat16)
    combine = front.combine_key(*_combine_args(y, synced))
    assert combine is not None and combine == front.combine_key(*_combine_args(torch.randn(rows, hidden).bfloat16(),
                                                                               synced))  # fmt: skip
    assert combine != front.combine_key(*_combine_args(y, synced, bias=y))
    assert combine != front.combine_key(*_combine_args(y, synced, num_qps=random.randint(1, 8)))
    assert combine != front.combine_key(*_combine_args(y.float(), synced))
    assert front.combine_key(*_combine_args(y, synced, bias=(y, y, y))) is None
    assert front.combine_key(*_combine_args(y, _handle(buffer_id + 1, True, 5))) is None
    assert front.combine_key(*_combine_args(y.tolist(), synced)) is None
    with pytest.raises(TypeError, match="takes 19 arguments"):
        front.dispatch_key(x)


def test_the_front_gathers_inputs_in_program_order_and_leaves_unknown_calls_to_python():
    module, reason = steady_module()
    assert module is not None, reason
    buffer_id, runtime = random.randint(1, 1000), _Runtime()
    steady = SteadyPath(module, runtime, _stream(), buffer_id)
    front = steady.front
    handle = _handle(buffer_id, True, random.randint(1, 50))
    state = handle.backend_state
    x, scales, weights = torch.randn(4, 32), torch.randn(4, 2), torch.rand(4, 8)
    inputs = front.dispatch_inputs((x, scales), None, weights, None, handle)
    expected = (x, scales, handle.topk_idx, weights, None, state.slot_idx, state.num_tokens_per_rank,
                handle.num_unaligned_recv_tokens_per_expert, handle.recv_src_metadata)  # fmt: skip
    assert len(inputs) == len(expected) and all(a is b for a, b in zip(inputs, expected, strict=True))
    idx = torch.randint(0, 64, (4, 8))
    assert all(a is b for a, b in zip(front.dispatch_inputs(x, idx, None, None, None), (x, None, idx, None, None),
                                      strict=True))  # fmt: skip
    bias = (torch.randn(4, 32), torch.randn(4, 32))
    expected = (x, weights, *bias, handle.topk_idx, handle.recv_src_metadata,
                handle.psum_num_recv_tokens_per_scaleup_rank, state.slot_idx, state.num_tokens_per_rank)  # fmt: skip
    assert all(a is b for a, b in zip(front.combine_inputs(x, handle, weights, bias), expected, strict=True))
    # No program for the key, or a shape that stays on the Python path: None, nothing counted
    args = _combine_args(x, handle)
    assert front.combine(*args) is None
    steady.entries[front.combine_key(*args)] = None
    assert front.combine(*args) is None and steady.num_calls == steady.num_refused == 0
    # A program whose recording saw other inputs refuses the call: the Python path takes it
    scratch, out = torch.randn(16), torch.empty(32)
    description, keep = describe_program([scratch], _stream(), _recording(x, out, scratch, _stream()), [x, None],
                                         [out], False, False)  # fmt: skip
    steady.entries[front.combine_key(*args)] = Entry(module.Program(description), keep)
    if torch.cuda.is_available():
        pytest.skip("the refusal below needs the recorded CPU tensors to be refused (no CUDA)")
    with pytest.raises(TypeError, match="expected 2 inputs"):  # a combine has nine inputs
        front.combine(*args)
    assert steady.num_calls == 0
    # The runtime's checks run before any replay when its error words say so, and raise
    runtime.error_words[0] = 1
    with pytest.raises(RuntimeError, match="the runtime's check"):
        front.combine(*args)
    runtime.error_words[0], runtime.dead_reason = 0, "a peer died"
    with pytest.raises(RuntimeError, match="a peer died"):
        front.combine(*args)
    assert runtime.num_checks == 2
    # A handle made by hand without a backend state: the Python path says what is wrong with it
    handle.backend_state = None
    assert front.combine(*args) is None


def test_the_front_remembers_the_last_calls_entry_until_the_entries_change():
    module, reason = steady_module()
    assert module is not None, reason
    if torch.cuda.is_available():
        pytest.skip("the refusal below needs the recorded CPU tensors to be refused (no CUDA)")
    buffer_id = random.randint(1, 1000)
    steady = SteadyPath(module, _Runtime(), _stream(), buffer_id)
    front, handle = steady.front, _handle(buffer_id, True, random.randint(1, 50))
    rows, hidden = random.randint(1, 50), random.choice([64, 128])
    args = _combine_args(torch.randn(rows, hidden), handle)
    scratch, out = torch.randn(16), torch.empty(32)
    description, keep = describe_program([scratch], _stream(), _recording(args[0], out, scratch, _stream()),
                                         [args[0], None], [out], False, False)  # fmt: skip
    key = front.combine_key(*args)
    steady.entries[key] = Entry(module.Program(description), keep)
    # The entry's program serves the call (it refuses these inputs loudly: a combine has nine)
    for x in (args[0], torch.randn(rows + 1, hidden)):  # a CPU-sync handle's rows are the call's values
        with pytest.raises(TypeError, match="expected 2 inputs"):
            front.combine(*_combine_args(x, handle))
    # Whatever changes the key misses the remembered entry: another scalar type, size, dtype, event, bias
    for other in (_combine_args(args[0], handle, num_sms=0.0), _combine_args(args[0], handle, num_qps=False),
                  _combine_args(torch.randn(rows, hidden + 16), handle), _combine_args(args[0].double(), handle),
                  _combine_args(args[0], handle, previous_event=EventHandle(use_cuda=False)),
                  _combine_args(args[0], handle, bias=args[0]),
                  _combine_args(args[0], _handle(buffer_id, True, rows, num_sms=handle.num_sms + 1))):  # fmt: skip
        assert front.combine_key(*other) != key and front.combine(*other) is None
    with pytest.raises(TypeError, match="expected 2 inputs"):
        front.combine(*args)
    # A change of the entries through the steady path drops the memo: the new entry serves the call
    steady._remember(key, "a reason")  # a recorded key keeps its program
    with pytest.raises(TypeError, match="expected 2 inputs"):
        front.combine(*args)
    del steady.entries[key]
    steady._remember(key, "declined now")
    assert steady.entries[key] is None and front.combine(*args) is None
    assert steady.num_calls == 0


def test_the_fronts_epilogue_grid_is_the_runtimes():
    from deep_ep.backends.kernels.runtime import NvlinkRuntime

    module, reason = steady_module()
    assert module is not None, reason
    buffer_id = random.randint(1, 1000)
    front = SteadyPath(module, _Runtime(), _stream(), buffer_id).front
    entry = Entry(None, [])
    for _ in range(200):
        runtime = SimpleNamespace(num_device_sms=random.randint(8, 160), nic_ctas=random.randint(0, 1),
                                  share=SimpleNamespace(exclusive=random.random() < 0.5))  # fmt: skip
        runtime.epilogue_terms = MethodType(NvlinkRuntime.epilogue_terms, runtime)
        busy, rows = random.randint(1, runtime.num_device_sms), random.randint(0, 100_000)
        entry.epilogue_terms = runtime.epilogue_terms(busy)
        expected = NvlinkRuntime.grid_for_rows(runtime, rows, busy) + runtime.nic_ctas
        assert front.epilogue_grid(entry, rows) == expected
    with pytest.raises(ValueError, match="negative rows"):
        front.epilogue_grid(entry, -1)


def test_the_front_keeps_what_its_keys_take_of_a_handle_in_the_handle():
    module, reason = steady_module()
    assert module is not None, reason
    buffer_id = random.randint(1, 1000)
    front = SteadyPath(module, _Runtime(), _stream(), buffer_id).front
    synced, exact = _handle(buffer_id, True, random.randint(1, 50)), _handle(buffer_id, False, random.randint(1, 50))
    y = torch.randn(synced.num_recv_tokens, 64)
    assert synced._steady_shape is None
    key = front.combine_key(*_combine_args(y, synced))
    kept = synced._steady_shape
    assert kept == (buffer_id, True, _synced_shape(synced)) and key is not None
    assert front.handle_summary(exact) == (buffer_id, False, _exact_shape(exact)) == exact._steady_shape
    # A handle made from a template (a replay's) carries the template's, and makes the same key
    made = module.copy_with(synced, ("topk_idx", "num_recv_tokens"), (None, synced.num_recv_tokens + 1), 0)
    assert made._steady_shape is kept and front.combine_key(*_combine_args(y[1:], made)) == key
    # Another buffer's handle: the Python path (which names the buffer that made it)
    other = _handle(buffer_id + 1, True, 3)
    assert front.combine_key(*_combine_args(y, other)) is None and other._steady_shape[0] == buffer_id + 1


def test_the_host_floor_refuses_what_it_cannot_time_before_touching_the_driver():
    # On a GPU it is timed by the host bench (tests/test_bench_gpu.py); here only its checks run
    module, reason = steady_module()
    assert module is not None, reason
    samples, num_bytes = random.randint(1, 50), random.randint(1, 1 << 20)
    with pytest.raises(ValueError, match="function must be loaded"):
        module.host_floor(0, 0, samples, num_bytes)
    with pytest.raises(ValueError, match="positive"):
        module.host_floor(random.randint(1, 1 << 40), 0, 0, num_bytes)
    with pytest.raises(TypeError, match="host_floor"):
        module.host_floor(1, 0, samples)
