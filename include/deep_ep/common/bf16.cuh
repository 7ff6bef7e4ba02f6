#pragma once

// BF16x8 (one 16-byte vector) to and from FP32 accumulators: the reductions of combine add rows
// in FP32 in a fixed order and round once, which is what makes them bitwise reproducible.

#include <cuda_bf16.h>

#include <deep_ep/common/ptx.cuh>

namespace deep_ep {

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& packed) {
    const auto* bf16 = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(bf16[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
    }
}

__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
    int4 out;
    auto* bf16 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j) bf16[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    return out;
}

// One part of a row (`kUnroll` vectors per lane, every load in flight before the first use), and
// its sum into FP32 accumulators; lanes past the row's end load and add nothing. Rows in the window
// (`kFromWindow`), which peers write while the kernel runs, take coherent loads.
template <int kNumVectors, int kUnroll, bool kFromWindow = false>
__device__ __forceinline__ void load_part(int lane_idx, int part, const int4* row, int4 (&values)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int v = part * 32 * kUnroll + u * 32 + lane_idx;
        if (v < kNumVectors) values[u] = kFromWindow ? ld_window_v4(row + v) : ld_nc_v4(row + v);
    }
}

template <int kNumVectors, int kUnroll>
__device__ __forceinline__ void add_part(int lane_idx, int part, float (&acc)[kUnroll][8],
                                         const int4 (&values)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
        if (part * 32 * kUnroll + u * 32 + lane_idx < kNumVectors) add_bf16x8(acc[u], values[u]);
}

// Sums rows into `acc` for one part of `kUnroll` vectors per lane: `for_each_row(accumulate)`
// calls `accumulate(row)` for every source row in the contract's order.
template <int kNumVectors, int kUnroll, typename ForEachRow>
__device__ __forceinline__ void reduce_part(int lane_idx, int part, float (&acc)[kUnroll][8], ForEachRow for_each_row) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
    for_each_row([&](const int4* row) {
        int4 values[kUnroll];
        load_part<kNumVectors, kUnroll>(lane_idx, part, row, values);
        add_part<kNumVectors, kUnroll>(lane_idx, part, acc, values);
    });
}

}  // namespace deep_ep
