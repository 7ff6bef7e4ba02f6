// The steady path's front: `ElasticBuffer.dispatch` and `.combine` hand their arguments here first.
//
// Compiled as one unit with steady.cpp (steady.py joins the two sources). A replayed call made
// a dozen Python calls around `Program.run` (its key, its inputs, the run, the handle and event
// objects); on the GPU machine's CPU, with caches cold from waiting on the device, those cost 10-14 us
// per call (bench/NOTES.md, session 25). Here they are C API calls: the key, the lookup in the steady
// path's `entries`, the inputs, the run and the results. What is rare stays in Python and is called
// from here: the runtime's checks when their error words are set, a count wait that outlasts a short
// spin (`NvlinkRuntime.wait_counts`), a routing the device rejected, the epilogue grid of a CPU-sync
// call's rows.
//
// The keys are the only ones the steady path has (the Python path records under `Front.dispatch_key`'s
// and `Front.combine_key`'s), so a recording and its replays cannot disagree about them.
#include <sched.h>

#include <initializer_list>

namespace {

// Attribute names, interned once
struct Names {
    PyObject *shape, *dtype, *buffer_id, *do_cpu_sync, *do_expand, *num_recv_tokens, *num_expanded_tokens, *num_experts,
        *topk_idx, *backend_state, *slot_idx, *num_tokens_per_rank, *num_unaligned_recv_tokens_per_expert,
        *recv_src_metadata, *psum_num_recv_tokens_per_scaleup_rank, *event, *cuda_event, *program, *handle, *state,
        *first, *busy_sms, *dead_reason, *num_experts_checked, *check_error, *take_input_error, *grid_for_rows,
        *nic_ctas, *num_recv_tokens_per_expert_list, *dispatch, *combine, *next_counts_sequence, *wait_counts,
        *num_counts_waits, *counts_wait_ns, *fail_between_launches, *rejected, *expert_alignment, *num_out_rows,
        *num_meta_rows, *num_expanded_rows;
    PyObject *zero, *from_one;  // 0, and the slice `1:`
};
Names names;

bool intern_names() {
    struct Entry {
        PyObject** slot;
        const char* text;
    };
    const Entry all[] = {{&names.shape, "shape"},
                         {&names.dtype, "dtype"},
                         {&names.buffer_id, "buffer_id"},
                         {&names.do_cpu_sync, "do_cpu_sync"},
                         {&names.do_expand, "do_expand"},
                         {&names.num_recv_tokens, "num_recv_tokens"},
                         {&names.num_expanded_tokens, "num_expanded_tokens"},
                         {&names.num_experts, "num_experts"},
                         {&names.topk_idx, "topk_idx"},
                         {&names.backend_state, "backend_state"},
                         {&names.slot_idx, "slot_idx"},
                         {&names.num_tokens_per_rank, "num_tokens_per_rank"},
                         {&names.num_unaligned_recv_tokens_per_expert, "num_unaligned_recv_tokens_per_expert"},
                         {&names.recv_src_metadata, "recv_src_metadata"},
                         {&names.psum_num_recv_tokens_per_scaleup_rank, "psum_num_recv_tokens_per_scaleup_rank"},
                         {&names.event, "event"},
                         {&names.cuda_event, "cuda_event"},
                         {&names.program, "program"},
                         {&names.handle, "handle"},
                         {&names.state, "state"},
                         {&names.first, "first"},
                         {&names.busy_sms, "busy_sms"},
                         {&names.dead_reason, "dead_reason"},
                         {&names.num_experts_checked, "num_experts_checked"},
                         {&names.check_error, "check_error"},
                         {&names.take_input_error, "take_input_error"},
                         {&names.grid_for_rows, "grid_for_rows"},
                         {&names.nic_ctas, "nic_ctas"},
                         {&names.num_recv_tokens_per_expert_list, "num_recv_tokens_per_expert_list"},
                         {&names.dispatch, "dispatch"},
                         {&names.combine, "combine"},
                         {&names.next_counts_sequence, "next_counts_sequence"},
                         {&names.wait_counts, "wait_counts"},
                         {&names.num_counts_waits, "num_counts_waits"},
                         {&names.counts_wait_ns, "counts_wait_ns"},
                         {&names.fail_between_launches, "fail_between_launches"},
                         {&names.rejected, "rejected"},
                         {&names.expert_alignment, "expert_alignment"},
                         {&names.num_out_rows, "num_out_rows"},
                         {&names.num_meta_rows, "num_meta_rows"},
                         {&names.num_expanded_rows, "num_expanded_rows"}};
    for (const Entry& entry : all)
        if ((*entry.slot = PyUnicode_InternFromString(entry.text)) == nullptr) return false;
    names.zero = PyLong_FromLong(0);
    PyObject* one = PyLong_FromLong(1);
    names.from_one = one == nullptr ? nullptr : PySlice_New(one, Py_None, Py_None);
    Py_XDECREF(one);
    return names.zero != nullptr && names.from_one != nullptr;
}

// A new reference that releases itself
struct Ref {
    PyObject* obj = nullptr;
    Ref() = default;
    explicit Ref(PyObject* o) : obj(o) {}
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    ~Ref() { Py_XDECREF(obj); }
    PyObject* get() const { return obj; }
    PyObject* release() {
        PyObject* o = obj;
        obj = nullptr;
        return o;
    }
    explicit operator bool() const { return obj != nullptr; }
};

struct FrontObject {
    PyObject_HEAD PyObject* entries;  // SteadyPath.entries: key -> Entry or None
    PyObject* steady;                 // the SteadyPath (its `rejected`)
    PyObject* runtime;
    PyObject* comm_stream;
    // Host memory the device writes: the runtime's error words, a CPU-sync dispatch's counts and the
    // word that says they are there (`NvlinkRuntime.host_counts`, `counts_ready`)
    const int64_t* error_words;
    const int32_t* counts;
    const uint64_t* counts_ready;
    Py_ssize_t num_count_words, input_error_word, num_ranks;
    PyObject* buffer_id;
    PyObject *handle_type, *event_handle_type;
    PyObject *synced_shape, *exact_shape;  // operator.attrgetter of a handle's shape fields
    PyObject *handle_fields, *state_fields;
    PyObject *event_template, *overlap_template;  // EventHandle.of(None), EventOverlap(None)
    PyObject* event_names;                        // ("event",)
    uint64_t num_calls, num_refused;
};

PyTypeObject FrontType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* bool_of(bool value) {
    return Py_NewRef(value ? Py_True : Py_False);
}

// `(values[0], ..., values[n - 1])`, the items' references stolen (a null item: the tuple is not made)
PyObject* tuple_of(std::initializer_list<PyObject*> values) {
    PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
    Py_ssize_t i = 0;
    bool complete = true;
    for (PyObject* value : values) {
        if (value == nullptr) complete = false;
        if (tuple != nullptr && value != nullptr)
            PyTuple_SET_ITEM(tuple, i, value);
        else
            Py_XDECREF(value);
        ++i;
    }
    if (tuple != nullptr && !complete) {
        Py_DECREF(tuple);  // the missing items are null there, which a tuple's dealloc skips
        return nullptr;
    }
    return tuple;
}

// `(scalars, tuple(map(type, scalars)))` as the Python keys had them: `num_experts=256.0` or
// `do_expand=1` must not meet the recording of 256 and True
PyObject* scalars_and_types(PyObject* const* scalars, Py_ssize_t count) {
    PyObject* values = PyTuple_New(count);
    PyObject* types = PyTuple_New(count);
    if (values == nullptr || types == nullptr) {
        Py_XDECREF(values);
        Py_XDECREF(types);
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < count; ++i) {
        PyTuple_SET_ITEM(values, i, Py_NewRef(scalars[i]));
        PyTuple_SET_ITEM(types, i, Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(scalars[i]))));
    }
    PyObject* both = PyTuple_Pack(2, values, types);
    Py_DECREF(values);
    Py_DECREF(types);
    return both;
}

