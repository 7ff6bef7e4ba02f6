// The steady path of dispatch and combine: a recorded launch sequence replayed in one call.
//
// The first call of an operation shape runs in Python (deep_ep.backends.kernels.steady records
// it); later calls of the same shape come here. A `Program` holds what the recording saw: the
// inputs' dtypes, sizes and strides, the allocations and the views returned, and each kernel
// launch with its parameter bytes and the offsets where the inputs' and allocations' addresses go.
// `Program.run` checks the inputs against it (any difference: `None`, and the caller takes the
// Python path, which validates and raises), then does V2's stream choreography, the allocations and
// the launches without a Python frame in between: a torch call from Python costs microseconds of
// interpreter each, which here are nanoseconds.
//
// Only libc10's device-generic interfaces are used (the CUDA guard implementation that torch
// registers at import), and the driver through dlopen, so that the same source builds against a
// CPU-only torch (CI compiles it there; its checks run without a GPU).
#include <Python.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda.h>
#include <dlfcn.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// ----------------------------------------------------------------------------------- the driver

// The name a driver entry point has in this cuda.h (which maps some to a versioned name, such as
// `cuGraphAddKernelNode` to `cuGraphAddKernelNode_v2`): the symbol whose signature the header declares
#define EP_DRIVER_SYMBOL(name) EP_DRIVER_STRING(name)
#define EP_DRIVER_STRING(name) #name

struct Driver {
    decltype(&cuLaunchKernelEx) launch = nullptr;
    decltype(&cuStreamWaitEvent) wait_event = nullptr;
    decltype(&cuEventRecord) record_event = nullptr;
    decltype(&cuStreamIsCapturing) is_capturing = nullptr;
    decltype(&cuStreamSynchronize) synchronize = nullptr;
    decltype(&cuGetErrorString) error_string = nullptr;
    std::string problem;
    // A program's launches as one graph (steady_graph.cpp); without them it launches kernel by kernel
    decltype(&cuGraphCreate) graph_create = nullptr;
    decltype(&cuGraphAddKernelNode) graph_add_kernel_node = nullptr;
    decltype(&cuGraphKernelNodeSetAttribute) graph_set_attribute = nullptr;
    decltype(&cuGraphAddDependencies) graph_add_dependencies = nullptr;
    decltype(&cuGraphInstantiate) graph_instantiate = nullptr;
    decltype(&cuGraphExecKernelNodeSetParams) graph_set_params = nullptr;
    decltype(&cuGraphLaunch) graph_launch = nullptr;
    decltype(&cuGraphUpload) graph_upload = nullptr;
    decltype(&cuGraphExecDestroy) graph_exec_destroy = nullptr;
    decltype(&cuGraphDestroy) graph_destroy = nullptr;
    std::string graph_problem;
};

const Driver& driver() {
    static const Driver loaded = [] {
        Driver d;
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
        if (lib == nullptr) {
            d.problem = d.graph_problem = "libcuda.so.1 cannot be loaded";
            return d;
        }
        auto load = [&](auto& entry, const char* name) {
            entry = reinterpret_cast<std::remove_reference_t<decltype(entry)>>(dlsym(lib, name));
            return entry != nullptr;
        };
        bool complete = load(d.launch, "cuLaunchKernelEx") & load(d.wait_event, "cuStreamWaitEvent") &
                        load(d.record_event, "cuEventRecord") & load(d.is_capturing, "cuStreamIsCapturing") &
                        load(d.error_string, "cuGetErrorString") & load(d.synchronize, "cuStreamSynchronize");
        if (!complete)
            d.problem =
                "libcuda.so.1 lacks cuLaunchKernelEx, cuStreamWaitEvent, cuEventRecord, cuStreamIsCapturing, "
                "cuGetErrorString or cuStreamSynchronize";
        bool graphs = load(d.graph_create, EP_DRIVER_SYMBOL(cuGraphCreate)) &
                      load(d.graph_add_kernel_node, EP_DRIVER_SYMBOL(cuGraphAddKernelNode)) &
                      load(d.graph_set_attribute, EP_DRIVER_SYMBOL(cuGraphKernelNodeSetAttribute)) &
                      load(d.graph_add_dependencies, EP_DRIVER_SYMBOL(cuGraphAddDependencies)) &
                      load(d.graph_instantiate, EP_DRIVER_SYMBOL(cuGraphInstantiate)) &
                      load(d.graph_set_params, EP_DRIVER_SYMBOL(cuGraphExecKernelNodeSetParams)) &
                      load(d.graph_launch, EP_DRIVER_SYMBOL(cuGraphLaunch)) &
                      load(d.graph_upload, EP_DRIVER_SYMBOL(cuGraphUpload)) &
                      load(d.graph_exec_destroy, EP_DRIVER_SYMBOL(cuGraphExecDestroy)) &
                      load(d.graph_destroy, EP_DRIVER_SYMBOL(cuGraphDestroy));
        if (!graphs) d.graph_problem = "libcuda.so.1 lacks a graph entry point (programmatic edges need CUDA 12.3)";
        return d;
    }();
    return loaded;
}

std::string driver_error(CUresult result, const char* what) {
    const char* text = nullptr;
    if (driver().error_string != nullptr) driver().error_string(result, &text);
    return std::string(what) + " failed: CUDA error " + std::to_string(static_cast<int>(result)) + " (" +
           (text ? text : "unknown") + ")";
}

// --------------------------------------------------------------------------------- the program

// The phases of a call, in order (steady.py's `PHASES` names them)
constexpr int kNumPhases = 6;
// A result that is `None` (`Program::results`)
constexpr int kNoResult = std::numeric_limits<int>::min();

struct InputSpec {
    bool present;  // false: the recording saw None, and None is expected
    at::ScalarType dtype;
    std::vector<int64_t> sizes, strides;
};

