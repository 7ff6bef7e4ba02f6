// The steady path's front: `ElasticBuffer.dispatch` and `.combine` hand their arguments here first.
//
// Compiled as one unit with steady.cpp and steady_calls.cpp (steady.py joins the sources; the calls
// themselves and the `Front` type are in steady_calls.cpp). A replayed call made
// a dozen Python calls around `Program.run` (its key, its inputs, the run, the handle and event
// objects); on the GPU machine's CPU, with caches cold from waiting on the device, those cost 10-14 us
// per call (bench/NOTES.md, session 25). Here they are C API calls: the key, the lookup in the steady
// path's `entries`, the inputs, the run and the results. What is rare stays in Python and is called
// from here: the runtime's checks when their error words are set, a count wait that outlasts a short
// spin (`NvlinkRuntime.wait_counts`), a routing the device rejected, the epilogue grid of a CPU-sync
// call's rows.
//
// The keys are the only ones the steady path has (the Python path records under `Front.dispatch_key`'s
// and `Front.combine_key`'s), so a recording and its replays cannot disagree about them. A key is made
// from the call's fingerprint (dtypes, sizes, scalars, a handle's shape), and the last call of each
// operation is remembered by its fingerprint: the next call like it skips the key and its lookup.
#include <algorithm>
#include <initializer_list>