// A handle's shape: the fields steady.py's `_SHAPE_FIELDS` names, read by its attrgetters (a CPU-sync
// handle's without its row counts)
PyObject* handle_shape(FrontObject* front, PyObject* handle, int* do_cpu_sync) {
    Ref synced(PyObject_GetAttr(handle, names.do_cpu_sync));
    if (!synced) return nullptr;
    *do_cpu_sync = PyObject_IsTrue(synced.get());
    if (*do_cpu_sync < 0) return nullptr;
    return PyObject_CallOneArg(*do_cpu_sync ? front->synced_shape : front->exact_shape, handle);
}

// Whether `handle` is an EPHandle of this buffer (1), not (0), or an error (-1)
int own_handle(FrontObject* front, PyObject* handle) {
    if (Py_TYPE(handle) != reinterpret_cast<PyTypeObject*>(front->handle_type)) return 0;
    Ref buffer_id(PyObject_GetAttr(handle, names.buffer_id));
    return buffer_id ? PyObject_RichCompareBool(buffer_id.get(), front->buffer_id, Py_EQ) : -1;
}

// Whether a call with these events can take the steady path: no `previous_event_before_epilogue`, and a
// `previous_event` that is an EventHandle or none
bool plain_events(FrontObject* front, PyObject* previous_event, PyObject* previous_event_before_epilogue) {
    return previous_event_before_epilogue == Py_None &&
           (previous_event == Py_None ||
            Py_TYPE(previous_event) == reinterpret_cast<PyTypeObject*>(front->event_handle_type));
}

// What a dispatch's program returns first (steady.py's `RESULT_FIELDS`): recv_x, recv_scales,
// recv_topk_idx, recv_topk_weights; a fresh dispatch's handle and state fields follow, the end event last
constexpr Py_ssize_t kNumResultFields = 4;

// The positions of `dispatch`'s arguments (ElasticBuffer.dispatch's order)
enum DispatchArg {
    kX,
    kTopkIdx,
    kTopkWeights,
    kStats,
    kNumExperts,
    kNumMaxTokensPerRank,
    kExpertAlignment,
    kNumSms,
    kNumQps,
    kPreviousEvent,
    kPreviousEventBeforeEpilogue,
    kAsync,
    kAllocateOnCommStream,
    kHandle,
    kDoHandleCopy,
    kDoCpuSync,
    kDoExpand,
    kDoZeroPadding,
    kColMajorScales,
    kNumDispatchArgs
};

// The positions of `combine`'s arguments
enum CombineArg {
    kCombineX,
    kCombineHandle,
    kCombineTopkWeights,
    kBias,
    kCombineNumSms,
    kCombineNumQps,
    kCombinePreviousEvent,
    kCombinePreviousEventBeforeEpilogue,
    kCombineAsync,
    kCombineAllocateOnCommStream,
    kNumCombineArgs
};

