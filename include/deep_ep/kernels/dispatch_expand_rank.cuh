#pragma once

// Expanded dispatch, on the receiving rank: give every received (token, local expert) pair its
// index inside the expert's block, in source order (received rows are grouped by source rank,
// then by source token). Each CTA runs a block scan over the received rows for its local experts
// (CTA c: experts c, c + grid, ...), so the grid fits whatever SMs the dispatch left.
// The counts themselves come from the senders (dispatch.cuh); only the ranks need the records,
// so it waits for every record to land first (the dispatch kernel has no exit barrier); remote
// sources' arrival counters are in the scale-out region (scaleout.cuh). It sends nothing, so it takes
// no transport's arguments: `Transport` only says whether there are remote sources.

#include <cub/block/block_scan.cuh>

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads, bool kRankMasking,
          typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_expand_rank_impl(char* window_base, int num_max_tokens_per_rank, int rank, int num_experts_per_rank,
                              int* expand_rank_in_expert, int arrival_block, int op_hash, int64_t* error_block,
                              uint64_t timeout_ns) {
    using Record = DispatchRecord<kHiddenBytes, kNumScaleBytes, kNumTopk>;
    using Scan = cub::BlockScan<int, kNumThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int num_recv[kNumRanks];
    __shared__ int psum_src[kNumRanks + 1];
    const Scaleout<Transport::kHasRemote> scaleout = load_scaleout<Transport::kHasRemote>(window_base, rank);
    const FaultSink fault = make_fault_sink(window_base, error_block, scaleout);
    const int epoch = *reinterpret_cast<const int*>(window_base + kEpochOffset);
    if (!wait_recv_counts<kNumRanks>(window_base, op_signature(epoch, op_hash), num_max_tokens_per_rank, num_recv,
                                     fault, rank, timeout_ns, load_rank_mask<kRankMasking>(window_base, rank)))
        return;
    if (!wait_all_arrivals<kNumRanks>(window_base, scaleout, num_recv, arrival_block, fault, rank, timeout_ns)) return;

    if (threadIdx.x == 0) {
        psum_src[0] = 0;
        for (int s = 0; s < kNumRanks; ++s) psum_src[s + 1] = psum_src[s] + num_recv[s];
    }
    __syncthreads();
    const int num_recv_tokens = psum_src[kNumRanks];
    for (int local_expert = blockIdx.x; local_expert < num_experts_per_rank; local_expert += gridDim.x) {
        const int expert = rank * num_experts_per_rank + local_expert;
        int num_before = 0;
        for (int base = 0; base < num_recv_tokens; base += kNumThreads) {
            const int i = base + static_cast<int>(threadIdx.x);
            int lane = -1;
            if (i < num_recv_tokens) {
                int s = 0;
                while (psum_src[s + 1] <= i) ++s;
                const char* record =
                    window_base + kWorkspaceBytes +
                    (static_cast<int64_t>(s) * num_max_tokens_per_rank + (i - psum_src[s])) * Record::kBytes;
                const int* record_topk = reinterpret_cast<const int*>(record + Record::kTopkIdxOffset);
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k)
                    if (record_topk[k] == expert) lane = k;
            }
            int rank_in_expert, num_in_chunk;
            Scan(scan_storage).ExclusiveSum(lane >= 0 ? 1 : 0, rank_in_expert, num_in_chunk);
            __syncthreads();
            if (lane >= 0)
                expand_rank_in_expert[static_cast<int64_t>(i) * kNumTopk + lane] = num_before + rank_in_expert;
            num_before += num_in_chunk;
        }
    }
}

}  // namespace deep_ep
