#pragma once

// Dispatch, communication part: every token's record goes once to every destination rank that
// owns one of its experts, straight into the destination's window at the slot the layout kernel
// gave it (the source owns that slot block, so no atomics and no ordering between CTAs).
// Channel c of each rank pairs with channel c of the others for the entry and exit barriers.

#include <nccl_device.h>

#include "../common/comm.cuh"
#include "../common/copy.cuh"
#include "../common/layout.cuh"
#include "../common/ptx.cuh"

namespace deep_ep {

template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_impl(ncclDevComm comm, ncclWindow_t window, const int4* x, const int* x_scales, const int64_t* topk_idx,
                  const float* topk_weights, const int* slot_idx, const int* num_tokens_per_rank, int num_tokens,
                  int num_max_tokens_per_rank, int rank, int64_t* error_block, uint64_t timeout_ns) {
    using Record = DispatchRecord<kHiddenBytes, kNumScaleBytes, kNumTopk>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kHiddenVectors = kHiddenBytes / 16;
    constexpr int kNumScaleInts = kNumScaleBytes / 4;
    static_assert(kNumTopk <= 32, "one lane per top-k entry");
    (void)comm;

    __shared__ void* peer_windows[kNumRanks];
    load_peer_windows<kNumRanks>(window, peer_windows);

    // Wait for peers: their previous kernels on this window (epilogues reading it) are done
    const int channel = blockIdx.x;
    if (!channel_barrier<kNumRanks>(peer_windows, rank, channel, kPhaseDispatchEntry, error_block, timeout_ns))
        return;

    // Publish how many tokens each destination gets from us
    if (channel == 0 and threadIdx.x < kNumRanks) {
        auto* counts = reinterpret_cast<int*>(static_cast<char*>(peer_windows[threadIdx.x]) + kRecvCountOffset);
        counts[rank] = num_tokens_per_rank[threadIdx.x];
    }

    // Copy records, one warp per token, loading each 16-byte vector once for all destinations
    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    for (int t = blockIdx.x * kNumWarps + warp_idx; t < num_tokens; t += gridDim.x * kNumWarps) {
        const int my_slot = lane_idx < kNumRanks ? slot_idx[static_cast<int64_t>(t) * kNumRanks + lane_idx] : -1;
        char* dst_records[kNumRanks];
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const int slot = __shfl_sync(0xffffffff, my_slot, d);
            dst_records[d] = slot < 0 ? nullptr
                                      : static_cast<char*>(peer_windows[d]) + kWorkspaceBytes +
                                            (static_cast<int64_t>(rank) * num_max_tokens_per_rank + slot) *
                                                Record::kBytes;
        }

        const int4* src = x + static_cast<int64_t>(t) * kHiddenVectors;
        // Fewer vectors in flight when many destination pointers share the registers
        warp_copy<kHiddenVectors, (kNumRanks <= 4 ? kCopyUnroll : kCopyUnroll / 2)>(
            lane_idx, [&](int i) { return ld_nc_v4(src + i); },
            [&](int i, const int4& v) {
#pragma unroll
                for (int d = 0; d < kNumRanks; ++d)
                    if (dst_records[d] != nullptr) st_na_v4(reinterpret_cast<int4*>(dst_records[d]) + i, v);
            });
        if constexpr (kNumScaleInts > 0) {
            for (int i = lane_idx; i < kNumScaleInts; i += 32) {
                const int v = __ldg(x_scales + static_cast<int64_t>(t) * kNumScaleInts + i);
#pragma unroll
                for (int d = 0; d < kNumRanks; ++d)
                    if (dst_records[d] != nullptr)
                        reinterpret_cast<int*>(dst_records[d] + Record::kScaleOffset)[i] = v;
            }
        }
        if (lane_idx < kNumTopk) {
            const int expert = static_cast<int>(topk_idx[static_cast<int64_t>(t) * kNumTopk + lane_idx]);
            const float weight =
                topk_weights != nullptr ? topk_weights[static_cast<int64_t>(t) * kNumTopk + lane_idx] : 0.0f;
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                if (dst_records[d] != nullptr) {
                    reinterpret_cast<int*>(dst_records[d] + Record::kTopkIdxOffset)[lane_idx] = expert;
                    reinterpret_cast<float*>(dst_records[d] + Record::kWeightOffset)[lane_idx] = weight;
                }
            }
        }
        if (lane_idx == 0) {
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d)
                if (dst_records[d] != nullptr) *reinterpret_cast<int*>(dst_records[d] + Record::kSrcIdxOffset) = t;
        }
    }

    // Release our records to their destinations
    channel_barrier<kNumRanks>(peer_windows, rank, channel, kPhaseDispatchExit, error_block, timeout_ns);
}

}  // namespace deep_ep
