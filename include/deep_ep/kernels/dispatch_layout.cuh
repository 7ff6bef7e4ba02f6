#pragma once

// Dispatch layout (local, no communication): for every token t and destination rank d,
// `slot_idx[t][d]` is the number of earlier tokens that also go to d (a column-wise exclusive scan
// over the T x N "any of t's experts lives on d" bits), or -1 when t does not go to d.
// `num_tokens_per_rank[d]` is the column total. Reads only `topk_idx`.

#include <cub/block/block_scan.cuh>

#include "../common/layout.cuh"

namespace deep_ep {

template <int kNumRanks, int kNumTopk, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_layout_impl(const int64_t* topk_idx, int num_tokens, int num_experts_per_rank, int* slot_idx,
                         int* num_tokens_per_rank) {
    static_assert(kNumRanks <= kMaxRanks, "too many ranks");
    using Scan = cub::BlockScan<int, kNumThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int rank_base[kNumRanks];

    // Each thread owns a contiguous run of tokens, so the block scan yields source-token order
    const int tokens_per_thread = (num_tokens + kNumThreads - 1) / kNumThreads;
    const int begin = min(num_tokens, static_cast<int>(threadIdx.x) * tokens_per_thread);
    const int end = min(num_tokens, begin + tokens_per_thread);

    auto token_rank_mask = [&](int t) {
        uint64_t mask = 0;
#pragma unroll
        for (int k = 0; k < kNumTopk; ++k) {
            const int64_t expert = topk_idx[static_cast<int64_t>(t) * kNumTopk + k];
            if (expert >= 0) mask |= 1ull << static_cast<int>(expert / num_experts_per_rank);
        }
        return mask;
    };

    // Count this thread's tokens per destination
    int counts[kNumRanks];
#pragma unroll
    for (int d = 0; d < kNumRanks; ++d) counts[d] = 0;
    for (int t = begin; t < end; ++t) {
        const uint64_t mask = token_rank_mask(t);
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) counts[d] += (mask >> d) & 1;
    }

    // Exclusive scan per destination
#pragma unroll
    for (int d = 0; d < kNumRanks; ++d) {
        int total;
        Scan(scan_storage).ExclusiveSum(counts[d], counts[d], total);
        if (threadIdx.x == 0) rank_base[d] = total;
        __syncthreads();
    }
    if (threadIdx.x < kNumRanks) num_tokens_per_rank[threadIdx.x] = rank_base[threadIdx.x];

    // Assign slots in token order
    for (int t = begin; t < end; ++t) {
        const uint64_t mask = token_rank_mask(t);
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const bool hit = (mask >> d) & 1;
            slot_idx[static_cast<int64_t>(t) * kNumRanks + d] = hit ? counts[d] : -1;
            counts[d] += hit;
        }
    }
}

}  // namespace deep_ep