// The key of a dispatch (new reference), `Py_None` (new reference) when it takes the Python path
// anyway, or null on an error
PyObject* dispatch_key(FrontObject* front, PyObject* const* a) {
    if (!plain_events(front, a[kPreviousEvent], a[kPreviousEventBeforeEpilogue])) Py_RETURN_NONE;
    Ref shape;
    PyObject* handle = a[kHandle];
    if (handle == Py_None) {
        // With CPU sync (`None` means True without a handle) the scales' column stride would follow the
        // counts: column-major scales stay on the Python path there
        if (a[kDoCpuSync] != Py_False && a[kColMajorScales] != Py_False) Py_RETURN_NONE;
        shape.obj = Py_NewRef(Py_None);
    } else {
        int own = own_handle(front, handle);
        if (own < 0) return nullptr;
        if (!own || a[kStats] != Py_None) Py_RETURN_NONE;
        int do_cpu_sync = 0;
        shape.obj = handle_shape(front, handle, &do_cpu_sync);
        if (!shape) return nullptr;
        // With CPU sync the handle's rows change with every dispatch: they are the call's values, and the
        // scales' column stride would follow them
        if (do_cpu_sync && a[kColMajorScales] != Py_False) Py_RETURN_NONE;
    }
    PyObject* x = a[kX];
    Ref x_key;
    if (PyTuple_CheckExact(x)) {
        if (PyTuple_GET_SIZE(x) != 2) Py_RETURN_NONE;
        PyObject *data = PyTuple_GET_ITEM(x, 0), *scales = PyTuple_GET_ITEM(x, 1);
        if (!THPVariable_Check(data) || !THPVariable_Check(scales)) Py_RETURN_NONE;
        x_key.obj = tuple_of({PyObject_GetAttr(data, names.shape), PyObject_GetAttr(data, names.dtype),
                              PyObject_GetAttr(scales, names.shape), PyObject_GetAttr(scales, names.dtype)});
    } else if (THPVariable_Check(x)) {
        x_key.obj = tuple_of({PyObject_GetAttr(x, names.shape), PyObject_GetAttr(x, names.dtype)});
    } else {
        Py_RETURN_NONE;
    }
    if (!x_key) return nullptr;
    PyObject* const scalars[] = {
        a[kNumExperts],    a[kNumMaxTokensPerRank],  a[kExpertAlignment], a[kNumSms],    a[kNumQps],
        a[kAsync],         a[kAllocateOnCommStream], a[kDoHandleCopy],    a[kDoCpuSync], a[kDoExpand],
        a[kDoZeroPadding], a[kColMajorScales]};
    Ref both(scalars_and_types(scalars, 12));
    if (!both) return nullptr;
    return tuple_of({Py_NewRef(names.dispatch), x_key.release(), shape.release(), bool_of(a[kTopkIdx] == Py_None),
                     bool_of(a[kTopkWeights] == Py_None), bool_of(a[kStats] == Py_None),
                     bool_of(a[kPreviousEvent] == Py_None), Py_NewRef(PyTuple_GET_ITEM(both.get(), 0)),
                     Py_NewRef(PyTuple_GET_ITEM(both.get(), 1))});
}

// The key of a combine, as `dispatch_key`
PyObject* combine_key(FrontObject* front, PyObject* const* a) {
    if (!plain_events(front, a[kCombinePreviousEvent], a[kCombinePreviousEventBeforeEpilogue])) Py_RETURN_NONE;
    PyObject *x = a[kCombineX], *handle = a[kCombineHandle], *bias = a[kBias];
    int own = own_handle(front, handle);
    if (own < 0) return nullptr;
    if (!own || !THPVariable_Check(x)) Py_RETURN_NONE;
    if (PyTuple_CheckExact(bias) && PyTuple_GET_SIZE(bias) != 2) Py_RETURN_NONE;
    int do_cpu_sync = 0;
    Ref shape(handle_shape(front, handle, &do_cpu_sync));
    if (!shape) return nullptr;
    Ref rows(PyObject_GetAttr(x, names.shape));
    if (rows && do_cpu_sync) {  // a CPU-sync handle's rows are the call's values
        Ref whole(rows.release());
        rows.obj = PyObject_GetItem(whole.get(), names.from_one);
    }
    if (!rows) return nullptr;
    PyObject* const scalars[] = {a[kCombineNumSms], a[kCombineNumQps], a[kCombineAsync],
                                 a[kCombineAllocateOnCommStream]};
    Ref both(scalars_and_types(scalars, 4));
    if (!both) return nullptr;
    return tuple_of({Py_NewRef(names.combine), rows.release(), PyObject_GetAttr(x, names.dtype), shape.release(),
                     bool_of(a[kCombineTopkWeights] == Py_None), Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(bias))),
                     bool_of(a[kCombinePreviousEvent] == Py_None), Py_NewRef(PyTuple_GET_ITEM(both.get(), 0)),
                     Py_NewRef(PyTuple_GET_ITEM(both.get(), 1))});
}

// The tensors of a dispatch in the order its program takes them: data, scales, routing, weights,
// statistics, then a cached handle's (routing, slots, counts, metadata)
PyObject* dispatch_inputs(PyObject* x, PyObject* topk_idx, PyObject* topk_weights, PyObject* stats, PyObject* handle) {
    bool pair = PyTuple_CheckExact(x) && PyTuple_GET_SIZE(x) == 2;
    PyObject* data = pair ? PyTuple_GET_ITEM(x, 0) : x;
    PyObject* scales = pair ? PyTuple_GET_ITEM(x, 1) : Py_None;
    if (handle == Py_None) return PyTuple_Pack(5, data, scales, topk_idx, topk_weights, stats);
    Ref state(PyObject_GetAttr(handle, names.backend_state));
    if (!state) return nullptr;
    return tuple_of({Py_NewRef(data), Py_NewRef(scales), PyObject_GetAttr(handle, names.topk_idx),
                     Py_NewRef(topk_weights), Py_NewRef(stats), PyObject_GetAttr(state.get(), names.slot_idx),
                     PyObject_GetAttr(state.get(), names.num_tokens_per_rank),
                     PyObject_GetAttr(handle, names.num_unaligned_recv_tokens_per_expert),
                     PyObject_GetAttr(handle, names.recv_src_metadata)});
}

// The tensors of a combine in the order its program takes them
PyObject* combine_inputs(PyObject* x, PyObject* handle, PyObject* topk_weights, PyObject* bias) {
    bool pair = PyTuple_CheckExact(bias) && PyTuple_GET_SIZE(bias) == 2;
    PyObject* bias_0 = pair ? PyTuple_GET_ITEM(bias, 0) : bias;
    PyObject* bias_1 = pair ? PyTuple_GET_ITEM(bias, 1) : Py_None;
    Ref state(PyObject_GetAttr(handle, names.backend_state));
    if (!state) return nullptr;
    return tuple_of({Py_NewRef(x), Py_NewRef(topk_weights), Py_NewRef(bias_0), Py_NewRef(bias_1),
                     PyObject_GetAttr(handle, names.topk_idx), PyObject_GetAttr(handle, names.recv_src_metadata),
                     PyObject_GetAttr(handle, names.psum_num_recv_tokens_per_scaleup_rank),
                     PyObject_GetAttr(state.get(), names.slot_idx),
                     PyObject_GetAttr(state.get(), names.num_tokens_per_rank)});
}

