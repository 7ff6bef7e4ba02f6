#pragma once

// Warp-wide copies of 16-byte vectors with several loads in flight per lane. Loads are issued as a
// batch before any store: the scoped ld/st helpers are `asm volatile`, which the compiler keeps in
// program order, so a plain load-store loop would leave one load in flight per lane.

#include <deep_ep/common/ptx.cuh>

namespace deep_ep {

constexpr int kCopyUnroll = 8;

// One part of a row: vectors [part * 32 * kUnroll, (part + 1) * 32 * kUnroll), one batch of loads
// (`load(i)`), then the stores (`store(i, v)`). Short rows split into parts spread over many warps.
template <int kNumVectors, int kUnroll = kCopyUnroll, typename Load, typename Store>
__device__ __forceinline__ void warp_copy_part(int lane_idx, int part, Load load, Store store) {
    constexpr int kPartVectors = 32 * kUnroll;
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = part * kPartVectors + u * 32 + lane_idx;
        if (kNumVectors % kPartVectors == 0 or i < kNumVectors) values[u] = load(i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int i = part * kPartVectors + u * 32 + lane_idx;
        if (kNumVectors % kPartVectors == 0 or i < kNumVectors) store(i, values[u]);
    }
}

template <int kNumVectors, int kUnroll = kCopyUnroll>
__host__ __device__ constexpr int num_copy_parts() {
    return (kNumVectors + 32 * kUnroll - 1) / (32 * kUnroll);
}

// A whole row, part after part.
template <int kNumVectors, int kUnroll = kCopyUnroll, typename Load, typename Store>
__device__ __forceinline__ void warp_copy(int lane_idx, Load load, Store store) {
#pragma unroll 1
    for (int part = 0; part < num_copy_parts<kNumVectors, kUnroll>(); ++part)
        warp_copy_part<kNumVectors, kUnroll>(lane_idx, part, load, store);
}

}  // namespace deep_ep
