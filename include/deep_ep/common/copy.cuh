#pragma once

// Warp-wide copies of 16-byte vectors with several loads in flight per lane. Loads are issued as a
// batch before any store: the scoped ld/st helpers are `asm volatile`, which the compiler keeps in
// program order, so a plain load-store loop would leave one load in flight per lane.

#include "ptx.cuh"

namespace deep_ep {

constexpr int kCopyUnroll = 8;

// Calls `load(i)` for a batch of vector indices i (lane, lane + 32, ...), then `store(i, v)`.
template <int kNumVectors, int kUnroll = kCopyUnroll, typename Load, typename Store>
__device__ __forceinline__ void warp_copy(int lane_idx, Load load, Store store) {
    constexpr int kStep = 32 * kUnroll;
#pragma unroll 1
    for (int base = 0; base < kNumVectors; base += kStep) {
        int4 values[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * 32 + lane_idx;
            if (kNumVectors % kStep == 0 or i < kNumVectors) values[u] = load(i);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = base + u * 32 + lane_idx;
            if (kNumVectors % kStep == 0 or i < kNumVectors) store(i, values[u]);
        }
    }
}

}  // namespace deep_ep
