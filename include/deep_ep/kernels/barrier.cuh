#pragma once

// A barrier across every rank of the window's LSA team, with a deadline: one CTA, channel 0.

#include <nccl_device.h>

#include "../common/comm.cuh"

namespace deep_ep {

template <int kNumRanks>
__global__ void __launch_bounds__(128, 1)
    barrier_impl(ncclDevComm comm, ncclWindow_t window, int rank, int64_t* error_block, uint64_t timeout_ns) {
    (void)comm;
    __shared__ void* peer_windows[kNumRanks];
    load_peer_windows<kNumRanks>(window, peer_windows);
    channel_barrier<kNumRanks>(peer_windows, rank, 0, kPhaseBarrier, error_block, timeout_ns);
}

}  // namespace deep_ep
