#pragma once

// Test-only: a header that breaks the one-kernel-per-spec rule with a non-template kernel.

namespace jit_test {

__global__ void stray_kernel(int* out) { out[0] = 1; }

template <int kValue>
__global__ void wanted_impl(int* out) {
    out[threadIdx.x] = kValue;
}

}  // namespace jit_test
