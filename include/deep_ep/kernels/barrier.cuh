#pragma once

// A barrier across every rank of the buffer that is not masked (rank_mask.cuh: a buffer without
// rank masking never sets the mask), with a deadline: one CTA, channel 0.

#include <deep_ep/common/comm.cuh>

namespace deep_ep {

template <int kNumRanks>
__global__ void __launch_bounds__(128, 1)
    barrier_impl(char* window, int rank, int64_t* error_block, uint64_t timeout_ns) {
    channel_barrier<kNumRanks>(window, rank, 0, kPhaseBarrier, make_fault_sink(window, error_block), timeout_ns,
                               load_rank_mask<true>(window, rank));
}

}  // namespace deep_ep