namespace {

// Attribute names, interned once
struct Names {
    PyObject *buffer_id, *do_cpu_sync, *do_expand, *num_recv_tokens, *num_expanded_tokens, *num_experts, *topk_idx,
        *backend_state, *slot_idx, *num_tokens_per_rank, *num_unaligned_recv_tokens_per_expert, *recv_src_metadata,
        *psum_num_recv_tokens_per_scaleup_rank, *event, *cuda_event, *program, *handle, *state, *first, *epilogue_terms,
        *steady_shape, *dead_reason, *num_experts_checked, *check_error, *take_input_error,
        *num_recv_tokens_per_expert_list, *dispatch, *combine, *next_counts_sequence, *wait_counts, *num_counts_waits,
        *counts_wait_ns, *fail_between_launches, *rejected, *expert_alignment, *num_out_rows, *num_meta_rows,
        *num_expanded_rows;
    PyObject* zero;
};
Names names;

bool intern_names() {
    struct Entry {
        PyObject** slot;
        const char* text;
    };
    const Entry all[] = {{&names.buffer_id, "buffer_id"},
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
                         {&names.epilogue_terms, "epilogue_terms"},
                         {&names.steady_shape, "_steady_shape"},
                         {&names.dead_reason, "dead_reason"},
                         {&names.num_experts_checked, "num_experts_checked"},
                         {&names.check_error, "check_error"},
                         {&names.take_input_error, "take_input_error"},
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
    return names.zero != nullptr;
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

// What a call's key is made of, read without making Python objects: words (the data's dtypes and
// sizes, which arguments are `None`) and objects (a handle's shape, the scalars; held only while the
// call runs, or by a memo). The key is made from it (`key_of`), so equal fingerprints make equal keys.
struct Fingerprint {
    static constexpr int kMaxWords = 24, kMaxObjects = 13, kMaxDims = 8;
    std::array<int64_t, kMaxWords> words;
    std::array<PyObject*, kMaxObjects> objects;
    int num_words = 0, num_objects = 0;

    void add(int64_t word) { words[num_words++] = word; }
    void add_object(PyObject* obj) { objects[num_objects++] = obj; }
    // A tensor's dtype and sizes from `first_dim` on: false for what is no tensor, has too many
    // dimensions, or symbolic sizes (the Python path takes those)
    bool add_tensor(PyObject* obj, int64_t first_dim) {
        if (!THPVariable_Check(obj)) return false;
        const at::Tensor& tensor = THPVariable_Unpack(obj);
        if (tensor.dim() > kMaxDims || tensor.dim() < first_dim ||
            tensor.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
            return false;
        add(static_cast<int64_t>(tensor.scalar_type()));
        add(tensor.dim() - first_dim);
        for (int64_t d = first_dim; d < tensor.dim(); ++d) add(tensor.size(d));
        return true;
    }
};

// Equal as the keys compare them: the same type and equal (`num_experts=256.0` or `do_expand=1` must
// not meet the recording of 256 and True). An error in the comparison counts as unequal.
bool same_value(PyObject* a, PyObject* b) {
    if (a == b) return true;
    if (Py_TYPE(a) != Py_TYPE(b)) return false;
    int equal = PyObject_RichCompareBool(a, b, Py_EQ);
    if (equal < 0) PyErr_Clear();
    return equal == 1;
}

bool same_fingerprint(const Fingerprint& a, const Fingerprint& b) {
    if (a.num_words != b.num_words || a.num_objects != b.num_objects ||
        std::memcmp(a.words.data(), b.words.data(), sizeof(int64_t) * a.num_words) != 0)
        return false;
    for (int i = 0; i < a.num_objects; ++i)
        if (!same_value(a.objects[i], b.objects[i])) return false;
    return true;
}

// The key of `op` (an interned name) with fingerprint `f`: `(op, words, objects..., their types...)`
PyObject* key_of(PyObject* op, const Fingerprint& f) {
    PyObject* key = PyTuple_New(2 + 2 * f.num_objects);
    if (key == nullptr) return nullptr;
    PyObject* words = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(f.words.data()),
                                                static_cast<Py_ssize_t>(sizeof(int64_t) * f.num_words));
    if (words == nullptr) {
        Py_DECREF(key);
        return nullptr;
    }
    PyTuple_SET_ITEM(key, 0, Py_NewRef(op));
    PyTuple_SET_ITEM(key, 1, words);
    for (int i = 0; i < f.num_objects; ++i) {
        PyTuple_SET_ITEM(key, 2 + i, Py_NewRef(f.objects[i]));
        PyTuple_SET_ITEM(key, 2 + f.num_objects + i, Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(f.objects[i]))));
    }
    return key;
}

// The last call's fingerprint of an operation and its entry: a call with the same fingerprint skips
// making the key, hashing it and the lookup (a microsecond or two of the host's time per call).
// Dropped whenever the steady path's entries change (`Front.entries_changed`); it owns its objects.
struct Memo {
    bool valid = false;
    Fingerprint fingerprint;
    PyObject* entry = nullptr;
};

void forget(Memo& memo) {
    if (memo.valid)
        for (int i = 0; i < memo.fingerprint.num_objects; ++i) Py_DECREF(memo.fingerprint.objects[i]);
    memo.valid = false;
    Py_CLEAR(memo.entry);
}

// Where a replayed call's host time goes in the front (`Front.phase_ns`; steady.py's `FRONT_PHASES`):
// its key and entry, its inputs and values (with a CPU-sync dispatch's between the programs), the
// programs' runs, a CPU-sync dispatch's wait for its counts, the results
enum FrontPhase { kKeyPhase, kInputsPhase, kProgramsPhase, kCountWaitPhase, kResultsPhase, kNumFrontPhases };
using FrontClock = PhaseClock<kNumFrontPhases>;

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
    Memo dispatch_memo, combine_memo;
    std::array<uint64_t, kNumFrontPhases> phase_ns;  // `Front.phase_ns`
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

// What the keys take of an EPHandle (new reference): `(buffer_id, do_cpu_sync, shape)`, the shape being
// the fields steady.py's `_SHAPE_FIELDS` names (a CPU-sync handle's without its row counts), read by its
// attrgetters. Read on first sight and kept in the handle as `_steady_shape` (a template's when it is
// recorded, so that the handles a replay makes from it have theirs): a handle is the record of its
// dispatch, never changed after it is made, and ten attribute reads cost the host a microsecond.
PyObject* handle_summary(FrontObject* front, PyObject* handle) {
    Ref kept(PyObject_GetAttr(handle, names.steady_shape));
    if (!kept) return nullptr;
    if (PyTuple_CheckExact(kept.get()) && PyTuple_GET_SIZE(kept.get()) == 3) return kept.release();
    Ref buffer_id(PyObject_GetAttr(handle, names.buffer_id));
    Ref synced(buffer_id ? PyObject_GetAttr(handle, names.do_cpu_sync) : nullptr);
    int do_cpu_sync = synced ? PyObject_IsTrue(synced.get()) : -1;
    if (do_cpu_sync < 0) return nullptr;
    Ref summary(tuple_of({buffer_id.release(), bool_of(do_cpu_sync),
                          PyObject_CallOneArg(do_cpu_sync ? front->synced_shape : front->exact_shape, handle)}));
    if (!summary || PyObject_SetAttr(handle, names.steady_shape, summary.get()) < 0) return nullptr;
    return summary.release();
}

// The shape of `handle` (`handle_summary`'s, new reference) when it is an EPHandle of this buffer, and
// whether it has CPU-sync rows; `Py_None` (new reference) for anything else, null on an error
PyObject* handle_shape(FrontObject* front, PyObject* handle, int* do_cpu_sync) {
    if (Py_TYPE(handle) != reinterpret_cast<PyTypeObject*>(front->handle_type)) return Py_NewRef(Py_None);
    Ref summary(handle_summary(front, handle));
    if (!summary) return nullptr;
    int own = PyObject_RichCompareBool(PyTuple_GET_ITEM(summary.get(), 0), front->buffer_id, Py_EQ);
    if (own <= 0) return own < 0 ? nullptr : Py_NewRef(Py_None);
    *do_cpu_sync = PyTuple_GET_ITEM(summary.get(), 1) == Py_True;
    return Py_NewRef(PyTuple_GET_ITEM(summary.get(), 2));
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

// The fingerprint of a dispatch into `f` (`shape` owns the handle's shape it holds): 1, 0 when the
// call takes the Python path anyway, -1 on an error
int dispatch_fingerprint(FrontObject* front, PyObject* const* a, Fingerprint& f, Ref& shape) {
    if (!plain_events(front, a[kPreviousEvent], a[kPreviousEventBeforeEpilogue])) return 0;
    PyObject* handle = a[kHandle];
    if (handle == Py_None) {
        // With CPU sync (`None` means True without a handle) the scales' column stride would follow the
        // counts: column-major scales stay on the Python path there
        if (a[kDoCpuSync] != Py_False && a[kColMajorScales] != Py_False) return 0;
        shape.obj = Py_NewRef(Py_None);
    } else {
        int do_cpu_sync = 0;
        shape.obj = handle_shape(front, handle, &do_cpu_sync);
        if (!shape) return -1;
        if (shape.get() == Py_None || a[kStats] != Py_None) return 0;
        // With CPU sync the handle's rows change with every dispatch: they are the call's values, and the
        // scales' column stride would follow them
        if (do_cpu_sync && a[kColMajorScales] != Py_False) return 0;
    }
    PyObject* x = a[kX];
    if (PyTuple_CheckExact(x)) {
        f.add(2);
        if (PyTuple_GET_SIZE(x) != 2 || !f.add_tensor(PyTuple_GET_ITEM(x, 0), 0) ||
            !f.add_tensor(PyTuple_GET_ITEM(x, 1), 0))
            return 0;
    } else {
        f.add(1);
        if (!f.add_tensor(x, 0)) return 0;
    }
    f.add((a[kTopkIdx] == Py_None) | (a[kTopkWeights] == Py_None) << 1 | (a[kStats] == Py_None) << 2 |
          (a[kPreviousEvent] == Py_None) << 3);
    f.add_object(shape.get());
    for (int arg : {kNumExperts, kNumMaxTokensPerRank, kExpertAlignment, kNumSms, kNumQps, kAsync,
                    kAllocateOnCommStream, kDoHandleCopy, kDoCpuSync, kDoExpand, kDoZeroPadding, kColMajorScales})
        f.add_object(a[arg]);
    return 1;
}

// The fingerprint of a combine, as `dispatch_fingerprint`
int combine_fingerprint(FrontObject* front, PyObject* const* a, Fingerprint& f, Ref& shape) {
    if (!plain_events(front, a[kCombinePreviousEvent], a[kCombinePreviousEventBeforeEpilogue])) return 0;
    PyObject *handle = a[kCombineHandle], *bias = a[kBias];
    int do_cpu_sync = 0;
    shape.obj = handle_shape(front, handle, &do_cpu_sync);
    if (!shape) return -1;
    if (shape.get() == Py_None || (PyTuple_CheckExact(bias) && PyTuple_GET_SIZE(bias) != 2)) return 0;
    if (!f.add_tensor(a[kCombineX], do_cpu_sync ? 1 : 0)) return 0;  // a CPU-sync handle's rows are values
    f.add((a[kCombineTopkWeights] == Py_None) | (a[kCombinePreviousEvent] == Py_None) << 1);
    f.add_object(shape.get());
    f.add_object(reinterpret_cast<PyObject*>(Py_TYPE(bias)));
    for (int arg : {kCombineNumSms, kCombineNumQps, kCombineAsync, kCombineAllocateOnCommStream}) f.add_object(a[arg]);
    return 1;
}

// The entry of a call of `op` with fingerprint `f` when it has a program (new reference), else null
// (with an error set, or none: the Python path takes the call)
PyObject* entry_of(FrontObject* front, Memo& memo, PyObject* op, const Fingerprint& f) {
    if (memo.valid && same_fingerprint(memo.fingerprint, f)) return Py_NewRef(memo.entry);
    Ref key(key_of(op, f));
    if (!key) return nullptr;
    PyObject* entry = PyDict_GetItemWithError(front->entries, key.get());
    if (entry == nullptr || entry == Py_None) return nullptr;
    forget(memo);
    memo.fingerprint = f;
    for (int i = 0; i < f.num_objects; ++i) Py_INCREF(f.objects[i]);
    memo.entry = Py_NewRef(entry);
    memo.valid = true;
    return Py_NewRef(entry);
}

// The key of a dispatch (new reference), `Py_None` (new reference) when it takes the Python path
// anyway, or null on an error
PyObject* dispatch_key(FrontObject* front, PyObject* const* a) {
    Fingerprint f;
    Ref shape;
    int made = dispatch_fingerprint(front, a, f, shape);
    return made <= 0 ? (made < 0 ? nullptr : Py_NewRef(Py_None)) : key_of(names.dispatch, f);
}

// The key of a combine, as `dispatch_key`
PyObject* combine_key(FrontObject* front, PyObject* const* a) {
    Fingerprint f;
    Ref shape;
    int made = combine_fingerprint(front, a, f, shape);
    return made <= 0 ? (made < 0 ? nullptr : Py_NewRef(Py_None)) : key_of(names.combine, f);
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

// The dispatch epilogue's grid over `num_meta_rows` received tokens, as dispatch.py launches it
// (`NvlinkRuntime.grid_for_rows` and the NIC's CTAs), from the entry's `epilogue_terms`:
// `max(1, min(most, ceil(num_meta_rows / rows_per_cta))) + added`
PyObject* epilogue_grid(PyObject* entry, PyObject* num_meta_rows) {
    Ref terms(PyObject_GetAttr(entry, names.epilogue_terms));
    if (!terms) return nullptr;
    if (!PyTuple_CheckExact(terms.get()) || PyTuple_GET_SIZE(terms.get()) != 3) {
        PyErr_SetString(PyExc_TypeError, "deep_ep steady front: an entry's epilogue_terms is not 3 ints");
        return nullptr;
    }
    long long most = PyLong_AsLongLong(PyTuple_GET_ITEM(terms.get(), 0));
    long long rows_per_cta = PyLong_AsLongLong(PyTuple_GET_ITEM(terms.get(), 1));
    long long added = PyLong_AsLongLong(PyTuple_GET_ITEM(terms.get(), 2));
    long long rows = PyLong_AsLongLong(num_meta_rows);
    if (PyErr_Occurred()) return nullptr;
    if (rows_per_cta < 1 || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "deep_ep steady front: an epilogue of negative rows or empty CTAs");
        return nullptr;
    }
    return PyLong_FromLongLong(std::max(1LL, std::min(most, (rows + rows_per_cta - 1) / rows_per_cta)) + added);
}

// A CPU-sync handle's row counts and its epilogue's grid (`(num_out_rows, num_meta_rows, grid)`), or ()
PyObject* handle_values(PyObject* handle, PyObject* entry, bool with_grid) {
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
    PyObject* grid = epilogue_grid(entry, meta.get());
    return tuple_of({out.release(), meta.release(), grid});
}

// After inputs could not be gathered: `None` for a handle that lacks a field (one made by hand: the
// Python path's checks say what is wrong with it, and the buffer stays usable), else the error
PyObject* declined_on_missing_attribute() {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
    PyErr_Clear();
    Py_RETURN_NONE;
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

}  // namespace
