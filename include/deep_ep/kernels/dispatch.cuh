#pragma once

// Dispatch, communication part, with the layout fused in: every token's record goes once to every
// destination rank that owns one of its experts, straight into the destination's window at its
// slot (the source owns that slot block, so no atomics and no ordering between CTAs).
//
// Fresh dispatch (not kCached): CTA c owns a contiguous chunk of tokens. It counts its chunk's
// tokens per destination, adds its tokens per expert to device-wide counters and validates its
// rows; after a grid barrier every CTA knows how many tokens precede its chunk for each
// destination (hence the slots of its tokens, in source order) and whether any row was bad (then
// nothing is sent). CTA d (the grid has at least one CTA per rank) tells rank d, after the entry
// barrier, how many tokens and how many per local expert it gets; after the exit barrier CTA
// `rank`, which is paired with exactly those senders, sums what it was told. No separate layout
// or count kernel runs.
// Cached dispatch: the slots come from the handle.
// A rank's records for itself carry only their metadata: the epilogue reads the payload from `x`.
// Channel c of each rank pairs with channel c of the others for the entry and exit barriers.

#include <nccl_device.h>

#include "../common/comm.cuh"
#include "../common/copy.cuh"
#include "../common/layout.cuh"
#include "../common/math.cuh"
#include "../common/ptx.cuh"

