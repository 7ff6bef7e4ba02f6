#pragma once

// Test-only: every scalar width the launcher can pass, folded into one exact int64 per element.

#include <cstdint>

namespace jit_test {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    scalars_impl(const int* x, int64_t* out, int n, int32_t a, uint32_t b, int64_t c, uint64_t d, float s, double e,
                 bool flag) {
    const int64_t bias = static_cast<int64_t>(b) + c + static_cast<int64_t>(d >> 48) +
                         static_cast<int64_t>(s * 4.0f) + static_cast<int64_t>(e * 8.0) + (flag ? 1000 : 0);
    for (int i = blockIdx.x * kNumThreads + threadIdx.x; i < n; i += gridDim.x * kNumThreads)
        out[i] = static_cast<int64_t>(x[i]) * a + bias;
}

}  // namespace jit_test
