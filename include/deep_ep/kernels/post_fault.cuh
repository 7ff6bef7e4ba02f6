#pragma once

// A rank's host tells every peer that it stopped the buffer: its input was rejected, or it raised
// inside an operation. Peers may already wait in kernels for this rank's records or credits; the
// fault makes those waits return at once instead of at their deadline, and every host raises,
// naming this rank and, from the message, what it did wrong. One warp: the message into every
// rank's slot of this rank (ours too), then the fault as a wait that expired would post it.

#include <deep_ep/common/fault.cuh>

namespace deep_ep {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    post_fault_impl(char* window, int64_t* error_block, const int4* message) {
    static_assert(kPeerMessageBytes % 16 == 0 and kNumThreads * 16 >= kPeerMessageBytes, "one int4 per thread");
    const int rank = *reinterpret_cast<const int*>(window + kRankOffset);
    const int num_ranks = *reinterpret_cast<const int*>(window + kNumRanksOffset);
    void* const* windows = reinterpret_cast<void* const*>(window + kPeerWindowsOffset);
    const int word = threadIdx.x;
    if (word < kPeerMessageBytes / 16) {
        const int4 value = message[word];  // host-mapped: read once
        for (int peer = 0; peer < num_ranks; ++peer) {
            char* slot = static_cast<char*>(windows[peer]) + kPeerMessageOffset + int64_t(rank) * kPeerMessageBytes;
            reinterpret_cast<int4*>(slot)[word] = value;
        }
    }
    // The message is visible on every rank before the fault that tells them to read it
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) make_fault_sink(window, error_block).report_timeout(kPhaseHostError, rank, rank, -1, 0, 0);
}

}  // namespace deep_ep