// The CUevent a call's communication waits for: an int, or `Py_None` (none, or not yet recorded)
PyObject* previous_event_handle(PyObject* previous_event) {
    if (previous_event == Py_None) Py_RETURN_NONE;
    Ref event(PyObject_GetAttr(previous_event, names.event));
    if (!event) return nullptr;
    if (event.get() == Py_None) Py_RETURN_NONE;
    Ref handle(PyObject_GetAttr(event.get(), names.cuda_event));
    if (!handle) return nullptr;
    int set = PyObject_IsTrue(handle.get());
    if (set < 0) return nullptr;
    return set ? handle.release() : Py_NewRef(Py_None);
}

// The runtime's checks, called only when their words say there is something to raise (a call costs
// the host more than a read): 0, or -1 with the exception set
int check_runtime(FrontObject* front) {
    if (front->error_words[0] == 0) {
        Ref dead(PyObject_GetAttr(front->runtime, names.dead_reason));
        if (!dead) return -1;
        if (dead.get() == Py_None) return 0;
    }
    Ref checked(PyObject_CallMethodNoArgs(front->runtime, names.check_error));
    return checked ? 0 : -1;
}

// After a run: an invalid `topk_idx` an earlier dispatch found on the device is raised once this call
// is enqueued
int after_run(FrontObject* front) {
    ++front->num_calls;
    if (front->error_words[front->input_error_word] == 0) return 0;
    Ref raised(PyObject_CallMethodNoArgs(front->runtime, names.take_input_error));
    return raised ? 0 : -1;
}

// `EventOverlap(EventHandle.of(event))`, made from the templates
PyObject* overlap_of(FrontObject* front, PyObject* event) {
    Ref wrapped_event(PyTuple_Pack(1, event));
    if (!wrapped_event) return nullptr;
    PyObject* const event_args[] = {front->event_template, front->event_names, wrapped_event.get(), names.zero};
    Ref handle(copy_with(nullptr, event_args, 4));
    if (!handle) return nullptr;
    Ref wrapped_handle(PyTuple_Pack(1, handle.get()));
    if (!wrapped_handle) return nullptr;
    PyObject* const overlap_args[] = {front->overlap_template, front->event_names, wrapped_handle.get(), names.zero};
    return copy_with(nullptr, overlap_args, 4);
}

// V2's results of a dispatch from what its run returned (`RESULT_FIELDS`, ..., the end event last):
// `(recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights, handle, EventOverlap)`
PyObject* dispatch_results(FrontObject* front, PyObject* values, PyObject* handle) {
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    PyObject *recv_x = PyTuple_GET_ITEM(values, 0), *recv_scales = PyTuple_GET_ITEM(values, 1);
    Ref recv(recv_scales == Py_None ? Py_NewRef(recv_x) : PyTuple_Pack(2, recv_x, recv_scales));
    if (!recv) return nullptr;
    return tuple_of({recv.release(), Py_NewRef(PyTuple_GET_ITEM(values, 2)), Py_NewRef(PyTuple_GET_ITEM(values, 3)),
                     Py_NewRef(handle), overlap_of(front, PyTuple_GET_ITEM(values, n - 1))});
}

// Run `program` (an Entry's): its results tuple, `Py_None` when it refused the inputs, or null
PyObject* run_program(PyObject* program, PyObject* inputs, PyObject* event, PyObject* values) {
    if (!PyObject_TypeCheck(program, &ProgramType)) {
        PyErr_SetString(PyExc_TypeError, "deep_ep steady front: an entry's program is not a Program");
        return nullptr;
    }
    PyObject* const args[] = {inputs, event, values};
    return program_run(program, args, 3);
}

// The dispatch epilogue's grid over `num_meta_rows` received tokens, as dispatch.py launches it:
// `runtime.grid_for_rows(num_meta_rows, entry.busy_sms) + runtime.nic_ctas`
PyObject* epilogue_grid(FrontObject* front, PyObject* entry, PyObject* num_meta_rows) {
    Ref busy(PyObject_GetAttr(entry, names.busy_sms));
    Ref grid(busy ? PyObject_CallMethodObjArgs(front->runtime, names.grid_for_rows, num_meta_rows, busy.get(), nullptr)
                  : nullptr);
    Ref nic(grid ? PyObject_GetAttr(front->runtime, names.nic_ctas) : nullptr);
    return nic ? PyNumber_Add(grid.get(), nic.get()) : nullptr;
}

// A CPU-sync handle's row counts and its epilogue's grid (`(num_out_rows, num_meta_rows, grid)`), or ()
PyObject* handle_values(FrontObject* front, PyObject* handle, PyObject* entry, bool with_grid) {
    Ref synced(PyObject_GetAttr(handle, names.do_cpu_sync));
    int do_cpu_sync = synced ? PyObject_IsTrue(synced.get()) : -1;
    if (do_cpu_sync <= 0) return do_cpu_sync < 0 ? nullptr : PyTuple_New(0);
    Ref expand(PyObject_GetAttr(handle, names.do_expand));
    int do_expand = expand ? PyObject_IsTrue(expand.get()) : -1;
    if (do_expand < 0) return nullptr;
    Ref meta(PyObject_GetAttr(handle, names.num_recv_tokens));
    Ref out(do_expand ? PyObject_GetAttr(handle, names.num_expanded_tokens) : Py_XNewRef(meta.get()));
    if (!meta || !out) return nullptr;
    if (!with_grid) return PyTuple_Pack(2, out.get(), meta.get());
    PyObject* grid = epilogue_grid(front, entry, meta.get());
    return tuple_of({out.release(), meta.release(), grid});
}

