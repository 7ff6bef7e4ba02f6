// The steady path's front, its second part: a replayed dispatch and combine from their arguments to
// V2's results (a CPU-sync dispatch's wait for its counts between its two programs included), and the
// `Front` type Python sees. The first part (steady_front.cpp) makes the keys and the pieces used here.
#include <sched.h>

namespace {

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
                        PyObject* sequence_obj, bool* rejected, FrontClock& clock) {
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
    clock.mark(kInputsPhase);
    if (wait_for_counts(front, sequence, sequence_obj) < 0) return nullptr;
    clock.mark(kCountWaitPhase);
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
    Ref values(tuple_of({Py_NewRef(out.get()), Py_NewRef(meta.get()), epilogue_grid(entry, meta.get())}));
    Ref second_inputs(values ? PySequence_Concat(inputs, carried) : nullptr);
    Ref program(second_inputs ? PyObject_GetAttr(entry, names.program) : nullptr);
    if (!program) return nullptr;
    clock.mark(kInputsPhase);
    Ref outputs(run_program(program.get(), second_inputs.get(), Py_None, values.get()));
    clock.mark(kProgramsPhase);
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
PyObject* dispatch_synced(FrontObject* front, PyObject* entry, PyObject* first, PyObject* inputs, PyObject* event,
                          FrontClock& clock) {
    Ref sequence_obj(PyObject_CallMethodNoArgs(front->runtime, names.next_counts_sequence));
    Ref sequence_values(sequence_obj ? PyTuple_Pack(1, sequence_obj.get()) : nullptr);
    if (!sequence_values) return nullptr;
    uint64_t sequence = PyLong_AsUnsignedLongLong(sequence_obj.get());
    if (PyErr_Occurred()) return nullptr;
    clock.mark(kInputsPhase);
    Ref ran(run_program(first, inputs, event, sequence_values.get()));
    clock.mark(kProgramsPhase);
    if (!ran || ran.get() == Py_None) return ran.release();
    // The first kernel is running: from here a failure leaves the window half-way through the
    // dispatch (`NvlinkRuntime.fail_between_launches`), except a rejected routing (`SteadyPath.rejected`
    // drained it, and marks the runtime itself when the drain fails)
    Ref carried(PyTuple_GetSlice(ran.get(), 0, PyTuple_GET_SIZE(ran.get()) - 1));
    bool rejected = false;
    PyObject* done =
        carried ? finish_synced(front, entry, inputs, carried.get(), sequence, sequence_obj.get(), &rejected, clock)
                : nullptr;
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

// How a call of `Front.<name>` starts: its argument count, its fingerprint, and the entry its key has
// (`entry_of`). 1 with `entry` set, 0 when the Python path takes the call, -1 on an error.
template <int (*kFingerprint)(FrontObject*, PyObject* const*, Fingerprint&, Ref&)>
int find_entry(FrontObject* front, PyObject* const* args, Py_ssize_t num_args, Py_ssize_t expected, const char* name,
               Memo& memo, PyObject* op, Ref& entry) {
    if (num_args != expected) {
        PyErr_Format(PyExc_TypeError, "Front.%s takes %zd arguments, got %zd", name, expected, num_args);
        return -1;
    }
    Fingerprint fingerprint;
    Ref shape;
    int made = kFingerprint(front, args, fingerprint, shape);
    if (made <= 0) return made;
    entry.obj = entry_of(front, memo, op, fingerprint);
    return entry ? 1 : (PyErr_Occurred() ? -1 : 0);
}

// The entry's program run on a call's inputs (the front's phases marked): its results, `Py_None` when it
// refused them (counted: the Python path takes the call), or null
PyObject* replay(FrontObject* front, PyObject* entry, PyObject* inputs, PyObject* event, PyObject* values,
                 FrontClock& clock) {
    Ref program(PyObject_GetAttr(entry, names.program));
    if (!program) return nullptr;
    clock.mark(kInputsPhase);
    PyObject* outputs = run_program(program.get(), inputs, event, values);
    clock.mark(kProgramsPhase);
    if (outputs == Py_None) ++front->num_refused;
    return outputs;
}

// front.dispatch(<ElasticBuffer.dispatch's arguments, in order>) -> V2's results, or None when no
// program served the call (no key, no program, or a program that refused the inputs)
PyObject* front_dispatch(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    FrontClock clock{front->phase_ns};
    Ref entry;
    int found = find_entry<dispatch_fingerprint>(front, args, num_args, kNumDispatchArgs, "dispatch",
                                                 front->dispatch_memo, names.dispatch, entry);
    if (found <= 0) return found < 0 ? nullptr : Py_NewRef(Py_None);
    clock.mark(kKeyPhase);
    PyObject* handle = args[kHandle];
    Ref inputs(dispatch_inputs(args[kX], args[kTopkIdx], args[kTopkWeights], args[kStats], handle));
    if (!inputs) return declined_on_missing_attribute();
    Ref event(previous_event_handle(args[kPreviousEvent]));
    if (!event || check_runtime(front) < 0) return nullptr;
    Ref first(PyObject_GetAttr(entry.get(), names.first));
    if (!first) return nullptr;
    if (first.get() != Py_None) {  // CPU sync: the host waits for the counts between two programs
        Ref done(dispatch_synced(front, entry.get(), first.get(), inputs.get(), event.get(), clock));
        if (!done) return nullptr;
        if (done.get() == Py_None) {
            ++front->num_refused;
            Py_RETURN_NONE;
        }
        if (after_run(front) < 0) return nullptr;
        PyObject* results = dispatch_results(front, PyTuple_GET_ITEM(done.get(), 0), PyTuple_GET_ITEM(done.get(), 1));
        clock.mark(kResultsPhase);
        return results;
    }
    Ref values(handle == Py_None ? PyTuple_New(0) : handle_values(handle, entry.get(), true));
    if (!values) return nullptr;
    Ref outputs(replay(front, entry.get(), inputs.get(), event.get(), values.get(), clock));
    if (!outputs || outputs.get() == Py_None) return outputs.release();
    Ref made_handle;
    if (handle == Py_None) {  // a fresh dispatch
        made_handle.obj = fresh_handle(front, entry.get(), outputs.get());
        Ref no_counts(made_handle ? PyList_New(0) : nullptr);
        if (!no_counts ||
            PyObject_SetAttr(made_handle.get(), names.num_recv_tokens_per_expert_list, no_counts.get()) < 0)
            return nullptr;
        handle = made_handle.get();
    }
    if (after_run(front) < 0) return nullptr;
    PyObject* results = dispatch_results(front, outputs.get(), handle);
    clock.mark(kResultsPhase);
    return results;
}

// front.combine(<ElasticBuffer.combine's arguments, in order>) -> `(combined_x, combined_topk_weights,
// EventOverlap)`, or None as `dispatch`
PyObject* front_combine(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    FrontClock clock{front->phase_ns};
    Ref entry;
    int found = find_entry<combine_fingerprint>(front, args, num_args, kNumCombineArgs, "combine", front->combine_memo,
                                                names.combine, entry);
    if (found <= 0) return found < 0 ? nullptr : Py_NewRef(Py_None);
    clock.mark(kKeyPhase);
    PyObject* handle = args[kCombineHandle];
    Ref inputs(combine_inputs(args[kCombineX], handle, args[kCombineTopkWeights], args[kBias]));
    if (!inputs) return declined_on_missing_attribute();
    Ref event(previous_event_handle(args[kCombinePreviousEvent]));
    Ref values(handle_values(handle, entry.get(), false));
    if (!event || !values || check_runtime(front) < 0) return nullptr;
    Ref outputs(replay(front, entry.get(), inputs.get(), event.get(), values.get(), clock));
    if (!outputs || outputs.get() == Py_None) return outputs.release();
    if (after_run(front) < 0) return nullptr;
    PyObject* results =
        tuple_of({Py_NewRef(PyTuple_GET_ITEM(outputs.get(), 0)), Py_NewRef(PyTuple_GET_ITEM(outputs.get(), 1)),
                  overlap_of(front, PyTuple_GET_ITEM(outputs.get(), 2))});
    clock.mark(kResultsPhase);
    return results;
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
    new (&front->dispatch_memo) Memo();
    new (&front->combine_memo) Memo();
    front->phase_ns.fill(0);
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
    forget(front->dispatch_memo);
    forget(front->combine_memo);
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
    Py_VISIT(front->dispatch_memo.entry);
    Py_VISIT(front->combine_memo.entry);
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

PyObject* front_phase_ns(PyObject* self, void*) {
    const auto& totals = reinterpret_cast<FrontObject*>(self)->phase_ns;
    PyObject* out = PyTuple_New(kNumFrontPhases);
    if (out == nullptr) return nullptr;
    for (int i = 0; i < kNumFrontPhases; ++i) {
        PyObject* item = PyLong_FromUnsignedLongLong(totals[i]);
        if (item == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

// front.entries_changed(): what SteadyPath calls after every change of its entries (the memos go)
PyObject* front_entries_changed(PyObject* self, PyObject*) {
    auto* front = reinterpret_cast<FrontObject*>(self);
    forget(front->dispatch_memo);
    forget(front->combine_memo);
    Py_RETURN_NONE;
}

// front.handle_summary(handle): what the keys take of an EPHandle, kept in it (`handle_summary`)
PyObject* front_handle_summary(PyObject* self, PyObject* handle) {
    return handle_summary(reinterpret_cast<FrontObject*>(self), handle);
}

PyObject* front_epilogue_grid(PyObject*, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != 2) {
        PyErr_SetString(PyExc_TypeError, "Front.epilogue_grid(entry, num_meta_rows)");
        return nullptr;
    }
    return epilogue_grid(args[0], args[1]);
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
    {"entries_changed", front_entries_changed, METH_NOARGS, "forget the last calls' entries"},
    {"handle_summary", front_handle_summary, METH_O, "(buffer_id, do_cpu_sync, shape) of a handle, kept in it"},
    {"epilogue_grid", fastcall<front_epilogue_grid>(), METH_FASTCALL, "a dispatch epilogue's grid (an entry's)"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef front_getset[] = {{"num_calls", front_num_calls, nullptr, "calls a program served", nullptr},
                              {"num_refused", front_num_refused, nullptr, "calls a program refused", nullptr},
                              {"phase_ns", front_phase_ns, nullptr, "host ns per FRONT_PHASES", nullptr},
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