// Sizes and grid dimensions are constants (>= 0) or the call's values: `-1 - k` is `values[k]`
// (the row counts of a CPU-sync dispatch's outputs, known once the host read the counts)
struct AllocSpec {
    at::ScalarType dtype;
    std::vector<int64_t> sizes, strides;
    bool grouped;  // carved out of the call's one shared allocation (a handle's small tensors)
};

struct OutputSpec {
    int alloc;
    std::vector<int64_t> sizes, strides;
    int64_t storage_offset;
};

struct Patch {
    int param, offset, source;  // source >= 0: input `source`; < 0: allocation `-1 - source`
};

struct ValuePatch {
    int param, offset, width, value;  // `values[value]` as a little-endian integer of `width` bytes
};

struct Launch {
    CUfunction function;
    int64_t grid[3];
    unsigned block[3];
    bool cooperative, pdl;
    std::vector<std::vector<char>> params;
    std::vector<Patch> patches;
    std::vector<ValuePatch> value_patches;
};

struct ProgramGraph;

struct Program {
    c10::DeviceIndex device_index;
    c10::Stream comm_stream;
    bool async_with_compute_stream, allocate_on_comm_stream, record_inputs;
    CUstream comm_handle = nullptr;
    std::vector<InputSpec> inputs;
    std::vector<AllocSpec> allocs;
    std::vector<OutputSpec> outputs;
    std::vector<Launch> launches;
    // A call in two parts (a CPU-sync dispatch: the host reads counts between them): the first part
    // begins (waits for the compute stream), the second ends (its event, the compute stream's wait)
    bool begins = true, ends = true;
    size_t num_values = 0;
    // What `run` returns, in order: output `k >= 0`, input `-1 - k`, or none (`kNoResult`), so that
    // the caller gets its results without sorting them in Python
    std::vector<int> results;
    std::optional<c10::Event> compute_ready;  // the compute stream's point the comm stream waits for
    uint64_t num_runs = 0;
    std::array<uint64_t, kNumPhases> phase_ns{};
    // The launches as one CUDA graph (steady_graph.cpp), built by `build_graph` after the recording call
    bool use_graph = true;
    std::shared_ptr<ProgramGraph> graph;
    std::string graph_problem;  // why the launches go kernel by kernel (empty: they need not)
    uint64_t num_graph_launches = 0, num_graph_updates = 0;
};

struct ProgramObject {
    PyObject_HEAD Program* program;
};

struct EventObject {
    PyObject_HEAD c10::Event* event;
};

PyTypeObject EventType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject ProgramType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// End events whose Python object died, per device, to record again: creating and destroying a CUDA
// event costs the host about a microsecond per call. Nobody waits on a dead object's event, so recording it
// anew is safe even before its last record completed. Touched only with the GIL held.
constexpr size_t kMaxSpareEvents = 64;
std::vector<std::pair<c10::DeviceIndex, std::unique_ptr<c10::Event>>> spare_events;

std::unique_ptr<c10::Event> take_event(c10::DeviceIndex device_index) {
    for (auto it = spare_events.rbegin(); it != spare_events.rend(); ++it)
        if (it->first == device_index) {
            std::unique_ptr<c10::Event> event = std::move(it->second);
            spare_events.erase(std::next(it).base());
            return event;
        }
    return std::make_unique<c10::Event>(c10::DeviceType::CUDA);
}

void give_back_event(c10::Event* event) {
    // An event never recorded has no device yet: nothing to keep
    if (event->device_index() < 0 || spare_events.size() >= kMaxSpareEvents) {
        delete event;
        return;
    }
    spare_events.emplace_back(event->device_index(), std::unique_ptr<c10::Event>(event));
}

// ------------------------------------------------------------------------- description parsing

struct ParseError {
    std::string message;
};

long long as_long(PyObject* obj, const char* what) {
    long long value = PyLong_AsLongLong(obj);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        throw ParseError{std::string(what) + " must be an int"};
    }
    return value;
}

PyObject* item(PyObject* sequence, Py_ssize_t index, const char* what) {
    if (!PyTuple_Check(sequence)) throw ParseError{std::string(what) + " must be a tuple"};
    if (index >= PyTuple_GET_SIZE(sequence)) throw ParseError{std::string(what) + " is too short"};
    return PyTuple_GET_ITEM(sequence, index);
}

std::vector<int64_t> as_dims(PyObject* obj, const char* what) {
    if (!PyTuple_Check(obj)) throw ParseError{std::string(what) + " must be a tuple of ints"};
    std::vector<int64_t> dims;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); ++i) dims.push_back(as_long(PyTuple_GET_ITEM(obj, i), what));
    return dims;
}

at::ScalarType as_dtype(PyObject* obj, const char* what) {
    if (!THPDtype_Check(obj)) throw ParseError{std::string(what) + " must be a torch.dtype"};
    return reinterpret_cast<THPDtype*>(obj)->scalar_type;
}

std::vector<char> as_bytes(PyObject* obj, const char* what) {
    if (!PyBytes_Check(obj)) throw ParseError{std::string(what) + " must be bytes"};
    const char* data = PyBytes_AS_STRING(obj);
    return std::vector<char>(data, data + PyBytes_GET_SIZE(obj));
}