// After inputs could not be gathered: `None` for a handle that lacks a field (one made by hand: the
// Python path's checks say what is wrong with it, and the buffer stays usable), else the error
PyObject* declined_on_missing_attribute() {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
    PyErr_Clear();
    Py_RETURN_NONE;
}

// The entry of `key` when it has a program (new reference), else null with no error
PyObject* entry_of(FrontObject* front, PyObject* key) {
    if (key == Py_None) return nullptr;
    PyObject* entry = PyDict_GetItemWithError(front->entries, key);
    if (entry == nullptr || entry == Py_None) return nullptr;
    return Py_NewRef(entry);
}

// A fresh dispatch's new handle and its backend state: the entry's templates with the tensors of
// `values` (what its program returned) in place
PyObject* fresh_handle(FrontObject* front, PyObject* entry, PyObject* values) {
    Ref handle_template(PyObject_GetAttr(entry, names.handle));
    Ref state_template(PyObject_GetAttr(entry, names.state));
    Ref handle_start(PyLong_FromSsize_t(kNumResultFields));
    Ref state_start(PyLong_FromSsize_t(kNumResultFields + PyTuple_GET_SIZE(front->handle_fields)));
    if (!handle_template || !state_template || !handle_start || !state_start) return nullptr;
    PyObject* const handle_args[] = {handle_template.get(), front->handle_fields, values, handle_start.get()};
    PyObject* const state_args[] = {state_template.get(), front->state_fields, values, state_start.get()};
    Ref handle(copy_with(nullptr, handle_args, 4));
    Ref state(handle ? copy_with(nullptr, state_args, 4) : nullptr);
    Ref experts(PyObject_GetAttr(handle_template.get(), names.num_experts));
    // its routing is checked on the device
    if (!state || !experts || PyObject_SetAttr(handle.get(), names.backend_state, state.get()) < 0 ||
        PyObject_SetAttr(front->runtime, names.num_experts_checked, experts.get()) < 0)
        return nullptr;
    return handle.release();
}

// `obj.name += amount` (a Python int)
int add_to(PyObject* obj, PyObject* name, long long amount) {
    Ref total(PyObject_GetAttr(obj, name));
    Ref step(total ? PyLong_FromLongLong(amount) : nullptr);
    Ref sum(step ? PyNumber_Add(total.get(), step.get()) : nullptr);
    return sum ? PyObject_SetAttr(obj, name, sum.get()) : -1;
}

// The host's wait for the counts of the dispatch numbered `sequence`: a spin of at most `kCountSpin`
// without the interpreter (other virtual ranks launch meanwhile), then `NvlinkRuntime.wait_counts`,
// which spins on, sleeps, and turns a fault or its deadline into the right error. 0 or -1 (raised).
int wait_for_counts(FrontObject* front, uint64_t sequence, PyObject* sequence_obj) {
    constexpr auto kCountSpin = std::chrono::milliseconds(2);
    auto started = std::chrono::steady_clock::now();
    bool arrived = false;
    PyThreadState* saved = PyEval_SaveThread();
    for (uint64_t num_polls = 1;; ++num_polls) {
        if (__atomic_load_n(front->counts_ready, __ATOMIC_ACQUIRE) == sequence) {
            arrived = true;
            break;
        }
        if (__atomic_load_n(&front->error_words[0], __ATOMIC_RELAXED) != 0) break;  // a fault: Python's to raise
        if (num_polls % 64 == 0 && std::chrono::steady_clock::now() - started > kCountSpin) break;
        sched_yield();
    }
    PyEval_RestoreThread(saved);
    auto spun_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started);
    if (add_to(front->runtime, names.counts_wait_ns, spun_ns.count()) < 0) return -1;
    if (arrived) return add_to(front->runtime, names.num_counts_waits, 1);
    Ref waited(
        PyObject_CallMethodObjArgs(front->runtime, names.wait_counts, front->comm_stream, sequence_obj, nullptr));
    return waited ? 0 : -1;
}

