#pragma once

// After dispatch, on the receiving rank: count the received (token, local expert) pairs of every
// local expert (one CTA per expert, a block scan over received rows in source order), and, for
// the expanded layout, give each pair its index inside its expert's block. Also hands the
// per-source and per-expert counts in one small device array for the host to copy (CPU-sync path), and adds
// the counts to the user's cumulative statistics.

#include <cub/block/block_scan.cuh>

#include "../common/fault.cuh"
#include "../common/layout.cuh"

namespace deep_ep {

template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_count_impl(const char* window_base, int num_max_tokens_per_rank, int rank, int num_experts_per_rank,
                        int* num_recv_tokens_per_expert, int* expand_rank_in_expert, int* counts_out,
                        int* cumulative_stats) {
    using Record = DispatchRecord<kHiddenBytes, kNumScaleBytes, kNumTopk>;
    using Scan = cub::BlockScan<int, kNumThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int psum_src[kNumRanks + 1];
    if (has_error(window_base)) return;

    const int* recv_counts = reinterpret_cast<const int*>(window_base + kRecvCountOffset);
    if (threadIdx.x == 0) {
        psum_src[0] = 0;
        for (int s = 0; s < kNumRanks; ++s) psum_src[s + 1] = psum_src[s] + min(recv_counts[s], num_max_tokens_per_rank);
    }
    __syncthreads();
    const int num_recv_tokens = psum_src[kNumRanks];
    const int expert = rank * num_experts_per_rank + static_cast<int>(blockIdx.x);

    int num_before = 0;
    for (int base = 0; base < num_recv_tokens; base += kNumThreads) {
        const int i = base + static_cast<int>(threadIdx.x);
        int lane = -1;
        if (i < num_recv_tokens) {
            int s = 0;
            while (psum_src[s + 1] <= i) ++s;
            const char* record = window_base + kWorkspaceBytes +
                                 (static_cast<int64_t>(s) * num_max_tokens_per_rank + (i - psum_src[s])) * Record::kBytes;
            const int* record_topk = reinterpret_cast<const int*>(record + Record::kTopkIdxOffset);
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k)
                if (record_topk[k] == expert) lane = k;
        }
        int rank_in_expert, num_in_chunk;
        Scan(scan_storage).ExclusiveSum(lane >= 0 ? 1 : 0, rank_in_expert, num_in_chunk);
        __syncthreads();
        if (lane >= 0 and expand_rank_in_expert != nullptr)
            expand_rank_in_expert[static_cast<int64_t>(i) * kNumTopk + lane] = num_before + rank_in_expert;
        num_before += num_in_chunk;
    }

    if (threadIdx.x == 0) {
        num_recv_tokens_per_expert[blockIdx.x] = num_before;
        if (cumulative_stats != nullptr) cumulative_stats[blockIdx.x] += num_before;
        if (counts_out != nullptr) counts_out[kNumRanks + blockIdx.x] = num_before;
    }
    if (blockIdx.x == 0 and threadIdx.x < kNumRanks and counts_out != nullptr)
        counts_out[threadIdx.x] = psum_src[threadIdx.x + 1] - psum_src[threadIdx.x];
}

}  // namespace deep_ep
