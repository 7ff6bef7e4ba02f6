#pragma once

// Combine, communication part: every received row goes back to its source rank, into that
// source's combine slot for (this rank, slot), over NVLink. In the expanded layout with multiple
// reduction the rows of a token's local experts are first summed here (FP32, top-k lane order,
// one rounding to BF16); without it each local lane's row travels on its own.

#include <cuda_bf16.h>
#include <nccl_device.h>

#include "../common/comm.cuh"
#include "../common/copy.cuh"
#include "../common/layout.cuh"
#include "../common/ptx.cuh"

namespace deep_ep {

struct CombineArgs {
    const int4* x;              // BF16 rows to send back
    const float* topk_weights;  // plain: [rows, topk]; expanded: [rows]; may be null
    const int* recv_src_metadata;
    const int* psum_num_recv_tokens_per_rank;
    int num_max_tokens_per_rank;
    int rank;
    int64_t* error_block;
    uint64_t timeout_ns;
};

template <int kNumRanks, int kHidden, int kNumTopk, int kNumRows, int kNumThreads, bool kExpand>
__global__ void __launch_bounds__(kNumThreads, 1)
    combine_impl(ncclDevComm comm, ncclWindow_t window, CombineArgs args) {
    using Slot = CombineSlot<kHidden, kNumRows, kNumTopk>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kRowVectors = kHidden / 8;
    constexpr int kMetaCols = 2 + kNumTopk;
    static_assert(kExpand or kNumRows == 1, "the plain layout sends one row per token");
    (void)comm;

    __shared__ void* peer_windows[kNumRanks];
    __shared__ int psum_src[kNumRanks + 1];
    load_peer_windows<kNumRanks>(window, peer_windows);
    if (threadIdx.x == 0) {
        psum_src[0] = 0;
        for (int s = 0; s < kNumRanks; ++s) psum_src[s + 1] = args.psum_num_recv_tokens_per_rank[s];
    }

    // Wait for peers: their previous kernels reading this window are done
    const int channel = blockIdx.x;
    if (!channel_barrier<kNumRanks>(peer_windows, args.rank, channel, kPhaseCombineEntry, args.error_block,
                                    args.timeout_ns))
        return;

    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    const int num_recv_tokens = psum_src[kNumRanks];
    for (int i = blockIdx.x * kNumWarps + warp_idx; i < num_recv_tokens; i += gridDim.x * kNumWarps) {
        int s = 0;
        while (psum_src[s + 1] <= i) ++s;
        char* slot = static_cast<char*>(peer_windows[s]) + kWorkspaceBytes +
                     (static_cast<int64_t>(args.rank) * args.num_max_tokens_per_rank + (i - psum_src[s])) *
                         Slot::kBytes;
        float* slot_weights = reinterpret_cast<float*>(slot + Slot::kWeightOffset);

        if constexpr (not kExpand) {
            const int4* src = args.x + static_cast<int64_t>(i) * kRowVectors;
            warp_copy<kRowVectors>(
                lane_idx, [&](int v) { return ld_nc_v4(src + v); },
                [&](int v, const int4& value) { st_na_v4(reinterpret_cast<int4*>(slot) + v, value); });
            if (lane_idx < kNumTopk)
                slot_weights[lane_idx] =
                    args.topk_weights != nullptr ? args.topk_weights[static_cast<int64_t>(i) * kNumTopk + lane_idx] : 0.0f;
        } else {
            const int expanded_row =
                lane_idx < kNumTopk ? args.recv_src_metadata[static_cast<int64_t>(i) * kMetaCols + 2 + lane_idx] : -1;
            const uint32_t local_lanes = __ballot_sync(0xffffffff, expanded_row >= 0);
            if (lane_idx < kNumTopk)
                slot_weights[lane_idx] =
                    (args.topk_weights != nullptr and expanded_row >= 0) ? args.topk_weights[expanded_row] : 0.0f;
            if constexpr (kNumRows == 1) {
                // Multiple reduction: sum the local lanes here, in lane order. The rows are
                // gathered before the hidden loop, whose trip count may differ between lanes.
                int rows[kNumTopk];
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k) rows[k] = __shfl_sync(0xffffffff, expanded_row, k);
                constexpr int kUnroll = 4;
#pragma unroll 1
                for (int base = 0; base < kRowVectors; base += 32 * kUnroll) {
                    float acc[kUnroll][8];
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
#pragma unroll
                    for (int k = 0; k < kNumTopk; ++k) {
                        if (rows[k] < 0) continue;
                        const int4* row = args.x + static_cast<int64_t>(rows[k]) * kRowVectors;
                        int4 values[kUnroll];
#pragma unroll
                        for (int u = 0; u < kUnroll; ++u) {
                            const int v = base + u * 32 + lane_idx;
                            if (v < kRowVectors) values[u] = ld_nc_v4(row + v);
                        }
#pragma unroll
                        for (int u = 0; u < kUnroll; ++u) {
                            if (base + u * 32 + lane_idx >= kRowVectors) continue;
                            const auto* bf16 = reinterpret_cast<const __nv_bfloat162*>(&values[u]);
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                const float2 f = __bfloat1622float2(bf16[j]);
                                acc[u][2 * j] += f.x;
                                acc[u][2 * j + 1] += f.y;
                            }
                        }
                    }
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int v = base + u * 32 + lane_idx;
                        if (v >= kRowVectors) continue;
                        int4 out;
                        auto* out_bf16 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            out_bf16[j] = __floats2bfloat162_rn(acc[u][2 * j], acc[u][2 * j + 1]);
                        st_na_v4(reinterpret_cast<int4*>(slot) + v, out);
                    }
                }
            } else {
                // No multiple reduction: the j-th local lane's row goes to sub-row j
                uint32_t lanes = local_lanes;
                for (int j = 0; lanes != 0; ++j) {
                    const int k = __ffs(lanes) - 1;
                    lanes &= lanes - 1;
                    const int row = __shfl_sync(0xffffffff, expanded_row, k);
                    const int4* src = args.x + static_cast<int64_t>(row) * kRowVectors;
                    int4* dst = reinterpret_cast<int4*>(slot + j * Slot::kRowBytes);
                    warp_copy<kRowVectors>(
                        lane_idx, [&](int v) { return ld_nc_v4(src + v); },
                        [&](int v, const int4& value) { st_na_v4(dst + v, value); });
                }
            }
        }
    }

    // Release our rows to their home ranks
    channel_barrier<kNumRanks>(peer_windows, args.rank, channel, kPhaseCombineExit, args.error_block,
                               args.timeout_ns);
}

}  // namespace deep_ep