// The rest of a CPU-sync dispatch once its first program ran (`carried`: what that program
// allocated): the wait for the counts, the second program with the rows they give, the new handle.
// Returns `(values, handle)` (new reference) or null with the error set (`rejected`: the device
// rejected our routing, and the error is the one that says so).
PyObject* finish_synced(FrontObject* front, PyObject* entry, PyObject* inputs, PyObject* carried, uint64_t sequence,
                        PyObject* sequence_obj, bool* rejected) {
    Ref template_handle(PyObject_GetAttr(entry, names.handle));
    Ref experts(template_handle ? PyObject_GetAttr(template_handle.get(), names.num_experts) : nullptr);
    Ref alignment_obj(template_handle ? PyObject_GetAttr(template_handle.get(), names.expert_alignment) : nullptr);
    Ref expand_obj(template_handle ? PyObject_GetAttr(template_handle.get(), names.do_expand) : nullptr);
    if (!experts || !alignment_obj || !expand_obj) return nullptr;
    long long num_experts = PyLong_AsLongLong(experts.get()), alignment = PyLong_AsLongLong(alignment_obj.get());
    int do_expand = PyObject_IsTrue(expand_obj.get());
    if (PyErr_Occurred() || do_expand < 0) return nullptr;
    Py_ssize_t num_ranks = front->num_ranks, num_local_experts = static_cast<Py_ssize_t>(num_experts) / num_ranks;
    if (num_ranks + num_local_experts + 1 > front->num_count_words || alignment < 1) {
        PyErr_SetString(PyExc_RuntimeError, "deep_ep steady front: more counts than the count words hold");
        return nullptr;
    }
    if (wait_for_counts(front, sequence, sequence_obj) < 0) return nullptr;
    const int32_t* counts = front->counts;
    if (counts[num_ranks + num_local_experts] != 0) {
        // Our routing was rejected on the device (nothing sent), but peers sent us theirs: drained and
        // raised in Python (`SteadyPath.rejected`)
        *rejected = true;
        Ref raised(PyObject_CallMethodObjArgs(front->steady, names.rejected, entry, inputs, nullptr));
        if (raised) PyErr_SetString(PyExc_RuntimeError, "deep_ep steady front: a rejected routing was not raised");
        return nullptr;
    }
    long long num_recv_tokens = 0, num_expanded = 0;
    for (Py_ssize_t r = 0; r < num_ranks; ++r) num_recv_tokens += counts[r];
    Ref counts_list(PyList_New(num_local_experts));
    if (!counts_list) return nullptr;
    for (Py_ssize_t e = 0; e < num_local_experts; ++e) {
        long long count = (counts[num_ranks + e] + alignment - 1) / alignment * alignment;
        num_expanded += count;
        PyObject* item = PyLong_FromLongLong(count);
        if (item == nullptr) return nullptr;
        PyList_SET_ITEM(counts_list.get(), e, item);
    }
    long long num_out_rows = do_expand ? num_expanded : num_recv_tokens;
    Ref meta(PyLong_FromLongLong(num_recv_tokens)), out(PyLong_FromLongLong(num_out_rows));
    Ref expanded(PyLong_FromLongLong(num_expanded));
    if (!meta || !out || !expanded) return nullptr;
    Ref values(tuple_of({Py_NewRef(out.get()), Py_NewRef(meta.get()), epilogue_grid(front, entry, meta.get())}));
    Ref second_inputs(values ? PySequence_Concat(inputs, carried) : nullptr);
    Ref program(second_inputs ? PyObject_GetAttr(entry, names.program) : nullptr);
    if (!program) return nullptr;
    Ref outputs(run_program(program.get(), second_inputs.get(), Py_None, values.get()));
    if (!outputs) return nullptr;
    if (outputs.get() == Py_None) {
        PyErr_SetString(PyExc_RuntimeError,
                        "deep_ep steady path: the second part of a CPU-sync dispatch refused its inputs");
        return nullptr;
    }
    Ref handle(fresh_handle(front, entry, outputs.get()));
    if (!handle) return nullptr;
    Ref state(PyObject_GetAttr(handle.get(), names.backend_state));
    if (!state || PyObject_SetAttr(handle.get(), names.num_recv_tokens, meta.get()) < 0 ||
        PyObject_SetAttr(handle.get(), names.num_expanded_tokens, expanded.get()) < 0 ||
        PyObject_SetAttr(handle.get(), names.num_recv_tokens_per_expert_list, counts_list.get()) < 0 ||
        PyObject_SetAttr(state.get(), names.num_out_rows, out.get()) < 0 ||
        PyObject_SetAttr(state.get(), names.num_meta_rows, meta.get()) < 0 ||
        PyObject_SetAttr(state.get(), names.num_expanded_rows, expanded.get()) < 0)
        return nullptr;
    return PyTuple_Pack(2, outputs.get(), handle.get());
}

// A CPU-sync dispatch: the first program (up to the counts), then `finish_synced`. `(values, handle)`,
// `Py_None` when the first program refused the inputs (nothing was enqueued), or null.
PyObject* dispatch_synced(FrontObject* front, PyObject* entry, PyObject* first, PyObject* inputs, PyObject* event) {
    Ref sequence_obj(PyObject_CallMethodNoArgs(front->runtime, names.next_counts_sequence));
    Ref sequence_values(sequence_obj ? PyTuple_Pack(1, sequence_obj.get()) : nullptr);
    if (!sequence_values) return nullptr;
    uint64_t sequence = PyLong_AsUnsignedLongLong(sequence_obj.get());
    if (PyErr_Occurred()) return nullptr;
    Ref ran(run_program(first, inputs, event, sequence_values.get()));
    if (!ran || ran.get() == Py_None) return ran.release();
    // The first kernel is running: from here a failure leaves the window half-way through the
    // dispatch (`NvlinkRuntime.fail_between_launches`), except a rejected routing (`SteadyPath.rejected`
    // drained it, and marks the runtime itself when the drain fails)
    Ref carried(PyTuple_GetSlice(ran.get(), 0, PyTuple_GET_SIZE(ran.get()) - 1));
    bool rejected = false;
    PyObject* done =
        carried ? finish_synced(front, entry, inputs, carried.get(), sequence, sequence_obj.get(), &rejected) : nullptr;
    if (done != nullptr || rejected) return done;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != nullptr && value != nullptr) PyException_SetTraceback(value, traceback);
    if (value != nullptr) {
        Ref op(PyUnicode_FromString("dispatch"));
        Ref marked(
            op ? PyObject_CallMethodObjArgs(front->runtime, names.fail_between_launches, op.get(), value, nullptr)
               : nullptr);
        if (!marked) {  // the new error stands
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            return nullptr;
        }
    }
    PyErr_Restore(type, value, traceback);
    return nullptr;
}