// (device_index, (stream_id, device_index, device_type, handle), async_with_compute_stream,
//  allocate_on_comm_stream, record_inputs, inputs, allocs, outputs, launches, begins, ends,
//  num_values, results); see steady.py's `describe_program` for the fields of each entry.
Program* parse_program(PyObject* d) {
    auto program = std::make_unique<Program>(
        Program{static_cast<c10::DeviceIndex>(as_long(item(d, 0, "description"), "device_index")),
                c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU)), false, false, true});
    PyObject* stream = item(d, 1, "description");
    program->comm_handle = static_cast<CUstream>(PyLong_AsVoidPtr(item(stream, 3, "comm stream")));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        throw ParseError{"comm stream handle must be an int"};
    }
    program->comm_stream =
        c10::Stream::unpack3(as_long(item(stream, 0, "comm stream"), "stream id"),
                             static_cast<c10::DeviceIndex>(as_long(item(stream, 1, "comm stream"), "index")),
                             static_cast<c10::DeviceType>(as_long(item(stream, 2, "comm stream"), "type")));
    program->async_with_compute_stream = PyObject_IsTrue(item(d, 2, "description"));
    program->allocate_on_comm_stream = PyObject_IsTrue(item(d, 3, "description"));
    program->record_inputs = PyObject_IsTrue(item(d, 4, "description"));
    PyObject* inputs = item(d, 5, "description");
    for (Py_ssize_t i = 0; i < PyTuple_Size(inputs); ++i) {
        PyObject* spec = item(inputs, i, "inputs");
        if (spec == Py_None) {
            program->inputs.push_back(InputSpec{false, at::ScalarType::Undefined, {}, {}});
            continue;
        }
        program->inputs.push_back(InputSpec{true, as_dtype(item(spec, 0, "input"), "input dtype"),
                                            as_dims(item(spec, 1, "input"), "input sizes"),
                                            as_dims(item(spec, 2, "input"), "input strides")});
    }
    PyObject* allocs = item(d, 6, "description");
    for (Py_ssize_t i = 0; i < PyTuple_Size(allocs); ++i) {
        PyObject* spec = item(allocs, i, "allocs");
        program->allocs.push_back(
            AllocSpec{as_dtype(item(spec, 0, "alloc"), "alloc dtype"), as_dims(item(spec, 1, "alloc"), "alloc sizes"),
                      as_dims(item(spec, 2, "alloc"), "alloc strides"), PyObject_IsTrue(item(spec, 3, "alloc")) == 1});
    }
    PyObject* outputs = item(d, 7, "description");
    for (Py_ssize_t i = 0; i < PyTuple_Size(outputs); ++i) {
        PyObject* spec = item(outputs, i, "outputs");
        int alloc = static_cast<int>(as_long(item(spec, 0, "output"), "output alloc"));
        if (alloc < 0 || alloc >= static_cast<int>(program->allocs.size()))
            throw ParseError{"output alloc out of range"};
        program->outputs.push_back(OutputSpec{alloc, as_dims(item(spec, 1, "output"), "output sizes"),
                                              as_dims(item(spec, 2, "output"), "output strides"),
                                              as_long(item(spec, 3, "output"), "output storage offset")});
    }
    PyObject* launches = item(d, 8, "description");
    for (Py_ssize_t i = 0; i < PyTuple_Size(launches); ++i) {
        PyObject* spec = item(launches, i, "launches");
        Launch launch{};
        launch.function = reinterpret_cast<CUfunction>(PyLong_AsVoidPtr(item(spec, 0, "launch")));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            throw ParseError{"launch function must be an int handle"};
        }
        auto grid = as_dims(item(spec, 1, "launch"), "grid"), block = as_dims(item(spec, 2, "launch"), "block");
        if (grid.size() != 3 || block.size() != 3) throw ParseError{"grid and block must have 3 dims"};
        for (int k = 0; k < 3; ++k) launch.grid[k] = grid[k], launch.block[k] = static_cast<unsigned>(block[k]);
        launch.cooperative = PyObject_IsTrue(item(spec, 3, "launch"));
        launch.pdl = PyObject_IsTrue(item(spec, 4, "launch"));
        PyObject* params = item(spec, 5, "launch");
        for (Py_ssize_t p = 0; p < PyTuple_Size(params); ++p)
            launch.params.push_back(as_bytes(item(params, p, "params"), "param"));
        PyObject* patches = item(spec, 6, "launch");
        for (Py_ssize_t p = 0; p < PyTuple_Size(patches); ++p) {
            PyObject* patch = item(patches, p, "patches");
            Patch parsed{static_cast<int>(as_long(item(patch, 0, "patch"), "patch param")),
                         static_cast<int>(as_long(item(patch, 1, "patch"), "patch offset")),
                         static_cast<int>(as_long(item(patch, 2, "patch"), "patch source"))};
            bool in_range = parsed.param >= 0 && parsed.param < static_cast<int>(launch.params.size()) &&
                            parsed.offset >= 0 &&
                            parsed.offset + 8 <= static_cast<int>(launch.params[parsed.param].size()) &&
                            parsed.source < static_cast<int>(program->inputs.size()) &&
                            -1 - parsed.source < static_cast<int>(program->allocs.size());
            if (!in_range) throw ParseError{"patch out of range"};
            launch.patches.push_back(parsed);
        }
        PyObject* value_patches = item(spec, 7, "launch");
        for (Py_ssize_t p = 0; p < PyTuple_Size(value_patches); ++p) {
            PyObject* patch = item(value_patches, p, "value patches");
            ValuePatch parsed{static_cast<int>(as_long(item(patch, 0, "value patch"), "value patch param")),
                              static_cast<int>(as_long(item(patch, 1, "value patch"), "value patch offset")),
                              static_cast<int>(as_long(item(patch, 2, "value patch"), "value patch width")),
                              static_cast<int>(as_long(item(patch, 3, "value patch"), "value patch value"))};
            bool in_range = parsed.param >= 0 && parsed.param < static_cast<int>(launch.params.size()) &&
                            (parsed.width == 4 || parsed.width == 8) && parsed.offset >= 0 &&
                            parsed.offset + parsed.width <= static_cast<int>(launch.params[parsed.param].size()) &&
                            parsed.value >= 0;
            if (!in_range) throw ParseError{"value patch out of range"};
            launch.value_patches.push_back(parsed);
        }
        program->launches.push_back(std::move(launch));
    }
    program->begins = PyObject_IsTrue(item(d, 9, "description"));
    program->ends = PyObject_IsTrue(item(d, 10, "description"));
    program->num_values = static_cast<size_t>(as_long(item(d, 11, "description"), "num_values"));
    PyObject* results = item(d, 12, "description");
    std::vector<bool> returned(program->outputs.size(), false);  // each output goes to one result (moved there)
    for (Py_ssize_t i = 0; i < PyTuple_Size(results); ++i) {
        PyObject* source = item(results, i, "results");
        if (source == Py_None) {
            program->results.push_back(kNoResult);
            continue;
        }
        long long k = as_long(source, "result source");
        bool in_range = k >= 0 ? k < static_cast<long long>(program->outputs.size())
                               : -1 - k < static_cast<long long>(program->inputs.size());
        if (!in_range) throw ParseError{"result source out of range"};
        if (k >= 0 && returned[k]) throw ParseError{"an output is two results"};
        if (k >= 0) returned[k] = true;
        program->results.push_back(static_cast<int>(k));
    }
    auto check_values = [&](const std::vector<int64_t>& dims) {
        for (int64_t dim : dims)
            if (dim < 0 && static_cast<size_t>(-1 - dim) >= program->num_values)
                throw ParseError{"a size names a value past num_values"};
    };
    for (const InputSpec& spec : program->inputs) check_values(spec.sizes);
    for (const AllocSpec& spec : program->allocs) check_values(spec.sizes);
    for (const OutputSpec& spec : program->outputs) check_values(spec.sizes);
    for (const Launch& launch : program->launches) {
        check_values(std::vector<int64_t>(launch.grid, launch.grid + 3));
        for (const ValuePatch& patch : launch.value_patches)
            if (static_cast<size_t>(patch.value) >= program->num_values)
                throw ParseError{"a value patch names a value past num_values"};
    }
    return program.release();
}

