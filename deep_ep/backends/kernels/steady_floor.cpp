// The host floor (deep_ep.bench.host_floor): what this machine charges for one kernel launch and one
// allocation, timed the way a replay pays them (steady.cpp's driver launch, torch's caching allocator),
// so that the host bench can put each call's cost next to the floor measured in the same run. The
// machine's floor moves between runs; a call's cost is read against it, not against a fixed figure.

namespace {

// host_floor(function: int, stream: int, num_samples: int, num_bytes: int) -> (launch_ns, alloc_ns):
// nanoseconds of each of `num_samples` launches of `function` (an empty kernel, one parameter) on
// the drained `stream`, and of each of `num_samples` allocations of `num_bytes` on the current device
PyObject* host_floor(PyObject*, PyObject* const* args, Py_ssize_t num_args) {
    if (num_args != 4) {
        PyErr_SetString(PyExc_TypeError, "host_floor(function, stream, num_samples, num_bytes)");
        return nullptr;
    }
    auto function = reinterpret_cast<CUfunction>(PyLong_AsVoidPtr(args[0]));
    auto stream = reinterpret_cast<CUstream>(PyLong_AsVoidPtr(args[1]));
    Py_ssize_t num_samples = PyLong_AsSsize_t(args[2]), num_bytes = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return nullptr;
    if (function == nullptr || num_samples <= 0 || num_bytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "host_floor: function must be loaded, num_samples and num_bytes positive");
        return nullptr;
    }
    const Driver& d = driver();
    if (!d.problem.empty()) {
        PyErr_SetString(PyExc_RuntimeError, d.problem.c_str());
        return nullptr;
    }
    std::vector<int64_t> launch_ns, alloc_ns;
    bool timed = without_gil([&] {
        int64_t unused = 0;
        void* params[1] = {&unused};
        CUlaunchConfig config{};
        config.gridDimX = config.gridDimY = config.gridDimZ = 1;
        config.blockDimX = 32, config.blockDimY = config.blockDimZ = 1;
        config.hStream = stream;
        c10::Allocator* allocator = c10::GetAllocator(c10::DeviceType::CUDA);
        for (Py_ssize_t i = 0; i < num_samples; ++i) {
            // Drained first: a call of the host bench starts on an idle stream too
            CUresult result = d.synchronize(stream);
            if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuStreamSynchronize")};
            auto started = std::chrono::steady_clock::now();
            result = d.launch(&config, function, params, nullptr);
            auto launched = std::chrono::steady_clock::now();
            if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuLaunchKernelEx")};
            c10::DataPtr block = allocator->allocate(static_cast<size_t>(num_bytes));
            auto allocated = std::chrono::steady_clock::now();
            launch_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(launched - started).count());
            alloc_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(allocated - launched).count());
        }  // each block goes back to the allocator's cache before the next: the next allocation reuses it
        CUresult result = d.synchronize(stream);
        if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, "cuStreamSynchronize")};
    });
    if (!timed) return nullptr;
    PyObject* launches = PyList_New(num_samples);
    PyObject* allocations = launches == nullptr ? nullptr : PyList_New(num_samples);
    for (Py_ssize_t i = 0; allocations != nullptr && i < num_samples; ++i) {
        PyList_SET_ITEM(launches, i, PyLong_FromLongLong(launch_ns[i]));
        PyList_SET_ITEM(allocations, i, PyLong_FromLongLong(alloc_ns[i]));
    }
    if (allocations == nullptr || PyErr_Occurred()) {
        Py_XDECREF(launches);
        Py_XDECREF(allocations);
        return nullptr;
    }
    return Py_BuildValue("(NN)", launches, allocations);
}

PyMethodDef floor_methods[] = {
    {"host_floor", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(host_floor)), METH_FASTCALL,
     "host_floor(function, stream, num_samples, num_bytes) -> (launch ns list, allocation ns list)"},
    {nullptr, nullptr, 0, nullptr}};

bool add_floor(PyObject* module) {
    return PyModule_AddFunctions(module, floor_methods) == 0;
}

}  // namespace