// front.dispatch(<ElasticBuffer.dispatch's arguments, in order>) -> V2's results, or None when no
// program served the call (no key, no program, or a program that refused the inputs)
PyObject* front_dispatch(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    if (num_args != kNumDispatchArgs) {
        PyErr_Format(PyExc_TypeError, "Front.dispatch takes %d arguments, got %zd", kNumDispatchArgs, num_args);
        return nullptr;
    }
    Ref key(dispatch_key(front, args));
    if (!key) return nullptr;
    Ref entry(entry_of(front, key.get()));
    if (!entry) {
        if (PyErr_Occurred()) return nullptr;
        Py_RETURN_NONE;
    }
    PyObject* handle = args[kHandle];
    Ref inputs(dispatch_inputs(args[kX], args[kTopkIdx], args[kTopkWeights], args[kStats], handle));
    if (!inputs) return declined_on_missing_attribute();
    Ref event(previous_event_handle(args[kPreviousEvent]));
    if (!event || check_runtime(front) < 0) return nullptr;
    Ref first(PyObject_GetAttr(entry.get(), names.first));
    if (!first) return nullptr;
    if (first.get() != Py_None) {  // CPU sync: the host waits for the counts between two programs
        Ref done(dispatch_synced(front, entry.get(), first.get(), inputs.get(), event.get()));
        if (!done) return nullptr;
        if (done.get() == Py_None) {
            ++front->num_refused;
            Py_RETURN_NONE;
        }
        if (after_run(front) < 0) return nullptr;
        return dispatch_results(front, PyTuple_GET_ITEM(done.get(), 0), PyTuple_GET_ITEM(done.get(), 1));
    }
    Ref values(handle == Py_None ? PyTuple_New(0) : handle_values(front, handle, entry.get(), true));
    Ref program(PyObject_GetAttr(entry.get(), names.program));
    if (!values || !program) return nullptr;
    Ref outputs(run_program(program.get(), inputs.get(), event.get(), values.get()));
    if (!outputs) return nullptr;
    if (outputs.get() == Py_None) {
        ++front->num_refused;
        Py_RETURN_NONE;
    }
    Ref made;
    if (handle == Py_None) {  // a fresh dispatch
        made.obj = fresh_handle(front, entry.get(), outputs.get());
        Ref no_counts(made ? PyList_New(0) : nullptr);
        if (!no_counts || PyObject_SetAttr(made.get(), names.num_recv_tokens_per_expert_list, no_counts.get()) < 0)
            return nullptr;
        handle = made.get();
    }
    if (after_run(front) < 0) return nullptr;
    return dispatch_results(front, outputs.get(), handle);
}

// front.combine(<ElasticBuffer.combine's arguments, in order>) -> `(combined_x, combined_topk_weights,
// EventOverlap)`, or None as `dispatch`
PyObject* front_combine(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    if (num_args != kNumCombineArgs) {
        PyErr_Format(PyExc_TypeError, "Front.combine takes %d arguments, got %zd", kNumCombineArgs, num_args);
        return nullptr;
    }
    Ref key(combine_key(front, args));
    if (!key) return nullptr;
    Ref entry(entry_of(front, key.get()));
    if (!entry) {
        if (PyErr_Occurred()) return nullptr;
        Py_RETURN_NONE;
    }
    PyObject* handle = args[kCombineHandle];
    Ref inputs(combine_inputs(args[kCombineX], handle, args[kCombineTopkWeights], args[kBias]));
    if (!inputs) return declined_on_missing_attribute();
    Ref event(previous_event_handle(args[kCombinePreviousEvent]));
    Ref values(handle_values(front, handle, entry.get(), false));
    Ref program(PyObject_GetAttr(entry.get(), names.program));
    if (!event || !values || !program || check_runtime(front) < 0) return nullptr;
    Ref outputs(run_program(program.get(), inputs.get(), event.get(), values.get()));
    if (!outputs) return nullptr;
    if (outputs.get() == Py_None) {
        ++front->num_refused;
        Py_RETURN_NONE;
    }
    if (after_run(front) < 0) return nullptr;
    return tuple_of({Py_NewRef(PyTuple_GET_ITEM(outputs.get(), 0)), Py_NewRef(PyTuple_GET_ITEM(outputs.get(), 1)),
                     overlap_of(front, PyTuple_GET_ITEM(outputs.get(), 2))});
}

PyObject* front_dispatch_key(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != kNumDispatchArgs) {
        PyErr_Format(PyExc_TypeError, "Front.dispatch_key takes %d arguments, got %zd", kNumDispatchArgs, num_args);
        return nullptr;
    }
    return dispatch_key(reinterpret_cast<FrontObject*>(self), args);
}

PyObject* front_combine_key(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != kNumCombineArgs) {
        PyErr_Format(PyExc_TypeError, "Front.combine_key takes %d arguments, got %zd", kNumCombineArgs, num_args);
        return nullptr;
    }
    return combine_key(reinterpret_cast<FrontObject*>(self), args);
}

PyObject* front_dispatch_inputs(PyObject*, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != 5) {
        PyErr_SetString(PyExc_TypeError, "Front.dispatch_inputs(x, topk_idx, topk_weights, stats, handle)");
        return nullptr;
    }
    return dispatch_inputs(args[0], args[1], args[2], args[3], args[4]);
}

PyObject* front_combine_inputs(PyObject*, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != 4) {
        PyErr_SetString(PyExc_TypeError, "Front.combine_inputs(x, handle, topk_weights, bias)");
        return nullptr;
    }
    return combine_inputs(args[0], args[1], args[2], args[3]);
}

