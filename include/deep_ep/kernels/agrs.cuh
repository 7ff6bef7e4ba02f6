#pragma once

// The device half of an AGRS call inside one NVLink domain (deep_ep/backends/kernels/agrs.py). The
// host has queued, on the same stream before this kernel, copy-engine copies of this rank's data
// into every peer's window; the kernel starts once they are complete. CTA 0 then tells each peer so
// (a release store of the call's signature and number into the peer's flag for us), and every CTA
// waits, with a deadline, until each peer's flag for us has reached the call's number: the peers'
// copies into our window are complete. A peer whose call has another signature (other shapes or
// dtypes: the host agrees on nothing) fails the buffer as an operation mismatch. An all-gather
// (`Element` void) ends there: its output is the window's block. A reduce-scatter then sums, for
// each element, the row every rank sent us, in FP32 from +0.0 in ascending rank order, and rounds
// once (the reference's order: the same bits).
//
// Two flags per peer, for calls of even and odd numbers: a peer runs at most one call ahead of us
// (its next wait needs our flag of that call, set only after this kernel), so while we wait for call
// `k` the flag of `k`'s parity holds `k - 2` or `k`, and then `k`'s signature.

#include <cstdint>
#include <type_traits>

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/bf16.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>

namespace deep_ep {

struct AgrsArgs {
    char* window;  // this rank's window
    int64_t* error_block;
    uint64_t timeout_ns;
    const void* rows;      // reduce-scatter: [num_ranks][num_elements] in this window, row s from rank s
    void* out;             // reduce-scatter: [num_elements]
    int64_t num_elements;  // reduce-scatter: elements of one row
    int sequence;          // the call's number: every peer's flag for us reaches it
    int rank;
    int num_ranks;
    uint32_t signature;  // the call's shapes and dtypes (a hash): every peer's must be the same
};

__device__ __forceinline__ float agrs_to_float(float value) {
    return value;
}
__device__ __forceinline__ float agrs_to_float(__nv_bfloat16 value) {
    return __bfloat162float(value);
}
__device__ __forceinline__ void agrs_store(float* out, float value) {
    *out = value;
}
__device__ __forceinline__ void agrs_store(__nv_bfloat16* out, float value) {
    *out = __float2bfloat16_rn(value);
}

template <typename Element, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) agrs_impl(AgrsArgs args) {
    const FaultSink fault = make_fault_sink(args.window, args.error_block);
    const int parity = args.sequence & 1;
    const uint64_t* flags = reinterpret_cast<const uint64_t*>(args.window + kAgrsFlagOffset);
    const int peer = static_cast<int>(threadIdx.x);
    if (blockIdx.x == 0 and peer < args.num_ranks and peer != args.rank) {
        // Our copies to every peer are complete (stream order): one system fence, then the flags
        void* const* peer_windows = reinterpret_cast<void* const*>(args.window + kPeerWindowsOffset);
        uint64_t* peer_flags = reinterpret_cast<uint64_t*>(static_cast<char*>(peer_windows[peer]) + kAgrsFlagOffset);
        fence_acq_rel_sys();
        st_relaxed_sys_u64(peer_flags + args.rank * kAgrsFlagsPerRank + parity,
                           static_cast<uint64_t>(args.signature) << 32 | static_cast<uint32_t>(args.sequence));
    }
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    if (peer < args.num_ranks and peer != args.rank) {
        const uint64_t* flag = flags + peer * kAgrsFlagsPerRank + parity;
        if (not wait_counter(flag, args.sequence, fault, kPhaseAgrsArrival, args.rank, peer, blockIdx.x,
                             args.timeout_ns)) {
            failed = 1;
        } else if (const uint32_t theirs = static_cast<uint32_t>(ld_acquire_sys(flag) >> 32);
                   theirs != args.signature) {
            fault.report_timeout(kPhaseOpMismatch, args.rank, peer, blockIdx.x, static_cast<int>(theirs),
                                 static_cast<int>(args.signature));
            failed = 1;
        }
    }
    // The acquires above and the barrier make every peer's copies visible to the whole CTA
    __syncthreads();
    if constexpr (not std::is_void_v<Element>) {
        if (failed) return;
        const Element* rows = static_cast<const Element*>(args.rows);
        Element* out = static_cast<Element*>(args.out);
        const int64_t stride = static_cast<int64_t>(gridDim.x) * kNumThreads;
        const int64_t first = static_cast<int64_t>(blockIdx.x) * kNumThreads + threadIdx.x;
        constexpr int kPerVector = 16 / sizeof(Element);
        if (args.num_elements % kPerVector == 0) {
            // Rows of whole 16-byte vectors (the block and `out` are 16-byte aligned): one vector a thread
            for (int64_t v = first; v < args.num_elements / kPerVector; v += stride) {
                float sum[kPerVector] = {};
                for (int s = 0; s < args.num_ranks; ++s) {
                    // Another kernel of this rank may have read this window before (L1): read through L2
                    const int4 raw = __ldcg(reinterpret_cast<const int4*>(rows + s * args.num_elements) + v);
                    const Element* values = reinterpret_cast<const Element*>(&raw);
#pragma unroll
                    for (int j = 0; j < kPerVector; ++j) sum[j] += agrs_to_float(values[j]);
                }
                int4 packed;
                Element* rounded = reinterpret_cast<Element*>(&packed);
#pragma unroll
                for (int j = 0; j < kPerVector; ++j) agrs_store(rounded + j, sum[j]);
                reinterpret_cast<int4*>(out)[v] = packed;
            }
        } else {
            for (int64_t i = first; i < args.num_elements; i += stride) {
                float sum = 0.0f;
                for (int s = 0; s < args.num_ranks; ++s) sum += agrs_to_float(__ldcg(rows + s * args.num_elements + i));
                agrs_store(out + i, sum);
            }
        }
    }
}

}  // namespace deep_ep
