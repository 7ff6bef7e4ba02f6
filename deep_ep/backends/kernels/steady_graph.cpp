// The steady path's launches as one CUDA graph per program. On the GPU machine a kernel launch costs
// the host 3-6 us and a replay has two (the communication kernel, then its epilogue), while a graph
// launch of both costs about 1 us when their parameters are the ones the graph already holds (the
// caching allocator hands a loop the same blocks call after call) and about one launch when they are
// not (a node's parameters set again: ~0.5 us, then the launch uploads them). The graph keeps the
// launches' semantics: a cooperative kernel is a cooperative node, an epilogue launched with PDL is
// a programmatic edge from the kernel before it, and the graph as a whole runs after the stream's
// earlier work, as the first launch did. A program whose first launch overlaps that earlier work
// (PDL) has no graph: that overlap is not an edge a graph can have.
// Compiled after steady.cpp as one unit (steady.py's SOURCES); Program.build_graph is steady.cpp's method.

namespace {

struct ProgramGraph {
    CUgraph graph = nullptr;
    CUgraphExec exec = nullptr;
    std::vector<CUgraphNode> nodes;  // one per launch, in order
    // What each node of `exec` holds now: a node whose launch differs is set again before the launch
    std::vector<std::vector<std::vector<char>>> params;
    std::vector<std::array<unsigned, 3>> grids;

    ~ProgramGraph() {
        // A launched exec may still run: the driver frees it once it completes
        if (exec != nullptr) driver().graph_exec_destroy(exec);
        if (graph != nullptr) driver().graph_destroy(graph);
    }
};

void check_graph_call(CUresult result, const char* what) {
    if (result != CUDA_SUCCESS) throw RunFailure{driver_error(result, what)};
}

// A node's description of `launch` on `grid`; `params` gets the parameters' addresses (which the
// driver copies the values from)
CUDA_KERNEL_NODE_PARAMS node_params(Launch& launch, const std::array<unsigned, 3>& grid, void** params) {
    for (size_t p = 0; p < launch.params.size(); ++p) params[p] = launch.params[p].data();
    CUDA_KERNEL_NODE_PARAMS node{};
    node.func = launch.function;
    node.gridDimX = grid[0], node.gridDimY = grid[1], node.gridDimZ = grid[2];
    node.blockDimX = launch.block[0], node.blockDimY = launch.block[1], node.blockDimZ = launch.block[2];
    node.kernelParams = params;
    return node;
}

std::shared_ptr<ProgramGraph> build_graph(Program& program, const std::vector<std::array<unsigned, 3>>& grids) {
    const Driver& d = driver();
    auto built = std::make_shared<ProgramGraph>();
    check_graph_call(d.graph_create(&built->graph, 0), "cuGraphCreate");
    for (size_t i = 0; i < program.launches.size(); ++i) {
        Launch& launch = program.launches[i];
        void* params[kMaxParams];
        CUDA_KERNEL_NODE_PARAMS description = node_params(launch, grids[i], params);
        CUgraphNode node = nullptr;
        check_graph_call(d.graph_add_kernel_node(&node, built->graph, nullptr, 0, &description),
                         "cuGraphAddKernelNode");
        if (launch.cooperative) {
            CUlaunchAttributeValue cooperative{};
            cooperative.cooperative = 1;
            check_graph_call(d.graph_set_attribute(node, CU_LAUNCH_ATTRIBUTE_COOPERATIVE, &cooperative),
                             "cuGraphKernelNodeSetAttribute");
        }
        if (i > 0) {
            CUgraphEdgeData edge{};  // zeros: the node starts once the previous one completed
            if (launch.pdl) {        // as a PDL launch: at the previous kernel's trigger or exit
                edge.type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
                edge.from_port = CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC;
            }
            check_graph_call(d.graph_add_dependencies(built->graph, &built->nodes.back(), &node, &edge, 1),
                             "cuGraphAddDependencies");
        }
        built->nodes.push_back(node);
        built->params.push_back(launch.params);
        built->grids.push_back(grids[i]);
    }
    check_graph_call(d.graph_instantiate(&built->exec, built->graph, 0), "cuGraphInstantiate");
    return built;
}

bool launch_graph(Program& program, const std::vector<std::array<unsigned, 3>>& grids, CUstream stream) {
    if (!program.use_graph || !program.graph) return false;
    const Driver& d = driver();
    ProgramGraph& graph = *program.graph;
    for (size_t i = 0; i < program.launches.size(); ++i) {
        Launch& launch = program.launches[i];
        if (graph.params[i] == launch.params && graph.grids[i] == grids[i]) continue;
        void* params[kMaxParams];
        CUDA_KERNEL_NODE_PARAMS description = node_params(launch, grids[i], params);
        CUresult result = d.graph_set_params(graph.exec, graph.nodes[i], &description);
        if (result != CUDA_SUCCESS) {  // nothing enqueued yet: this call and the later ones go one by one
            program.graph_problem = driver_error(result, "cuGraphExecKernelNodeSetParams");
            program.graph.reset();
            return false;
        }
        graph.params[i] = launch.params;
        graph.grids[i] = grids[i];
        ++program.num_graph_updates;
    }
    check_graph_call(d.graph_launch(graph.exec, stream), "cuGraphLaunch");
    ++program.num_graph_launches;
    return true;
}

// program.build_graph(): make the program's graph now, with the recorded parameters (a grid that is a
// call's value: 1 until a run sets it). Never inside a run: instantiating and uploading a graph may
// wait for the kernels on the device, which with virtual ranks can be peers waiting for this rank's
// next launch; so the steady path builds right after the recording call launched its kernels, and
// without the GIL, which the peers' threads may need to launch theirs. A program that cannot have a
// graph keeps launching kernel by kernel (`graph_problem` says why).
PyObject* program_build_graph(PyObject* self, PyObject*) {
    Program& program = *reinterpret_cast<ProgramObject*>(self)->program;
    if (program.graph || !program.graph_problem.empty()) Py_RETURN_NONE;
    const Driver& d = driver();
    if (!d.graph_problem.empty()) {
        program.graph_problem = d.graph_problem;
        Py_RETURN_NONE;
    }
    if (program.launches.empty() || program.launches[0].pdl) {
        program.graph_problem = "its first kernel overlaps the stream's earlier work (PDL)";
        Py_RETURN_NONE;
    }
    std::vector<std::array<unsigned, 3>> grids(program.launches.size());
    for (size_t i = 0; i < program.launches.size(); ++i)
        for (int k = 0; k < 3; ++k)
            grids[i][k] = static_cast<unsigned>(std::max<int64_t>(program.launches[i].grid[k], 1));
    std::string problem;
    bool done = without_gil([&] {
        try {
            auto built = build_graph(program, grids);
            check_graph_call(d.graph_upload(built->exec, program.comm_handle), "cuGraphUpload");
            program.graph = std::move(built);
        } catch (const RunFailure& failure) {  // not a failure of the program: it launches one by one
            problem = failure.message;
        }
    });
    if (!done) return nullptr;
    program.graph_problem = problem;
    Py_RETURN_NONE;
}

}  // namespace
