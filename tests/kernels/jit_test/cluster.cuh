#pragma once

// Test-only: each block of a 2-block cluster reports its rank in the cluster, the cluster size,
// and a value read from its partner's shared memory (distributed shared memory).

#include <cooperative_groups.h>

namespace jit_test {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) cluster_impl(int* out) {
    __shared__ int value;
    auto cluster = cooperative_groups::this_cluster();
    if (threadIdx.x == 0)
        value = static_cast<int>(blockIdx.x);
    cluster.sync();
    const int partner = static_cast<int>(cluster.block_rank()) ^ 1;
    const int* remote = cluster.map_shared_rank(&value, partner);
    if (threadIdx.x == 0) {
        out[blockIdx.x * 3 + 0] = static_cast<int>(cluster.block_rank());
        out[blockIdx.x * 3 + 1] = static_cast<int>(cluster.num_blocks());
        out[blockIdx.x * 3 + 2] = *remote;
    }
    // Keep our shared memory alive until the partner has read it
    cluster.sync();
}

}  // namespace jit_test