std::vector<int64_t> resolve(const std::vector<int64_t>& dims, const std::vector<int64_t>& values) {
    std::vector<int64_t> out(dims);
    for (int64_t& dim : out)
        if (dim < 0) dim = values[-1 - dim];
    return out;
}

// ---------------------------------------------------------------------------------- Program.run

// Whether `tensor` is what the recording saw at `spec` (on the program's device; a size that is a
// value must equal the call's).
bool matches(const at::Tensor& tensor, const InputSpec& spec, c10::DeviceIndex device_index,
             const std::vector<int64_t>& values) {
    if (tensor.scalar_type() != spec.dtype || !tensor.is_cuda() || tensor.get_device() != device_index ||
        tensor.dim() != static_cast<int64_t>(spec.sizes.size()) || !tensor.strides().equals(spec.strides) ||
        tensor.requires_grad())
        return false;
    for (size_t i = 0; i < spec.sizes.size(); ++i) {
        int64_t expected = spec.sizes[i] < 0 ? values[-1 - spec.sizes[i]] : spec.sizes[i];
        if (tensor.size(static_cast<int64_t>(i)) != expected) return false;
    }
    return true;
}

struct RunFailure {
    std::string message;
};

// Record `event` on `stream` (`handle`): through torch the first time, which creates the event on the
// stream's device and marks it recorded, then straight through the driver. The record is the same;
// torch's device switches around it cost the host about 0.3 us per event.
void record(c10::Event& event, const c10::Stream& stream, CUstream handle) {
    if (!event.was_marked_for_recording() || event.eventId() == nullptr ||
        event.device_index() != stream.device_index()) {
        event.record(stream);
        return;
    }
    CUresult result = driver().record_event(static_cast<CUevent>(event.eventId()), handle);
    if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuEventRecord")};
}

// Make `handle` wait for the last record of `event`
void wait_for(const c10::Event& event, CUstream handle) {
    CUresult result = driver().wait_event(handle, static_cast<CUevent>(event.eventId()), 0);
    if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuStreamWaitEvent")};
}

// Where a call's host time goes (`Program.phase_ns`): the time since the previous mark is added to a phase
template <size_t kCount>
struct PhaseClock {
    std::array<uint64_t, kCount>& totals;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();

    void mark(int phase) {
        auto now = std::chrono::steady_clock::now();
        totals[phase] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
        last = now;
    }
};

// A tensor of `dtype` over `storage` from `offset` bytes: made directly, not through the dispatcher
// (whose every call costs microseconds of host time here)
at::Tensor tensor_over(const c10::Storage& storage, at::ScalarType dtype, c10::IntArrayRef sizes,
                       c10::IntArrayRef strides, size_t offset) {
    at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::scalarTypeToTypeMeta(dtype));
    tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides,
                                                        static_cast<int64_t>(offset / c10::elementSize(dtype)));
    return tensor;
}

// The call's allocations, from torch's CUDA caching allocator on the current stream (as torch.empty
// would): each on its own, except the grouped ones, which share one (256-byte aligned each).
// `storages` gets each allocation made.
std::vector<at::Tensor> allocate(const Program& program, const std::vector<int64_t>& values,
                                 std::vector<c10::Storage>& storages) {
    constexpr size_t kAlignment = 256;
    c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CUDA);
    auto make_storage = [&](size_t bytes) {
        storages.emplace_back(c10::Storage::use_byte_size_t(), bytes, allocator->allocate(bytes), allocator, false);
        return storages.back();
    };
    std::vector<at::Tensor> allocs(program.allocs.size());
    std::vector<std::vector<int64_t>> sizes(program.allocs.size());
    std::vector<size_t> offsets(program.allocs.size(), 0);
    size_t group_bytes = 0;
    for (size_t i = 0; i < program.allocs.size(); ++i) {
        const AllocSpec& spec = program.allocs[i];
        sizes[i] = resolve(spec.sizes, values);
        size_t bytes = at::detail::computeStorageNbytes(sizes[i], spec.strides, c10::elementSize(spec.dtype));
        if (spec.grouped) {
            offsets[i] = group_bytes;
            group_bytes += (bytes + kAlignment - 1) / kAlignment * kAlignment;
        } else {
            allocs[i] = tensor_over(make_storage(bytes), spec.dtype, sizes[i], spec.strides, 0);
        }
    }
    if (group_bytes == 0) return allocs;
    c10::Storage group = make_storage(group_bytes);
    for (size_t i = 0; i < program.allocs.size(); ++i)
        if (program.allocs[i].grouped)
            allocs[i] = tensor_over(group, program.allocs[i].dtype, sizes[i], program.allocs[i].strides, offsets[i]);
    return allocs;
}

