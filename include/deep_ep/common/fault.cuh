#pragma once

// Device-side deadlines. A wait that passes its deadline records what it waited for in a
// host-mapped error block and makes the kernel return: Python turns the record into
// `EPTimeoutError`. Never `trap`: a trapped context is lost for the whole process.

#include <cstdint>

#include "layout.cuh"
#include "ptx.cuh"

namespace deep_ep {

// Error block layout (int64 words); deep_ep/layout.py mirrors it.
enum ErrorWord : int { kErrStatus = 0, kErrPhase, kErrRank, kErrPeer, kErrChannel, kErrObserved, kErrExpected, kErrWords };

enum Phase : int {
    kPhaseBarrier = 1,
    kPhaseDispatchEntry = 2,
    kPhaseDispatchArrival = 3,
    kPhaseCombineEntry = 4,
    kPhaseCombineArrival = 5,
    kPhaseDispatchGrid = 6,
    kPhaseDispatchCounts = 7,
};

// Where a kernel tells the others of its buffer that a wait failed: the status word of the
// local workspace, and the host-mapped error block that Python reads.
struct FaultSink {
    int64_t* error_block;  // host-mapped, written once
    int64_t* status;       // local workspace, polled

    __device__ __forceinline__ bool has_error() const {
        return *reinterpret_cast<const volatile int64_t*>(status) != 0;
    }

    __device__ __forceinline__ void report_timeout(int phase, int rank, int peer, int channel, int observed,
                                                   int expected) const {
        // The first failure wins; later ones (other CTAs giving up on the same peer) add nothing.
        if (atomicCAS(reinterpret_cast<unsigned long long*>(status), 0ull, 1ull) == 0ull) {
            volatile int64_t* block = error_block;
            block[kErrPhase] = phase;
            block[kErrRank] = rank;
            block[kErrPeer] = peer;
            block[kErrChannel] = channel;
            block[kErrObserved] = observed;
            block[kErrExpected] = expected;
            __threadfence_system();
            block[kErrStatus] = 1;
            __threadfence_system();
        }
    }
};

__device__ __forceinline__ FaultSink make_fault_sink(void* local_window, int64_t* error_block) {
    return {error_block, reinterpret_cast<int64_t*>(static_cast<char*>(local_window) + kStatusOffset)};
}

__device__ __forceinline__ bool has_error(const char* local_window) {
    return *reinterpret_cast<const volatile int64_t*>(local_window + kStatusOffset) != 0;
}

}  // namespace deep_ep
