#pragma once

// After dispatch, on the receiving rank: copy the records out of the window into the user's
// tensors, in the plain layout (rows grouped by source rank, in source-token order) or the
// expanded one (one row per (token, local expert), each expert's block aligned to
// `expert_alignment`), and fill the handle's prefix sums and source metadata.
// The order is fixed by the slots, so the output is deterministic by construction.
// Records a rank sent itself hold only metadata: their payload is read from the dispatch input.
// Launched with programmatic dependent launch while the dispatch still sends: it follows the
// senders' count flags and arrival counters (arrivals.cuh), and its warps take rows in slot order
// with the sources interleaved, which is the order they land in, whichever warp asks next
// (tasks.cuh). The last CTA out returns the arrival counters and count flags to zero and posts our
// window credit to the peers (credits.cuh). With `drain_only` it only waits for every record and
// resets (a dispatch whose input was rejected after peers had already sent). Every write is checked
// against the outputs' rows, whatever the window and the expanded ranks say. Remote sources
// (scaleout.cuh) land here by the transport: their records as theirs, their signatures and arrival
// counters in the scale-out region; their credits go back through the transport.

#include <cub/block/block_scan.cuh>

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/copy.cuh>
#include <deep_ep/common/credits.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/math.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/common/tasks.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

struct DispatchEpilogueArgs {
    char* window_base;
    const int4* x;        // the dispatch input: payload of the rows this rank sent itself
    const int* x_scales;  // may be null
    int num_max_tokens_per_rank;
    int rank;
    int num_experts_per_rank;
    int expert_alignment;
    int num_out_rows;          // rows allocated in recv_x (capacity; exact or worst case)
    int num_meta_rows;         // rows allocated in recv_src_metadata (and recv_topk_idx, plain layout)
    int64_t scale_col_stride;  // 0: row-major scales; else column-major with this row stride
    int4* recv_x;
    int* recv_scales;
    int64_t* recv_topk_idx;    // plain layout only
    float* recv_topk_weights;  // may be null
    int* recv_src_metadata;    // [rows, 2 + topk]
    int* psum_num_recv_tokens_per_rank;
    const int* num_recv_tokens_per_expert;  // cached: the handle's; fresh: summed from the window here
    int* psum_num_recv_tokens_per_expert;
    const int* expand_rank_in_expert;  // fresh expanded dispatch: index inside the expert block
    int is_cached;                     // reuse the expanded rows stored in recv_src_metadata
    int do_zero_padding;
    int drain_only;
    int arrival_block;
    int op_hash;  // what this operation is (arrivals.cuh: op_signature)
    int64_t* error_block;
    uint64_t timeout_ns;
};

// The kernel's work on one of its issuing CTAs; `transport` is the warp's.
template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads, bool kExpand,
          bool kRankMasking, typename Transport>