// The most parameters a recorded kernel has
constexpr size_t kMaxParams = 16;

// The program's launches, their parameters patched and `grids` resolved, as one graph launch on
// `stream` (steady_graph.cpp); false when they go kernel by kernel (the graph is off or was not built:
// `Program.build_graph`, and `Program::graph_problem` says why when it could not be)
bool launch_graph(Program& program, const std::vector<std::array<unsigned, 3>>& grids, CUstream stream);
PyObject* program_build_graph(PyObject* self, PyObject*);

// What `run` does without the GIL: returns the output tensors and the end event.
std::vector<at::Tensor> run_native(Program& program, const std::vector<const at::Tensor*>& inputs, void* previous_event,
                                   const std::vector<int64_t>& values, c10::Event* end_event,
                                   const c10::Stream& compute, CUstream compute_handle, PhaseClock<kNumPhases>& clock) {
    const Driver& d = driver();
    const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device device(c10::DeviceType::CUDA, program.device_index);
    c10::Stream comm = program.comm_stream;
    CUstream comm_handle = program.comm_handle;

    // The communication starts after the compute stream's work (or the given event), as V2's does
    if (program.begins && previous_event != nullptr) {
        CUresult result = d.wait_event(comm_handle, static_cast<CUevent>(previous_event), 0);
        if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuStreamWaitEvent")};
    } else if (program.begins) {
        if (!program.compute_ready) program.compute_ready.emplace(c10::DeviceType::CUDA);
        record(*program.compute_ready, compute, compute_handle);
        wait_for(*program.compute_ready, comm_handle);
    }
    clock.mark(1);

    // V2's rule: the outputs come from the caller's stream's pool, the communication stream's only
    // with `allocate_on_comm_stream`. A block of the caller's pool needs no `record_stream` in a
    // synchronous call (the caller's stream waits for the end event before any later use), and a
    // `record_stream` is what makes the caching allocator expensive: an event recorded when the block
    // is freed, queried at every later allocation until it completes
    c10::Device previous_device = impl->exchangeDevice(device);
    c10::Stream previous = program.allocate_on_comm_stream ? impl->exchangeStream(comm) : compute;
    std::vector<at::Tensor> allocs;
    std::vector<c10::Storage> storages;  // what the caching allocator handed out
    auto restore = [&] {
        if (program.allocate_on_comm_stream) impl->exchangeStream(previous);
        impl->exchangeDevice(previous_device);
    };
    try {
        allocs = allocate(program, values, storages);
    } catch (...) {
        restore();
        throw;
    }
    restore();
    clock.mark(2);

    std::vector<std::array<unsigned, 3>> grids(program.launches.size());
    for (size_t i = 0; i < program.launches.size(); ++i) {
        Launch& launch = program.launches[i];
        for (const Patch& patch : launch.patches) {
            const at::Tensor* source = patch.source >= 0 ? inputs[patch.source] : &allocs[-1 - patch.source];
            uint64_t address = source == nullptr ? 0 : reinterpret_cast<uint64_t>(source->data_ptr());
            std::memcpy(launch.params[patch.param].data() + patch.offset, &address, sizeof(address));
        }
        for (const ValuePatch& patch : launch.value_patches) {
            int64_t value = values[patch.value];  // little-endian: the low `width` bytes
            std::memcpy(launch.params[patch.param].data() + patch.offset, &value, patch.width);
        }
        if (launch.params.size() > kMaxParams) throw RunFailure{"a kernel with more than 16 parameters"};
        for (int k = 0; k < 3; ++k)
            grids[i][k] = static_cast<unsigned>(launch.grid[k] >= 0 ? launch.grid[k] : values[-1 - launch.grid[k]]);
    }
    if (!launch_graph(program, grids, comm_handle))
        for (size_t i = 0; i < program.launches.size(); ++i) {
            Launch& launch = program.launches[i];
            void* params[kMaxParams];
            for (size_t p = 0; p < launch.params.size(); ++p) params[p] = launch.params[p].data();
            CUlaunchAttribute attributes[2];
            unsigned num_attributes = 0;
            if (launch.cooperative) {
                attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
                attributes[num_attributes++].value.cooperative = 1;
            }
            if (launch.pdl) {
                attributes[num_attributes].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attributes[num_attributes++].value.programmaticStreamSerializationAllowed = 1;
            }
            CUlaunchConfig config{};
            config.gridDimX = grids[i][0], config.gridDimY = grids[i][1], config.gridDimZ = grids[i][2];
            config.blockDimX = launch.block[0], config.blockDimY = launch.block[1], config.blockDimZ = launch.block[2];
            config.hStream = comm_handle;
            config.attrs = attributes;
            config.numAttrs = num_attributes;
            CUresult result = d.launch(&config, launch.function, params, nullptr);
            if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuLaunchKernelEx")};
        }

    clock.mark(3);

    // V2's epilogue of the stream choreography. An asynchronous call's allocations are recorded on
    // both streams (the allocator ignores the one it allocated on), each part its own; the end event,
    // the compute stream's wait and the inputs' records come with the last part
    bool async = program.async_with_compute_stream;
    if (async)
        for (const c10::Storage& storage : storages) {
            impl->recordDataPtrOnStream(storage.data_ptr(), compute);
            impl->recordDataPtrOnStream(storage.data_ptr(), comm);
        }
    if (end_event != nullptr) {
        record(*end_event, comm, comm_handle);
        if (async && program.record_inputs)
            for (const at::Tensor* t : inputs)
                if (t != nullptr) impl->recordDataPtrOnStream(t->storage().data_ptr(), comm);
        if (!async) wait_for(*end_event, compute_handle);
    }
    clock.mark(4);

    std::vector<at::Tensor> outputs;
    outputs.reserve(program.outputs.size());
    for (const OutputSpec& spec : program.outputs) {
        const at::Tensor& alloc = allocs[spec.alloc];
        auto output_sizes = resolve(spec.sizes, values);
        if (spec.storage_offset == 0 && alloc.sizes().equals(output_sizes) && alloc.strides().equals(spec.strides))
            outputs.push_back(alloc);  // the allocation itself: no view to make
        else
            outputs.push_back(tensor_over(alloc.storage(), alloc.scalar_type(), output_sizes, spec.strides,
                                          (alloc.storage_offset() + spec.storage_offset) * alloc.element_size()));
    }
    return outputs;
}