namespace deep_ep {

struct DispatchArgs {
    const int4* x;               // [num_tokens, hidden bytes / 16]
    const int* x_scales;         // [num_tokens, scale bytes / 4] or null
    const int64_t* topk_idx;     // [num_tokens, topk] global expert ids, -1 = none
    const float* topk_weights;   // [num_tokens, topk] or null
    int* slot_idx;               // [num_tokens, num_ranks]: written (fresh) or read (cached); -1 = not sent
    int* dst_slot_idx;           // [num_tokens, topk]: per lane, the slot at the lane's rank (fresh), or null
    int* layout_scratch;         // [kDispatchScratchInts], zero between fresh dispatches (layout.cuh)
    int* num_tokens_per_rank;    // [num_ranks]: written (fresh) or read (cached)
    int* num_recv_tokens_per_expert;  // [num_experts_per_rank], written by a fresh dispatch
    int* counts_out;             // [num_ranks + num_experts_per_rank + 1] for the host (recv per source,
                                 // recv per local expert, invalid-input flag), or null
    int* cumulative_stats;       // [num_experts_per_rank] incremented in place, or null
    int num_tokens;
    int num_max_tokens_per_rank;
    int rank;
    int num_experts_per_rank;
    int64_t* error_block;
    uint64_t timeout_ns;
};

// The destination ranks of token t (bit d: one of its experts lives on d); sets `is_bad` for an
// expert id outside [-1, num_experts) or an expert repeated in the row.
template <int kNumRanks, int kNumTopk>
__device__ __forceinline__ uint64_t token_rank_mask(const int64_t* topk_idx, int t, int num_experts_per_rank,
                                                    bool& is_bad) {
    int64_t experts[kNumTopk];
#pragma unroll
    for (int k = 0; k < kNumTopk; ++k) experts[k] = __ldg(topk_idx + static_cast<int64_t>(t) * kNumTopk + k);
    const int64_t num_experts = static_cast<int64_t>(num_experts_per_rank) * kNumRanks;
    uint64_t mask = 0;
#pragma unroll
    for (int k = 0; k < kNumTopk; ++k) {
        const int64_t expert = experts[k];
        if (expert < -1 or expert >= num_experts)
            is_bad = true;
        else if (expert >= 0)
            mask |= 1ull << static_cast<int>(expert / num_experts_per_rank);
#pragma unroll
        for (int j = 0; j < k; ++j) is_bad |= expert >= 0 and expert == experts[j];
    }
    return mask;
}

template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads, bool kCached>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_impl(ncclDevComm comm, ncclWindow_t window, DispatchArgs args) {
    using Record = DispatchRecord<kHiddenBytes, kNumScaleBytes, kNumTopk>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kHiddenVectors = kHiddenBytes / 16;
    constexpr int kScaleVectorsEnd = Record::kMetaOffset / 16;
    constexpr int kRecordVectors = Record::kBytes / 16;
    constexpr int kNumScaleInts = kNumScaleBytes / 4;
    // Fewer vectors in flight when many destination pointers share the registers
    constexpr int kUnroll = kNumRanks <= 4 ? kCopyUnroll : kCopyUnroll / 2;
    // A warp moves one part of a record at a time (one batch of loads), so the parts of a token
    // spread over many warps instead of queueing behind each other in one
    constexpr int kNumParts = num_copy_parts<kRecordVectors, kUnroll>();
    static_assert(kNumRanks <= kMaxRanks, "too many ranks");
    (void)comm;

    __shared__ void* peer_windows[kNumRanks];
    __shared__ int warp_before[kNumWarps][kNumRanks];
    __shared__ int warp_total[kNumWarps][kNumRanks];
    __shared__ int rank_base[kNumRanks];
    __shared__ int rank_total[kNumRanks];
    load_peer_windows<kNumRanks>(window, peer_windows);
    const FaultSink fault = make_fault_sink(peer_windows[args.rank], args.error_block);

    const int channel = blockIdx.x, num_channels = gridDim.x;
    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    const int num_tokens = args.num_tokens, num_local_experts = args.num_experts_per_rank;
    const int tokens_per_channel = ceil_div(num_tokens, num_channels);
    const int chunk_begin = min(num_tokens, channel * tokens_per_channel);
    const int chunk_end = min(num_tokens, chunk_begin + tokens_per_channel);
    bool is_bad = false;

    if constexpr (not kCached) {
        int* scratch = args.layout_scratch;
        // Our chunk: tokens per destination (warp ballots), tokens per expert (device-wide atomics),
        // and whether every row is valid
        for (int i = threadIdx.x; i < kNumWarps * kNumRanks; i += kNumThreads) (&warp_total[0][0])[i] = 0;
        __syncthreads();
        for (int base = chunk_begin; base < chunk_end; base += kNumThreads) {
            const int t = base + static_cast<int>(threadIdx.x);
            bool is_bad_row = false;
            const uint64_t mask =
                t < chunk_end ? token_rank_mask<kNumRanks, kNumTopk>(args.topk_idx, t, num_local_experts, is_bad_row) : 0;
            is_bad |= is_bad_row;
            if (t < chunk_end and not is_bad_row) {
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k) {
                    const int64_t expert = __ldg(args.topk_idx + static_cast<int64_t>(t) * kNumTopk + k);
                    if (expert >= 0) atomicAdd(scratch + kScratchExpertCounts + expert, 1);
                }
            }
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                const int num_hits = __popc(__ballot_sync(0xffffffff, (mask >> d) & 1));
                if (lane_idx == 0) warp_total[warp_idx][d] += num_hits;
            }
        }
        is_bad = __syncthreads_or(is_bad);
        if (threadIdx.x < kNumRanks) {
            int total = 0;
            for (int w = 0; w < kNumWarps; ++w) total += warp_total[w][threadIdx.x];
            scratch[kScratchChunkCounts + channel * kMaxRanks + threadIdx.x] = total;
        }
        if (threadIdx.x == 0) scratch[kScratchChunkBad + channel] = is_bad;

