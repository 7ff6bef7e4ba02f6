#pragma once

// Test-only: a producer/consumer pair for programmatic dependent launch. The producer lets its
// dependent start at once, then spins before writing; the consumer records when it started, then
// waits (griddepcontrol.wait) for the producer's results and uses them.

#include <cstdint>

namespace jit_test {

__device__ __forceinline__ uint64_t pdl_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    pdl_producer_impl(int* buf, int n, int seed, uint64_t spin_ns, unsigned long long* end_ns) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const uint64_t start = pdl_timer_ns();
    while (pdl_timer_ns() - start < spin_ns)
        ;
    for (int i = blockIdx.x * kNumThreads + threadIdx.x; i < n; i += gridDim.x * kNumThreads)
        buf[i] = i * 3 + seed;
    __syncthreads();
    if (threadIdx.x == 0)
        atomicMax(end_ns, static_cast<unsigned long long>(pdl_timer_ns()));
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    pdl_consumer_impl(const int* buf, int* out, int n, unsigned long long* start_ns) {
    if (threadIdx.x == 0)
        atomicMin(start_ns, static_cast<unsigned long long>(pdl_timer_ns()));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int i = blockIdx.x * kNumThreads + threadIdx.x; i < n; i += gridDim.x * kNumThreads)
        out[i] = buf[i] + 1;
}

}  // namespace jit_test