// run(inputs: tuple of tensors or None, previous_event: int (a CUevent) or None, values: tuple of ints)
//   -> (results..., Event or None) (`Program::results`), or None when an input differs from the recording or the
//   compute stream is being captured (the caller takes the Python path)
PyObject* program_run(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    Program& program = *reinterpret_cast<ProgramObject*>(self)->program;
    PhaseClock<kNumPhases> clock{program.phase_ns};
    if (num_args != 3 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "Program.run(inputs: tuple, previous_event: int | None, values: tuple)");
        return nullptr;
    }
    PyObject* given = args[0];
    if (PyTuple_GET_SIZE(given) != static_cast<Py_ssize_t>(program.inputs.size()) ||
        PyTuple_GET_SIZE(args[2]) != static_cast<Py_ssize_t>(program.num_values)) {
        PyErr_Format(PyExc_TypeError, "Program.run: expected %zu inputs and %zu values, got %zd and %zd",
                     program.inputs.size(), program.num_values, PyTuple_GET_SIZE(given), PyTuple_GET_SIZE(args[2]));
        return nullptr;
    }
    std::vector<int64_t> values(program.num_values);
    for (size_t i = 0; i < program.num_values; ++i) {
        values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[2], i));
        if (values[i] == -1 && PyErr_Occurred()) return nullptr;
        if (values[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "Program.run: values must be >= 0");
            return nullptr;
        }
    }
    std::vector<const at::Tensor*> inputs(program.inputs.size(), nullptr);
    for (size_t i = 0; i < program.inputs.size(); ++i) {
        PyObject* obj = PyTuple_GET_ITEM(given, i);
        const InputSpec& spec = program.inputs[i];
        if (obj == Py_None) {
            if (spec.present) Py_RETURN_NONE;
            continue;
        }
        if (!spec.present || !THPVariable_Check(obj)) Py_RETURN_NONE;
        const at::Tensor& tensor = THPVariable_Unpack(obj);
        if (!matches(tensor, spec, program.device_index, values)) Py_RETURN_NONE;
        inputs[i] = &tensor;
    }
    void* previous_event = nullptr;
    if (args[1] != Py_None) {
        previous_event = PyLong_AsVoidPtr(args[1]);
        if (previous_event == nullptr && PyErr_Occurred()) return nullptr;
    }
    const Driver& d = driver();
    if (!d.problem.empty()) {
        PyErr_SetString(PyExc_RuntimeError, d.problem.c_str());
        return nullptr;
    }
    clock.mark(0);

    std::vector<at::Tensor> outputs;
    std::string failure;
    bool declined = false;  // a capture, or a stream torch cannot name
    std::unique_ptr<c10::Event> end_event;
    if (program.ends) end_event = take_event(program.device_index);
    PyThreadState* saved = PyEval_SaveThread();  // the launches may block: other virtual ranks go on
    try {
        // A capture takes the Python path, whose every step is capture-safe (the events above are
        // reused across calls, which a graph would freeze)
        const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
        c10::Stream current = impl->getStream(c10::Device(c10::DeviceType::CUDA, program.device_index));
        CUstream compute = nullptr;
        bool named = true;
        try {
            compute = static_cast<CUstream>(current.native_handle());
        } catch (const std::exception&) {
            named = false;  // a torch that cannot name its stream: the Python path serves every call
        }
        CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
        if (named) {
            CUresult result = d.is_capturing(compute, &status);
            if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuStreamIsCapturing")};
        }
        declined = !named || status != CU_STREAM_CAPTURE_STATUS_NONE;
        if (!declined)
            outputs = run_native(program, inputs, previous_event, values, end_event.get(), current, compute, clock);
    } catch (const RunFailure& error) {
        failure = error.message;
    } catch (const std::exception& error) {
        failure = error.what();
    }
    PyEval_RestoreThread(saved);
    if (declined) Py_RETURN_NONE;
    if (!failure.empty()) {
        PyErr_SetString(PyExc_RuntimeError, ("deep_ep steady path: " + failure).c_str());
        return nullptr;
    }
    ++program.num_runs;
    const size_t num_results = program.results.size();
    PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(num_results) + 1);
    if (result == nullptr) return nullptr;
    for (size_t i = 0; i < num_results; ++i) {
        int source = program.results[i];
        PyObject* item = nullptr;
        if (source >= 0) {
            item = THPVariable_Wrap(std::move(outputs[source]));
            if (item == nullptr) {
                Py_DECREF(result);
                return nullptr;
            }
        } else {
            item = source == kNoResult ? Py_None : PyTuple_GET_ITEM(given, -1 - source);
            Py_INCREF(item);
        }
        PyTuple_SET_ITEM(result, i, item);
    }
    PyObject* event = Py_None;
    if (end_event) {
        auto* wrapped = PyObject_New(EventObject, &EventType);
        if (wrapped == nullptr) {
            Py_DECREF(result);
            return nullptr;
        }
        wrapped->event = end_event.release();
        event = reinterpret_cast<PyObject*>(wrapped);
    } else {
        Py_INCREF(Py_None);
    }
    PyTuple_SET_ITEM(result, num_results, event);
    clock.mark(5);
    return result;
}