__device__ __forceinline__ void dispatch_epilogue_body(const DispatchEpilogueArgs& args, const Transport& transport,
                                                       const Scaleout<Transport::kHasRemote>& scaleout,
                                                       const FaultSink& fault) {
    using Record = DispatchRecord<kHiddenBytes, kNumScaleBytes, kNumTopk>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kHiddenVectors = kHiddenBytes / 16;
    constexpr int kNumScaleInts = kNumScaleBytes / 4;
    constexpr int kMetaCols = 2 + kNumTopk;
    constexpr int kExpertsPerThread = kMaxLocalExperts / kNumThreads;
    static_assert(kMaxLocalExperts % kNumThreads == 0, "whole experts per thread");
    using Scan = cub::BlockScan<int, kNumThreads>;
    __shared__ typename Scan::TempStorage scan_storage;
    __shared__ int num_recv[kNumRanks];
    __shared__ int psum_src[kNumRanks + 1];
    __shared__ int num_per_expert[kMaxLocalExperts];
    __shared__ int expert_offset[kMaxLocalExperts + 1];
    const RankMask<kRankMasking> mask = load_rank_mask<kRankMasking>(args.window_base, args.rank);
    const int epoch = *reinterpret_cast<const int*>(args.window_base + kEpochOffset);
    const uint32_t signature = op_signature(epoch, args.op_hash);
    bool ok = wait_op_signatures<kNumRanks>(args.window_base, signature, fault, args.rank, args.timeout_ns, mask,
                                            scaleout) and
              wait_recv_counts<kNumRanks>(args.window_base, signature, args.num_max_tokens_per_rank, num_recv, fault,
                                          args.rank, args.timeout_ns, mask);
    const bool is_drain = args.drain_only;
    if (is_drain)
        ok = ok and wait_all_arrivals<kNumRanks>(args.window_base, scaleout, num_recv, args.arrival_block, fault,
                                                 args.rank, args.timeout_ns);

    const int num_local_experts = args.num_experts_per_rank;
    if (ok and not is_drain) {
        if (threadIdx.x == 0) {
            psum_src[0] = 0;
            for (int s = 0; s < kNumRanks; ++s) psum_src[s + 1] = psum_src[s] + num_recv[s];
        }
        // Tokens per local expert: a fresh dispatch's senders put theirs in our window, released
        // before the count flags we hold
        const int* window_counts = reinterpret_cast<const int*>(args.window_base + kRecvExpertCountOffset);
        for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
            int sum = 0;
            if (args.is_cached)
                sum = args.num_recv_tokens_per_expert[e];
            else
                // A masked source's words are stale (also one masked by a wait of this dispatch): it sent none
                for (int s = 0; s < kNumRanks; ++s)
                    if (not kRankMasking or num_recv[s] != 0)
                        sum += ld_relaxed_sys(window_counts + s * kMaxLocalExperts + e);
            num_per_expert[e] = sum;
        }
        __syncthreads();
        // Aligned expert block offsets: every CTA needs them in the expanded layout, only the one
        // that writes the handle's prefix sums in the plain layout
        if (kExpand or blockIdx.x == 0) {
            int counts[kExpertsPerThread];
#pragma unroll
            for (int j = 0; j < kExpertsPerThread; ++j) {
                const int e = static_cast<int>(threadIdx.x) * kExpertsPerThread + j;
                counts[j] = e < num_local_experts ? align_up(num_per_expert[e], args.expert_alignment) : 0;
            }
            int total;
            Scan(scan_storage).ExclusiveSum(counts, counts, total);
#pragma unroll
            for (int j = 0; j < kExpertsPerThread; ++j) {
                const int e = static_cast<int>(threadIdx.x) * kExpertsPerThread + j;
                if (e < num_local_experts) expert_offset[e] = counts[j];
            }
            if (threadIdx.x == 0) expert_offset[num_local_experts] = total;
        }
        __syncthreads();

        // Handle prefix sums (a cached dispatch's are its handle's already)
        if (blockIdx.x == 0 and not args.is_cached) {
            if (threadIdx.x < kNumRanks) args.psum_num_recv_tokens_per_rank[threadIdx.x] = psum_src[threadIdx.x + 1];
            for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads)
                args.psum_num_recv_tokens_per_expert[e] =
                    kExpand ? expert_offset[e] + num_per_expert[e] : expert_offset[e + 1];
        }

        const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
        const int first_expert = args.rank * num_local_experts;

        // `src`: the record's payload (`from_window`), or the dispatch input's row for records from this rank
        auto copy_row = [&](const int4* src, const int* src_scales, bool from_window, int out_row) {
            if (out_row >= args.num_out_rows) return;
            int4* dst = args.recv_x + static_cast<int64_t>(out_row) * kHiddenVectors;
            if (from_window)
                warp_copy<kHiddenVectors>(
                    lane_idx, [&](int i) { return ld_window_v4(src + i); },
                    [&](int i, const int4& v) { st_na_v4(dst + i, v); });
            else
                warp_copy<kHiddenVectors>(
                    lane_idx, [&](int i) { return ld_nc_v4(src + i); },
                    [&](int i, const int4& v) { st_na_v4(dst + i, v); });
            if constexpr (kNumScaleInts > 0) {
                for (int i = lane_idx; i < kNumScaleInts; i += 32) {
                    const int64_t offset = args.scale_col_stride == 0
                                               ? static_cast<int64_t>(out_row) * kNumScaleInts + i
                                               : static_cast<int64_t>(i) * args.scale_col_stride + out_row;
                    args.recv_scales[offset] = src_scales[i];
                }
            }
        };

        // Rows in the order they land: slot-major, the sources interleaved, taken in order by
        // whichever warp asks next (tasks.cuh)
        int max_recv = 0;
        for (int s = 0; s < kNumRanks; ++s) max_recv = max(max_recv, num_recv[s]);
        const int num_items = max_recv * kNumRanks;
        const TaskQueue items(reinterpret_cast<int*>(args.window_base + kEpilogueTaskQueueOffset), num_items, kNumWarps,
                              num_issuing_ctas<Transport>());
        bool warp_ok = true;
        for (int item = items.first(), claimed = 0; warp_ok and item < num_items; item = items.next(claimed)) {
            claimed = items.claim(item);
            const int slot = item / kNumRanks, s = item % kNumRanks;
            if (slot >= num_recv[s]) continue;
            if (lane_idx == 0) {
                const int block = slot / args.arrival_block;
                warp_ok = wait_arrivals(args.window_base, scaleout, s, block,
                                        arrival_block_size(num_recv[s], block, args.arrival_block), fault,
                                        kPhaseDispatchArrival, args.rank, args.timeout_ns);
            }
            __syncwarp();
            warp_ok = __shfl_sync(0xffffffff, warp_ok, 0);
            if (not warp_ok) break;

            const int i = psum_src[s] + slot;
            if (i >= args.num_meta_rows) continue;
            const char* record = args.window_base + kWorkspaceBytes +
                                 (static_cast<int64_t>(s) * args.num_max_tokens_per_rank + slot) * Record::kBytes;
            const int* record_topk = reinterpret_cast<const int*>(record + Record::kTopkIdxOffset);
            const float* record_weights = reinterpret_cast<const float*>(record + Record::kWeightOffset);
            const int src_token = *reinterpret_cast<const int*>(record + Record::kSrcIdxOffset);
            int* meta = args.recv_src_metadata + static_cast<int64_t>(i) * kMetaCols;
            const bool from_self = s == args.rank;
            const int4* payload = from_self ? args.x + static_cast<int64_t>(src_token) * kHiddenVectors
                                            : reinterpret_cast<const int4*>(record);
            const int* payload_scales = from_self ? args.x_scales + static_cast<int64_t>(src_token) * kNumScaleInts
                                                  : reinterpret_cast<const int*>(record + Record::kScaleOffset);

            const int expert = lane_idx < kNumTopk ? record_topk[lane_idx] : -1;
            const bool is_local = expert >= first_expert and expert < first_expert + num_local_experts;
            const uint32_t local_lanes = __ballot_sync(0xffffffff, is_local);
            if constexpr (not kExpand) {
                copy_row(payload, payload_scales, not from_self, i);
                if (lane_idx < kNumTopk) {
                    args.recv_topk_idx[static_cast<int64_t>(i) * kNumTopk + lane_idx] =
                        is_local ? expert - first_expert : -1;
                    if (args.recv_topk_weights != nullptr)
                        args.recv_topk_weights[static_cast<int64_t>(i) * kNumTopk + lane_idx] =
                            record_weights[lane_idx];
                    if (not args.is_cached) meta[2 + lane_idx] = -1;
                }
            } else {
                int out_row = -1;
                if (lane_idx < kNumTopk) {
                    if (args.is_cached)
                        out_row = meta[2 + lane_idx];
                    else if (is_local)
                        out_row = expert_offset[expert - first_expert] +
                                  args.expand_rank_in_expert[static_cast<int64_t>(i) * kNumTopk + lane_idx];
                    if (out_row >= args.num_out_rows) out_row = -1;
                }
                if (lane_idx < kNumTopk and not args.is_cached) meta[2 + lane_idx] = out_row;
                uint32_t lanes = __ballot_sync(0xffffffff, out_row >= 0);
                while (lanes != 0) {
                    const int k = __ffs(lanes) - 1;
                    lanes &= lanes - 1;
                    const int row = __shfl_sync(0xffffffff, out_row, k);
                    copy_row(payload, payload_scales, not from_self, row);
                    if (lane_idx == 0 and args.recv_topk_weights != nullptr and row < args.num_out_rows)
                        args.recv_topk_weights[row] = record_weights[k];
                }
            }
            if (lane_idx == 0 and not args.is_cached) {
                meta[0] = s * args.num_max_tokens_per_rank + src_token;
                // V2's: the source rank times K plus the token's highest lane to us (its master lane)
                meta[1] = local_lanes == 0 ? -1 : s * kNumTopk + (31 - __clz(local_lanes));
            }
        }

        // Zero the alignment padding between expert blocks
        if constexpr (kExpand) {
            if (args.do_zero_padding) {
                const int global_warp = blockIdx.x * kNumWarps + warp_idx,
                          num_global_warps = num_issuing_ctas<Transport>() * kNumWarps;
                for (int e = 0; e < num_local_experts; ++e) {
                    const int pad_begin = expert_offset[e] + num_per_expert[e];
                    for (int row = pad_begin + global_warp; row < expert_offset[e + 1] and row < args.num_out_rows;
                         row += num_global_warps) {
                        int4* dst = args.recv_x + static_cast<int64_t>(row) * kHiddenVectors;
                        for (int i = lane_idx; i < kHiddenVectors; i += 32) dst[i] = make_int4(0, 0, 0, 0);
                        if constexpr (kNumScaleInts > 0) {
                            for (int i = lane_idx; i < kNumScaleInts; i += 32) {
                                const int64_t offset = args.scale_col_stride == 0
                                                           ? static_cast<int64_t>(row) * kNumScaleInts + i
                                                           : static_cast<int64_t>(i) * args.scale_col_stride + row;
                                args.recv_scales[offset] = 0;
                            }
                        }
                        if (lane_idx == 0 and args.recv_topk_weights != nullptr) args.recv_topk_weights[row] = 0.0f;
                    }
                }
            }
        }
    }

    // The last CTA out also makes the kernel complete only after the dispatch kernel (its handle
    // outputs), as a plain launch would
    finish_epilogue<kNumRanks>(args.window_base, args.rank, args.arrival_block, true, num_issuing_ctas<Transport>(),
                               fault, mask, transport, scaleout, [&](int s) { return num_recv[s]; });
}

template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads, bool kExpand,
          bool kRankMasking, typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_epilogue_impl(DispatchEpilogueArgs args, typename Transport::Args transport_args) {
    // The expanded ranks come from a kernel that ran to completion before us (and may have stopped
    // on a failure, which the count wait then sees)
    if (args.expand_rank_in_expert != nullptr) griddep_wait();
    // With an emulated NIC, the grid's last CTA is the NIC
    run_with_transport<Transport, kNumThreads>(
        args, transport_args, false, [&](const Transport& transport, const auto& scaleout, const FaultSink& fault) {
            dispatch_epilogue_body<kNumRanks, kHiddenBytes, kNumScaleBytes, kNumTopk, kNumThreads, kExpand,
                                   kRankMasking>(args, transport, scaleout, fault);
        });
}

}  // namespace deep_ep