// Front(steady, entries, runtime, comm_stream, error_words, counts, counts_ready, num_count_words,
//       input_error_word, num_ranks, buffer_id, handle_type, event_handle_type, synced_shape, exact_shape,
//       handle_fields, state_fields, event_template, overlap_template); see SteadyPath.__init__
PyObject* front_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    static const char* keywords[] = {
        "steady",        "entries",      "runtime",           "comm_stream",      "error_words",
        "counts",        "counts_ready", "num_count_words",   "input_error_word", "num_ranks",
        "buffer_id",     "handle_type",  "event_handle_type", "synced_shape",     "exact_shape",
        "handle_fields", "state_fields", "event_template",    "overlap_template", nullptr};
    PyObject *steady, *entries, *runtime, *comm_stream, *words, *counts, *counts_ready, *buffer_id, *handle_type,
        *event_handle_type, *synced_shape, *exact_shape, *handle_fields, *state_fields, *event_template,
        *overlap_template;
    Py_ssize_t num_count_words, input_error_word, num_ranks;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!OOOOOnnnOOOOOO!O!OO", const_cast<char**>(keywords), &steady,
                                     &PyDict_Type, &entries, &runtime, &comm_stream, &words, &counts, &counts_ready,
                                     &num_count_words, &input_error_word, &num_ranks, &buffer_id, &handle_type,
                                     &event_handle_type, &synced_shape, &exact_shape, &PyTuple_Type, &handle_fields,
                                     &PyTuple_Type, &state_fields, &event_template, &overlap_template))
        return nullptr;
    void* addresses[3] = {PyLong_AsVoidPtr(words), PyLong_AsVoidPtr(counts), PyLong_AsVoidPtr(counts_ready)};
    if (PyErr_Occurred()) return nullptr;
    if (!addresses[0] || !addresses[1] || !addresses[2]) {
        PyErr_SetString(PyExc_ValueError, "Front: an address of host memory is 0");
        return nullptr;
    }
    if (!PyType_Check(handle_type) || !PyType_Check(event_handle_type) || input_error_word < 0 || num_ranks < 1 ||
        num_count_words < num_ranks + 2) {
        PyErr_SetString(PyExc_ValueError,
                        "Front: handle_type and event_handle_type must be types, "
                        "input_error_word >= 0, num_ranks >= 1, num_count_words >= num_ranks + 2");
        return nullptr;
    }
    auto* front = reinterpret_cast<FrontObject*>(type->tp_alloc(type, 0));
    if (front == nullptr) return nullptr;
    front->event_names = PyTuple_Pack(1, names.event);
    if (front->event_names == nullptr) {
        Py_DECREF(front);
        return nullptr;
    }
    front->steady = Py_NewRef(steady), front->entries = Py_NewRef(entries), front->runtime = Py_NewRef(runtime);
    front->comm_stream = Py_NewRef(comm_stream);
    front->error_words = static_cast<const int64_t*>(addresses[0]);
    front->counts = static_cast<const int32_t*>(addresses[1]);
    front->counts_ready = static_cast<const uint64_t*>(addresses[2]);
    front->num_count_words = num_count_words, front->input_error_word = input_error_word;
    front->num_ranks = num_ranks;
    front->buffer_id = Py_NewRef(buffer_id), front->handle_type = Py_NewRef(handle_type);
    front->event_handle_type = Py_NewRef(event_handle_type);
    front->synced_shape = Py_NewRef(synced_shape), front->exact_shape = Py_NewRef(exact_shape);
    front->handle_fields = Py_NewRef(handle_fields), front->state_fields = Py_NewRef(state_fields);
    front->event_template = Py_NewRef(event_template), front->overlap_template = Py_NewRef(overlap_template);
    return reinterpret_cast<PyObject*>(front);
}

int front_clear(PyObject* self) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    Py_CLEAR(front->steady);
    Py_CLEAR(front->entries);
    Py_CLEAR(front->runtime);
    Py_CLEAR(front->comm_stream);
    Py_CLEAR(front->buffer_id);
    Py_CLEAR(front->handle_type);
    Py_CLEAR(front->event_handle_type);
    Py_CLEAR(front->synced_shape);
    Py_CLEAR(front->exact_shape);
    Py_CLEAR(front->handle_fields);
    Py_CLEAR(front->state_fields);
    Py_CLEAR(front->event_template);
    Py_CLEAR(front->overlap_template);
    Py_CLEAR(front->event_names);
    return 0;
}

// The front holds the SteadyPath that holds it: the cycle is the collector's
int front_traverse(PyObject* self, visitproc visit, void* arg) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    Py_VISIT(front->steady);
    Py_VISIT(front->entries);
    Py_VISIT(front->runtime);
    Py_VISIT(front->comm_stream);
    Py_VISIT(front->buffer_id);
    Py_VISIT(front->handle_type);
    Py_VISIT(front->event_handle_type);
    Py_VISIT(front->synced_shape);
    Py_VISIT(front->exact_shape);
    Py_VISIT(front->handle_fields);
    Py_VISIT(front->state_fields);
    Py_VISIT(front->event_template);
    Py_VISIT(front->overlap_template);
    Py_VISIT(front->event_names);
    return 0;
}

void front_dealloc(PyObject* self) {
    PyObject_GC_UnTrack(self);
    front_clear(self);
    Py_TYPE(self)->tp_free(self);
}

PyObject* front_num_calls(PyObject* self, void*) {
    return PyLong_FromUnsignedLongLong(reinterpret_cast<FrontObject*>(self)->num_calls);
}

PyObject* front_num_refused(PyObject* self, void*) {
    return PyLong_FromUnsignedLongLong(reinterpret_cast<FrontObject*>(self)->num_refused);
}

template <PyObject* (*F)(PyObject*, PyObject* const*, Py_ssize_t)>
PyCFunction fastcall() {
    return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(F));
}

PyMethodDef front_methods[] = {
    {"dispatch", fastcall<front_dispatch>(), METH_FASTCALL, "dispatch(<ElasticBuffer.dispatch's arguments>)"},
    {"combine", fastcall<front_combine>(), METH_FASTCALL, "combine(<ElasticBuffer.combine's arguments>)"},
    {"dispatch_key", fastcall<front_dispatch_key>(), METH_FASTCALL, "the key of a dispatch, or None"},
    {"combine_key", fastcall<front_combine_key>(), METH_FASTCALL, "the key of a combine, or None"},
    {"dispatch_inputs", fastcall<front_dispatch_inputs>(), METH_FASTCALL, "a dispatch's program inputs"},
    {"combine_inputs", fastcall<front_combine_inputs>(), METH_FASTCALL, "a combine's program inputs"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef front_getset[] = {{"num_calls", front_num_calls, nullptr, "calls a program served", nullptr},
                              {"num_refused", front_num_refused, nullptr, "calls a program refused", nullptr},
                              {nullptr, nullptr, nullptr, nullptr, nullptr}};

bool add_front(PyObject* module) {
    if (!intern_names()) return false;
    FrontType.tp_name = "deep_ep_steady.Front";
    FrontType.tp_basicsize = sizeof(FrontObject);
    FrontType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    FrontType.tp_new = front_new;
    FrontType.tp_dealloc = front_dealloc;
    FrontType.tp_traverse = front_traverse;
    FrontType.tp_clear = front_clear;
    FrontType.tp_methods = front_methods;
    FrontType.tp_getset = front_getset;
    if (PyType_Ready(&FrontType) < 0) return false;
    Py_INCREF(&FrontType);
    return PyModule_AddObject(module, "Front", reinterpret_cast<PyObject*>(&FrontType)) == 0;
}

}  // namespace