PyObject* program_num_runs(PyObject* self, void*) {
    return PyLong_FromUnsignedLongLong(reinterpret_cast<ProgramObject*>(self)->program->num_runs);
}

PyObject* program_phase_ns(PyObject* self, void*) {
    const auto& totals = reinterpret_cast<ProgramObject*>(self)->program->phase_ns;
    PyObject* out = PyTuple_New(kNumPhases);
    if (out == nullptr) return nullptr;
    for (int i = 0; i < kNumPhases; ++i) PyTuple_SET_ITEM(out, i, PyLong_FromUnsignedLongLong(totals[i]));
    return out;
}

PyObject* program_new(PyTypeObject* type, PyObject* args, PyObject*) {
    PyObject* description = nullptr;
    if (!PyArg_ParseTuple(args, "O", &description)) return nullptr;
    Program* program = nullptr;
    try {
        program = parse_program(description);
    } catch (const ParseError& error) {
        PyErr_SetString(PyExc_ValueError, ("deep_ep steady program: " + error.message).c_str());
        return nullptr;
    } catch (const std::exception& error) {
        PyErr_SetString(PyExc_ValueError, ("deep_ep steady program: " + std::string(error.what())).c_str());
        return nullptr;
    }
    auto* self = reinterpret_cast<ProgramObject*>(type->tp_alloc(type, 0));
    if (self == nullptr) {
        delete program;
        return nullptr;
    }
    self->program = program;
    return reinterpret_cast<PyObject*>(self);
}

void program_dealloc(PyObject* self) {
    delete reinterpret_cast<ProgramObject*>(self)->program;
    Py_TYPE(self)->tp_free(self);
}

// ------------------------------------------------------------------------------------- Event

// The end of a steady call, with the part of `torch.cuda.Event`'s interface that deep_ep.event uses
c10::Stream stream_of(PyObject* stream, c10::DeviceIndex device_index) {
    if (stream == nullptr || stream == Py_None)
        return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
            ->getStream(c10::Device(c10::DeviceType::CUDA, device_index));
    PyObject* id = PyObject_GetAttrString(stream, "stream_id");
    PyObject* index = PyObject_GetAttrString(stream, "device_index");
    PyObject* type = PyObject_GetAttrString(stream, "device_type");
    long long values[3] = {0, 0, 0};
    PyObject* objs[3] = {id, index, type};
    bool ok = true;
    for (int i = 0; i < 3; ++i) {
        if (objs[i] == nullptr || ((values[i] = PyLong_AsLongLong(objs[i])) == -1 && PyErr_Occurred())) ok = false;
        Py_XDECREF(objs[i]);
    }
    if (!ok) throw ParseError{"stream must be a torch.cuda.Stream"};
    return c10::Stream::unpack3(values[0], static_cast<c10::DeviceIndex>(values[1]),
                                static_cast<c10::DeviceType>(values[2]));
}

PyObject* event_wait(PyObject* self, PyObject* const* args, Py_ssize_t num_args) {
    c10::Event& event = *reinterpret_cast<EventObject*>(self)->event;
    try {
        event.block(stream_of(num_args > 0 ? args[0] : nullptr, event.device_index()));
    } catch (const ParseError& error) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, error.message.c_str());
        return nullptr;
    } catch (const std::exception& error) {
        PyErr_SetString(PyExc_RuntimeError, error.what());
        return nullptr;
    }
    Py_RETURN_NONE;
}

PyObject* event_query(PyObject* self, PyObject*) {
    bool done = false;
    try {
        done = reinterpret_cast<EventObject*>(self)->event->query();
    } catch (const std::exception& error) {
        PyErr_SetString(PyExc_RuntimeError, error.what());
        return nullptr;
    }
    return PyBool_FromLong(done);
}

// `work()` with the GIL released (other virtual ranks go on meanwhile); false, with a RuntimeError
// set, when it threw
template <typename Work>
bool without_gil(Work&& work) {
    std::optional<std::string> failure;
    PyThreadState* saved = PyEval_SaveThread();
    try {
        work();
    } catch (const RunFailure& error) {
        failure = error.message;
    } catch (const std::exception& error) {
        failure = error.what();
    }
    PyEval_RestoreThread(saved);
    if (failure) PyErr_SetString(PyExc_RuntimeError, failure->c_str());
    return !failure;
}

PyObject* event_synchronize(PyObject* self, PyObject*) {
    c10::Event* event = reinterpret_cast<EventObject*>(self)->event;
    if (!without_gil([&] { event->synchronize(); })) return nullptr;
    Py_RETURN_NONE;
}

PyObject* event_cuda_event(PyObject* self, void*) {
    return PyLong_FromVoidPtr(reinterpret_cast<EventObject*>(self)->event->eventId());
}

void event_dealloc(PyObject* self) {
    give_back_event(reinterpret_cast<EventObject*>(self)->event);
    PyObject_Free(self);
}

