#pragma once

// Device-side deadlines. A wait that passes its deadline records what it waited for in a
// host-mapped error block and makes the kernel return: Python turns the record into
// `EPTimeoutError`. Never `trap`: a trapped context is lost for the whole process.

#include <cstdint>

#include "ptx.cuh"

namespace deep_ep {

// Error block layout (int64 words); deep_ep/layout.py mirrors it.
enum ErrorWord : int { kErrStatus = 0, kErrPhase, kErrRank, kErrPeer, kErrChannel, kErrObserved, kErrExpected, kErrWords };

enum Phase : int {
    kPhaseBarrier = 1,
    kPhaseDispatchEntry = 2,
    kPhaseDispatchExit = 3,
    kPhaseCombineEntry = 4,
    kPhaseCombineExit = 5,
};

__device__ __forceinline__ void report_timeout(int64_t* error_block, int phase, int rank, int peer, int channel,
                                               int observed, int expected) {
    // The first failure wins; later ones (other CTAs giving up on the same peer) add nothing.
    auto* status = reinterpret_cast<unsigned long long*>(error_block + kErrStatus);
    if (atomicCAS(status, 0ull, 2ull) == 0ull) {
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

__device__ __forceinline__ bool has_error(const int64_t* error_block) {
    return *reinterpret_cast<const volatile int64_t*>(error_block + kErrStatus) != 0;
}

}  // namespace deep_ep
