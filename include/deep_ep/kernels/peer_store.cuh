#pragma once

// Speed-of-light probe: every rank streams `num_bytes` from a local buffer into the same window
// offset of every other rank, with plain 16-byte SM stores, several loads in flight per thread.
// Both directions run at once when all ranks launch it, which is how dispatch and combine load the
// links.

#include <deep_ep/common/comm.cuh>
#include <deep_ep/common/ptx.cuh>

namespace deep_ep {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    peer_store_impl(char* window, int rank, int num_ranks, uint64_t window_offset, const int4* src,
                    uint64_t num_bytes) {
    constexpr int kUnroll = 8;
    const uint64_t num_vectors = num_bytes / sizeof(int4);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kNumThreads;
    void* const* peers = peer_window_table(window);
    for (int i = 1; i < num_ranks; ++i) {
        const int peer = (rank + i) % num_ranks;
        auto* dst = reinterpret_cast<int4*>(static_cast<char*>(peers[peer]) + window_offset);
        for (uint64_t base = blockIdx.x * kNumThreads + threadIdx.x; base < num_vectors; base += stride * kUnroll) {
            int4 values[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * stride < num_vectors) values[u] = ld_nc_v4(src + base + u * stride);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * stride < num_vectors) st_na_v4(dst + base + u * stride, values[u]);
        }
    }
}

}  // namespace deep_ep