PyMethodDef event_methods[] = {
    {"wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(event_wait)), METH_FASTCALL,
     "wait(stream=None): make `stream` (default: the current one) wait for the event"},
    {"query", event_query, METH_NOARGS, "whether the work before the event has completed"},
    {"synchronize", event_synchronize, METH_NOARGS, "block the host until the event has completed"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef event_getset[] = {{"cuda_event", event_cuda_event, nullptr, "the CUevent handle", nullptr},
                              {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef program_methods[] = {{"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(program_run)),
                                  METH_FASTCALL, "run(inputs, previous_event, values) -> (results..., Event) or None"},
                                 {"build_graph", program_build_graph, METH_NOARGS, "make the launches' graph now"},
                                 {nullptr, nullptr, 0, nullptr}};

PyObject* program_use_graph(PyObject* self, void*) {
    return PyBool_FromLong(reinterpret_cast<ProgramObject*>(self)->program->use_graph);
}

int program_set_use_graph(PyObject* self, PyObject* value, void*) {
    int on = value == nullptr ? -1 : PyObject_IsTrue(value);
    if (on < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Program.use_graph cannot be deleted");
        return -1;
    }
    reinterpret_cast<ProgramObject*>(self)->program->use_graph = on == 1;
    return 0;
}

PyObject* program_graph_counts(PyObject* self, void*) {
    const Program& program = *reinterpret_cast<ProgramObject*>(self)->program;
    return Py_BuildValue("(KK)", static_cast<unsigned long long>(program.num_graph_launches),
                         static_cast<unsigned long long>(program.num_graph_updates));
}

PyObject* program_graph_problem(PyObject* self, void*) {
    const std::string& problem = reinterpret_cast<ProgramObject*>(self)->program->graph_problem;
    if (problem.empty()) Py_RETURN_NONE;
    return PyUnicode_FromString(problem.c_str());
}

PyGetSetDef program_getset[] = {
    {"num_runs", program_num_runs, nullptr, "calls served", nullptr},
    {"phase_ns", program_phase_ns, nullptr, "host nanoseconds per phase, summed", nullptr},
    {"use_graph", program_use_graph, program_set_use_graph, "launch as one CUDA graph when it can", nullptr},
    {"graph_counts", program_graph_counts, nullptr, "(graph launches, nodes whose parameters were set again)", nullptr},
    {"graph_problem", program_graph_problem, nullptr, "why the launches go kernel by kernel, or None", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

// ---------------------------------------------------------------------------------- copy_with

// copy_with(template, names: tuple of str, values: tuple, start: int) -> `object.__new__(type(template))`
// whose `__dict__` is a copy of the template's with `names[i]` set to `values[start + i]`: the objects
// a replay returns (a handle, its backend state, the event wrappers) are copies of templates, and
// making one from Python costs the host microseconds of interpreter per call
PyObject* copy_with(PyObject*, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != 4 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "copy_with(template, names: tuple, values: tuple, start: int)");
        return nullptr;
    }
    PyObject *names = args[1], *values = args[2];
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return nullptr;
    Py_ssize_t num_names = PyTuple_GET_SIZE(names);
    if (start < 0 || start + num_names > PyTuple_GET_SIZE(values)) {
        PyErr_SetString(PyExc_ValueError, "copy_with: values has fewer than start + len(names) items");
        return nullptr;
    }
    PyObject* template_dict = PyObject_GenericGetDict(args[0], nullptr);
    if (template_dict == nullptr) return nullptr;
    PyObject* fields = PyDict_Copy(template_dict);
    Py_DECREF(template_dict);
    if (fields == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < num_names; ++i) {
        PyObject* name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(name)) PyErr_SetString(PyExc_TypeError, "copy_with: names must be strings");
        if (PyErr_Occurred() || PyDict_SetItem(fields, name, PyTuple_GET_ITEM(values, start + i)) < 0) {
            Py_DECREF(fields);
            return nullptr;
        }
    }
    static PyObject* no_args = PyTuple_New(0);
    PyObject* copy = no_args == nullptr ? nullptr : PyBaseObject_Type.tp_new(Py_TYPE(args[0]), no_args, nullptr);
    if (copy == nullptr || PyObject_GenericSetDict(copy, fields, nullptr) < 0) {
        Py_XDECREF(copy);
        Py_DECREF(fields);
        return nullptr;
    }
    Py_DECREF(fields);
    return copy;
}

PyMethodDef module_methods[] = {
    {"copy_with", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(copy_with)), METH_FASTCALL,
     "copy_with(template, names, values, start) -> a copy of template with names set to values[start:]"},
    {nullptr, nullptr, 0, nullptr}};

// The front (steady_front.cpp) and the host floor (steady_floor.cpp), compiled after this file as one unit
bool add_front(PyObject* module);
bool add_floor(PyObject* module);

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "deep_ep_steady", "deep_ep's steady path (steady.cpp)", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_deep_ep_steady() {
    EventType.tp_name = "deep_ep_steady.Event";
    EventType.tp_basicsize = sizeof(EventObject);
    EventType.tp_flags = Py_TPFLAGS_DEFAULT;
    EventType.tp_dealloc = event_dealloc;
    EventType.tp_methods = event_methods;
    EventType.tp_getset = event_getset;
    ProgramType.tp_name = "deep_ep_steady.Program";
    ProgramType.tp_basicsize = sizeof(ProgramObject);
    ProgramType.tp_flags = Py_TPFLAGS_DEFAULT;
    ProgramType.tp_new = program_new;
    ProgramType.tp_dealloc = program_dealloc;
    ProgramType.tp_methods = program_methods;
    ProgramType.tp_getset = program_getset;
    if (PyType_Ready(&EventType) < 0 || PyType_Ready(&ProgramType) < 0) return nullptr;
    PyObject* module = PyModule_Create(&module_def);
    if (module == nullptr) return nullptr;
    Py_INCREF(&EventType);
    Py_INCREF(&ProgramType);
    if (PyModule_AddObject(module, "Event", reinterpret_cast<PyObject*>(&EventType)) < 0 ||
        PyModule_AddObject(module, "Program", reinterpret_cast<PyObject*>(&ProgramType)) < 0 || !add_front(module) ||
        !add_floor(module)) {
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
