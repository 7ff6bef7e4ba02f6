#pragma once

// Test-only: a kernel that must use local memory (a large per-thread array indexed by a runtime
// value lives on the stack), and a non-inlined device function next to it in the cubin.

#include <cstdint>

namespace jit_test {

__device__ __noinline__ int spill_helper(int x) { return x * 3 + 1; }

template <int kNumInts>
__global__ void spill_impl(const int* idx, int* out) {
    int local[kNumInts];
    for (int i = 0; i < kNumInts; ++i)
        local[i] = idx[i] * 7;
    out[threadIdx.x] = spill_helper(local[idx[threadIdx.x] % kNumInts]);
}

}  // namespace jit_test
