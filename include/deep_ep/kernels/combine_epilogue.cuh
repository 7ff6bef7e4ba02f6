#pragma once

// After combine, on the home rank: for every token, sum the rows its holder ranks sent back, in
// ascending rank order (and, without multiple reduction, ascending lane order inside a rank), in
// FP32, then bias 0, then bias 1, with one rounding to BF16. This order is the contract that
// `deep_ep.reference` models, so the result is bitwise reproducible. Top-k weights come back from
// the holder of each lane's expert.

#include <cuda_bf16.h>

#include "../common/fault.cuh"
#include "../common/layout.cuh"
#include "../common/ptx.cuh"

namespace deep_ep {

struct CombineEpilogueArgs {
    const char* window_base;
    const int64_t* topk_idx;  // [num_tokens, topk], global expert ids
    const int* slot_idx;      // [num_tokens, num_ranks]
    const int4* bias_0;       // [num_tokens, hidden] BF16 or null
    const int4* bias_1;
    int4* combined_x;
    float* combined_topk_weights;  // null when no weights travel
    int num_tokens;
    int num_max_tokens_per_rank;
    int num_experts_per_rank;
};

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& packed) {
    const auto* bf16 = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(bf16[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
    }
}

template <int kNumRanks, int kHidden, int kNumTopk, int kNumRows, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) combine_epilogue_impl(CombineEpilogueArgs args) {
    using Slot = CombineSlot<kHidden, kNumRows, kNumTopk>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kRowVectors = kHidden / 8;
    if (has_error(args.window_base)) return;

    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    for (int t = blockIdx.x * kNumWarps + warp_idx; t < args.num_tokens; t += gridDim.x * kNumWarps) {
        const int64_t expert = lane_idx < kNumTopk ? args.topk_idx[static_cast<int64_t>(t) * kNumTopk + lane_idx] : -1;
        const int holder = expert >= 0 ? static_cast<int>(expert / args.num_experts_per_rank) : -1;

        const char* slots[kNumRanks];
        int num_rows[kNumRanks];
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            num_rows[d] = __popc(__ballot_sync(0xffffffff, holder == d));
            slots[d] = num_rows[d] == 0 ? nullptr
                                        : args.window_base + kWorkspaceBytes +
                                              (static_cast<int64_t>(d) * args.num_max_tokens_per_rank +
                                               args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d]) *
                                                  Slot::kBytes;
            if constexpr (kNumRows == 1) num_rows[d] = min(num_rows[d], 1);
        }

        // A batch of vectors per lane, so every source row has several loads in flight
        constexpr int kUnroll = 4;
#pragma unroll 1
        for (int base = 0; base < kRowVectors; base += 32 * kUnroll) {
            float acc[kUnroll][8];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
            auto accumulate = [&](const int4* row) {
                int4 values[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int v = base + u * 32 + lane_idx;
                    if (v < kRowVectors) values[u] = ld_nc_v4(row + v);
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (base + u * 32 + lane_idx < kRowVectors) add_bf16x8(acc[u], values[u]);
            };
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d)
                for (int j = 0; j < num_rows[d]; ++j)
                    accumulate(reinterpret_cast<const int4*>(slots[d] + j * Slot::kRowBytes));
            if (args.bias_0 != nullptr) accumulate(args.bias_0 + static_cast<int64_t>(t) * kRowVectors);
            if (args.bias_1 != nullptr) accumulate(args.bias_1 + static_cast<int64_t>(t) * kRowVectors);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int v = base + u * 32 + lane_idx;
                if (v >= kRowVectors) continue;
                int4 out;
                auto* out_bf16 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
                for (int j = 0; j < 4; ++j) out_bf16[j] = __floats2bfloat162_rn(acc[u][2 * j], acc[u][2 * j + 1]);
                args.combined_x[static_cast<int64_t>(t) * kRowVectors + v] = out;
            }
        }

        if (args.combined_topk_weights != nullptr and lane_idx < kNumTopk) {
            float weight = 0.0f;
            if (holder >= 0) {
                const char* slot = args.window_base + kWorkspaceBytes +
                                   (static_cast<int64_t>(holder) * args.num_max_tokens_per_rank +
                                    args.slot_idx[static_cast<int64_t>(t) * kNumRanks + holder]) *
                                       Slot::kBytes;
                weight = reinterpret_cast<const float*>(slot + Slot::kWeightOffset)[lane_idx];
            }
            args.combined_topk_weights[static_cast<int64_t>(t) * kNumTopk + lane_idx] = weight;
        }
    }
}

}  // namespace deep_ep
