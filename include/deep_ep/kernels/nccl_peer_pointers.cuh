#pragma once

// The one kernel that calls NCCL's device API: every LSA peer's base of an NCCL window, once, when
// the window is created. The host puts them into the window's workspace (comm.cuh), from where every
// other kernel reads them, so no other kernel needs NCCL.

#include <cstdint>

#include <nccl_device.h>

namespace deep_ep {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    nccl_peer_pointers_impl(ncclWindow_t window, int num_ranks, uint64_t* out) {
    for (int peer = threadIdx.x; peer < num_ranks; peer += kNumThreads)
        out[peer] = reinterpret_cast<uint64_t>(ncclGetLsaPointer(window, 0, peer));
}

}  // namespace deep_ep
