#pragma once

// Test-only: uses more dynamic shared memory than the default 48 KiB limit; each thread sums
// the words of its residue class, which needs every word written by other threads first.

namespace jit_test {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) smem_impl(long long* out, int num_ints) {
    extern __shared__ int words[];
    for (int i = threadIdx.x; i < num_ints; i += kNumThreads)
        words[num_ints - 1 - i] = (num_ints - 1 - i) * 7 + static_cast<int>(blockIdx.x);
    __syncthreads();
    long long sum = 0;
    for (int i = (threadIdx.x + 1) % kNumThreads; i < num_ints; i += kNumThreads)
        sum += words[i];
    out[blockIdx.x * kNumThreads + threadIdx.x] = sum;
}

}  // namespace jit_test
