#pragma once

// Test-only: rounds of "write my slot, grid-wide sync, read my neighbour's slot, sync". Without a
// working cooperative launch and grid.sync(), blocks would read values of other rounds.

#include <cooperative_groups.h>

namespace jit_test {

template <int kNumRounds>
__global__ void coop_impl(int* slots, long long* out) {
    auto grid = cooperative_groups::this_grid();
    const int num_blocks = static_cast<int>(gridDim.x);
    long long sum = 0;
    for (int round = 0; round < kNumRounds; ++round) {
        if (threadIdx.x == 0)
            slots[blockIdx.x] = round * num_blocks + static_cast<int>(blockIdx.x);
        grid.sync();
        if (threadIdx.x == 0)
            sum += slots[(blockIdx.x + 1) % num_blocks] - round * num_blocks;
        grid.sync();
    }
    if (threadIdx.x == 0)
        out[blockIdx.x] = sum;
}

}  // namespace jit_test