        // Every chunk's counts: our slots start after the chunks before ours
        if (!grid_barrier(scratch + kScratchArrive, scratch + kScratchGeneration, fault, kPhaseDispatchGrid, args.rank,
                          args.timeout_ns))
            return;
        // L2 loads (`.cg`, ordered after the barrier's acquire) that the compiler may batch: a volatile
        // load per iteration would pay the full L2 latency once per channel
        if (threadIdx.x < kNumRanks) {
            int before = 0, total = 0;
#pragma unroll 8
            for (int c = 0; c < num_channels; ++c) {
                const int count = __ldcg(scratch + kScratchChunkCounts + c * kMaxRanks + threadIdx.x);
                before += c < channel ? count : 0;
                total += count;
            }
            rank_base[threadIdx.x] = before;
            rank_total[threadIdx.x] = total;
        }
        int any_bad = 0;
        for (int c = threadIdx.x; c < num_channels; c += kNumThreads) any_bad |= __ldcg(scratch + kScratchChunkBad + c);
        is_bad = __syncthreads_or(any_bad);

        // Slots of our chunk, in token order: base + earlier warps + earlier lanes
        for (int base = chunk_begin; base < chunk_end and not is_bad; base += kNumThreads) {
            const int t = base + static_cast<int>(threadIdx.x);
            bool unused = false;
            const uint64_t mask =
                t < chunk_end ? token_rank_mask<kNumRanks, kNumTopk>(args.topk_idx, t, num_local_experts, unused) : 0;
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                const int num_hits = __popc(__ballot_sync(0xffffffff, (mask >> d) & 1));
                if (lane_idx == 0) warp_before[warp_idx][d] = num_hits;
            }
            __syncthreads();
            const uint32_t lanes_below = (1u << lane_idx) - 1;
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                const bool hit = (mask >> d) & 1;
                int slot = rank_base[d] + __popc(__ballot_sync(0xffffffff, hit) & lanes_below);
                for (int w = 0; w < warp_idx; ++w) slot += warp_before[w][d];
                if (t < chunk_end) args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d] = hit ? slot : -1;
            }
            if (t < chunk_end and args.dst_slot_idx != nullptr) {
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k) {
                    const int64_t expert = __ldg(args.topk_idx + static_cast<int64_t>(t) * kNumTopk + k);
                    args.dst_slot_idx[static_cast<int64_t>(t) * kNumTopk + k] =
                        expert < 0 ? -1
                                   : args.slot_idx[static_cast<int64_t>(t) * kNumRanks + expert / num_local_experts];
                }
            }
            __syncthreads();
            if (threadIdx.x < kNumRanks)
                for (int w = 0; w < kNumWarps; ++w) rank_base[threadIdx.x] += warp_before[w][threadIdx.x];
            __syncthreads();
        }
        if (channel == 0 and threadIdx.x < kNumRanks)
            args.num_tokens_per_rank[threadIdx.x] = is_bad ? 0 : rank_total[threadIdx.x];
    }

    // Wait for peers: their previous kernels on this window (epilogues reading it) are done
    if (!channel_barrier<kNumRanks>(peer_windows, args.rank, channel, kPhaseDispatchEntry, args.error_block,
                                    args.timeout_ns))
        return;

    // Tell destination `channel` how many tokens, and (fresh) how many per local expert, it gets from us
    if (channel < kNumRanks) {
        char* peer = static_cast<char*>(peer_windows[channel]);
        if (threadIdx.x == 0) {
            const int count = kCached ? args.num_tokens_per_rank[channel] : (is_bad ? 0 : rank_total[channel]);
            reinterpret_cast<int*>(peer + kRecvCountOffset)[args.rank] = count;
        }
        if constexpr (not kCached) {
            // Hand over our per-expert counts for `channel` and return their scratch to zero
            int* counts = reinterpret_cast<int*>(peer + kRecvExpertCountOffset) + args.rank * kMaxLocalExperts;
            int* pending = args.layout_scratch + kScratchExpertCounts + channel * num_local_experts;
            for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
                counts[e] = is_bad ? 0 : __ldcg(pending + e);
                pending[e] = 0;
            }
        }
    }
    // The epilogue may launch now (programmatic dependent launch); it waits for our completion
    griddep_launch_dependents();

    // Copy records: one (token, part) per warp, each vector loaded once for all destinations
    auto load_vector = [&](int t, int i) -> int4 {
        if (i < kHiddenVectors) return ld_nc_v4(args.x + static_cast<int64_t>(t) * kHiddenVectors + i);
        int words[4];
        if (i < kScaleVectorsEnd) {
            const int j = i - kHiddenVectors;
            if constexpr (kNumScaleBytes % 16 == 0) {
                return ld_nc_v4(reinterpret_cast<const int4*>(args.x_scales + static_cast<int64_t>(t) * kNumScaleInts) +
                                j);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int word = 4 * j + q;
                    words[q] = word < kNumScaleInts ? __ldg(args.x_scales + static_cast<int64_t>(t) * kNumScaleInts + word)
                                                    : 0;
                }
            }
        } else {
            // Metadata: top-k ids (int32), top-k weights, source token index, zero padding
            const int j = i - kScaleVectorsEnd;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int word = 4 * j + q;
                const int64_t at = static_cast<int64_t>(t) * kNumTopk;
                if (word < kNumTopk)
                    words[q] = static_cast<int>(__ldg(args.topk_idx + at + word));
                else if (word < 2 * kNumTopk)
                    words[q] = args.topk_weights != nullptr ? __float_as_int(__ldg(args.topk_weights + at + word - kNumTopk))
                                                            : 0;
                else
                    words[q] = word == 2 * kNumTopk ? t : 0;
            }
        }
        return make_int4(words[0], words[1], words[2], words[3]);
    };

    const int num_items = is_bad ? 0 : (chunk_end - chunk_begin) * kNumParts;
    for (int item = warp_idx; item < num_items; item += kNumWarps) {
        const int t = chunk_begin + item / kNumParts, part = item % kNumParts;
        char* dst_records[kNumRanks];
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            // Plain loads: a fresh dispatch wrote these slots earlier in this kernel
            const int slot = args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d];
            dst_records[d] = slot < 0 ? nullptr
                                      : static_cast<char*>(peer_windows[d]) + kWorkspaceBytes +
                                            (static_cast<int64_t>(args.rank) * args.num_max_tokens_per_rank + slot) *
                                                Record::kBytes;
        }
        warp_copy_part<kRecordVectors, kUnroll>(
            lane_idx, part, [&](int i) { return load_vector(t, i); },
            [&](int i, const int4& v) {
#pragma unroll
                for (int d = 0; d < kNumRanks; ++d)
                    if (dst_records[d] != nullptr and (d != args.rank or i >= kScaleVectorsEnd))
                        st_na_v4(reinterpret_cast<int4*>(dst_records[d]) + i, v);
            });
    }

    // Release our records to their destinations
    if (!channel_barrier<kNumRanks>(peer_windows, args.rank, channel, kPhaseDispatchExit, args.error_block,
                                    args.timeout_ns))
        return;

    // The CTA paired with the senders that counted for us sums their per-expert counts
    if constexpr (not kCached) {
        if (channel == args.rank) {
            const char* own = static_cast<const char*>(peer_windows[args.rank]);
            const int* recv_counts = reinterpret_cast<const int*>(own + kRecvCountOffset);
            const int* recv_expert_counts = reinterpret_cast<const int*>(own + kRecvExpertCountOffset);
            for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
                int sum = 0;
                for (int s = 0; s < kNumRanks; ++s) sum += ld_relaxed_sys(recv_expert_counts + s * kMaxLocalExperts + e);
                args.num_recv_tokens_per_expert[e] = sum;
                if (args.counts_out != nullptr) args.counts_out[kNumRanks + e] = sum;
                if (args.cumulative_stats != nullptr and not is_bad) args.cumulative_stats[e] += sum;
            }
            if (args.counts_out != nullptr) {
                if (threadIdx.x < kNumRanks)
                    args.counts_out[threadIdx.x] =
                        min(ld_relaxed_sys(recv_counts + threadIdx.x), args.num_max_tokens_per_rank);
                if (threadIdx.x == 0) args.counts_out[kNumRanks + num_local_experts] = is_bad;
            }
        }
    }
}

}  // namespace deep_ep
