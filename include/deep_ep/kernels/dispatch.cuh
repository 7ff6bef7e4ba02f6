#pragma once

// Dispatch, communication part, with the layout fused in: every token's record goes once to every
// destination rank that owns one of its experts, straight into the destination's window at its
// slot (the source owns that slot block, so no atomics and no ordering between CTAs).
//
// Tokens are sent in tasks of `tokens_per_task`, one warp each, taken in order by whichever warp
// asks next (tasks.cuh), so slots fill in order. After a task the warp fences once and adds the
// task's slots to the destinations' arrival counters (arrivals.cuh): the destination's epilogue,
// launched early (programmatic dependent launch), copies the records that have landed while the
// rest are still on the wire. Nor is there an entry barrier: every CTA starts by checking each
// peer's window credit, posted by the peer's previous epilogue (credits.cuh), which is there in
// steady state.
//
// Fresh dispatch (not kCached): warps count the tokens of every group of `tokens_per_group` per
// destination, count tokens per expert (per CTA, then device-wide) and validate the rows; after a
// grid barrier every CTA scans the group counts into each group's first slot per destination, and
// any bad row stops the send. A sending warp then finds its tokens' slots from their group's first
// slot and the group's earlier tokens.
// CTA c tells ranks c, c + grid, ... how many tokens and how many per local expert they get (a
// count flag that carries the operation's signature); CTA `rank % grid` finally waits for what
// every source told it and sums the per-expert counts. No separate layout or count kernel runs.
// A bad row sends nothing at all: the handle's slots are all -1 and the first bad value goes to the
// error block, for the host to raise (without a CPU sync, at its next call).
// Cached dispatch: the slots come from the handle (any outside [0, num_max_tokens_per_rank) is skipped).
// With rank masking (kRankMasking, rank_mask.cuh) a fresh dispatch drops the lanes of masked ranks'
// experts and counts them, and no kernel waits on a masked rank or writes into its window.
// A rank's records for itself carry only their metadata: the epilogue reads the payload from `x`.
// Ranks outside our scale-up domain (`Transport::kHasRemote`: virtual nodes, or GIN) get their
// records, counts and signals through the transport (scaleout.cuh): a record is staged once in our
// window (at its token's place in the staging region: no entry is reused within a kernel, so no
// flush waits in the loop) and put to each remote destination, and the task's arrival signal
// follows its puts on the warp's context; the counts are staged and put before their flag.
// In hybrid mode (`Transport::kHybrid`, forward.cuh) a token goes instead once per remote node, to
// the node's forwarder, with a header of its slots there; the layout also numbers each token's slot
// per node (`node_slot_idx`), and every rank relays what the other nodes' sources sent it.

#include <climits>

#include <deep_ep/common/comm.cuh>
#include <deep_ep/common/copy.cuh>
#include <deep_ep/common/credits.cuh>
#include <deep_ep/common/forward.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/math.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/common/tasks.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

struct DispatchArgs {
    char* window_base;                // this rank's window
    const int4* x;                    // [num_tokens, hidden bytes / 16]
    const int* x_scales;              // [num_tokens, scale bytes / 4] or null
    const int64_t* topk_idx;          // [num_tokens, topk] global expert ids, -1 = none
    int64_t* topk_idx_copy;           // [num_tokens, topk]: the handle's copy of topk_idx (fresh), or null
    const float* topk_weights;        // [num_tokens, topk] or null
    int* slot_idx;                    // [num_tokens, num_ranks]: written (fresh) or read (cached); -1 = not sent
    int* dst_slot_idx;                // [num_tokens, topk]: per lane, the slot at the lane's rank (fresh), or null
    int* layout_scratch;              // [kDispatchScratchInts] (layout.cuh)
    int* num_tokens_per_rank;         // [num_ranks]: written (fresh) or read (cached)
    int* num_recv_tokens_per_expert;  // [num_experts_per_rank], written by a fresh dispatch
    int* counts_out;                  // [num_ranks + num_experts_per_rank + 1] in mapped host memory (recv per
                                      // source, recv per local expert, invalid-input flag), or null
    int* cumulative_stats;            // [num_experts_per_rank] incremented in place, or null
    int* num_masked_lanes;            // [1]: the valid lanes rank masking dropped (fresh), or null
    int num_tokens;
    int num_max_tokens_per_rank;
    int rank;
    int num_experts_per_rank;
    int tokens_per_group;  // a multiple of 32: at most kMaxGroupsPerRank groups, groups x ranks <= kMaxGroupInts
    int tokens_per_task;   // tokens a warp sends between two releases; divides 32
    int arrival_block;     // slots per arrival counter
    int op_hash;           // what this operation is (arrivals.cuh: op_signature)
    int64_t* error_block;
    uint64_t timeout_ns;
    uint64_t* counts_ready;    // with `counts_out`: set to `counts_sequence` (mapped host memory) once they are there
    uint64_t counts_sequence;  // this CPU-sync dispatch's number on the rank, never 0
    int counts_before_sends;   // with `counts_ready`: the count CTA waits for the counts before its sends
    // Hybrid mode (hybrid.cuh): per token and node, the token's index among our tokens
    // that reach the node (-1: none), `[num_tokens, num_hybrid_nodes]`; with 0 nodes (direct mode), null
    int* node_slot_idx;
    int num_hybrid_nodes;
    int* num_tokens_per_node;  // [num_hybrid_nodes]: written (fresh) or read (cached); with 0 nodes, null
    // Hybrid mode, fresh dispatch: what the combine's forwarding needs of what we relay
    // (combine_forward.cuh), `[num_hybrid_nodes, num_max_tokens_per_rank, topk + 1]` and
    // `[num_hybrid_nodes, num_ranks_per_node + 1]`; else null
    int* forward_map;
    int* forward_counts;
};

// The nodes (bit n) whose ranks include one of `ranks` (bit d): `num_nodes` nodes of `kNumRanks / num_nodes`
template <int kNumRanks>
__device__ __forceinline__ uint32_t token_node_mask(uint64_t ranks, int num_nodes) {
    const int num_ranks_per_node = kNumRanks / num_nodes;
    const uint64_t node_ranks = num_ranks_per_node >= 64 ? ~0ull : (1ull << num_ranks_per_node) - 1;
    uint32_t nodes = 0;
    for (int n = 0; n < num_nodes; ++n)
        if ((ranks >> (n * num_ranks_per_node)) & node_ranks) nodes |= 1u << n;
    return nodes;
}

// The destination ranks of token t (bit d: one of its experts lives on d, and d is not among
// `dropped_ranks`); sets `is_bad` for an expert id outside [-1, num_experts) or an expert repeated
// in the row.
template <int kNumRanks, int kNumTopk>
__device__ __forceinline__ uint64_t token_rank_mask(const int64_t* topk_idx, int t, int num_experts_per_rank,
                                                    uint64_t dropped_ranks, bool& is_bad) {
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
    return mask & ~dropped_ranks;
}

// The first invalid (row, lane) of `topk_idx` in row-major order goes to the error block, for the
// host's message. Every thread of one CTA calls it.
template <int kNumTopk>
__device__ __forceinline__ void report_invalid_topk(const int64_t* topk_idx, int num_tokens, int64_t num_experts,
                                                    int64_t* error_block) {
    __shared__ unsigned long long first_bad;
    if (threadIdx.x == 0) first_bad = ULLONG_MAX;
    __syncthreads();
    for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) {
        for (int k = 0; k < kNumTopk; ++k) {
            const int64_t expert = topk_idx[static_cast<int64_t>(t) * kNumTopk + k];
            bool is_bad = expert < -1 or expert >= num_experts;
            for (int j = 0; j < k; ++j)
                is_bad |= expert >= 0 and expert == topk_idx[static_cast<int64_t>(t) * kNumTopk + j];
            if (is_bad) {
                atomicMin(&first_bad, static_cast<unsigned long long>(t) * kNumTopk + k);
                break;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 and first_bad != ULLONG_MAX) {
        const int64_t value = topk_idx[first_bad];
        const bool out_of_range = value < -1 or value >= num_experts;
        report_input_error(error_block, static_cast<int64_t>(first_bad / kNumTopk),
                           static_cast<int64_t>(first_bad % kNumTopk), value,
                           out_of_range ? kInputOutOfRange : kInputRepeated);
    }
}

// The kernel's work on one of its issuing CTAs; `transport` is the warp's.
template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads, bool kCached,
          bool kRankMasking, typename Transport>
__device__ __forceinline__ void dispatch_body(const DispatchArgs& args, const Transport& transport,
                                              const Scaleout<Transport::kHasRemote>& scaleout, const FaultSink& fault) {
    using Record = DispatchRecord<kHiddenBytes, kNumScaleBytes, kNumTopk>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kRanksPerLane = ceil_div(kNumRanks, 32);
    constexpr int kHiddenVectors = kHiddenBytes / 16;
    constexpr int kScaleVectorsEnd = Record::kMetaOffset / 16;
    constexpr int kRecordVectors = Record::kBytes / 16;
    constexpr int kNumScaleInts = kNumScaleBytes / 4;
    // A record that fits 16 vectors per lane (FP8) goes in one batch of loads: one load round trip
    // per token. Larger ones (BF16) move 16 vectors per lane too in the cached kernel, but would
    // spill in the fresh one, nor with more than 2 destinations (bench/NOTES.md has the figures).
    // Fewer in flight when many destination pointers share the registers.
    constexpr bool kOneBatch = kRecordVectors <= 32 * 2 * kCopyUnroll;
    constexpr int kUnroll = kNumRanks > 8                                 ? kCopyUnroll / 4
                            : kNumRanks > 4                               ? kCopyUnroll / 2
                            : (kOneBatch or (kCached and kNumRanks <= 2)) ? 2 * kCopyUnroll
                                                                          : kCopyUnroll;
    // A warp moves one part of a record at a time (one batch of loads), so the parts of a token
    // spread over many warps instead of queueing behind each other in one
    constexpr int kNumParts = num_copy_parts<kRecordVectors, kUnroll>();
    constexpr int kGroupsPerLane = kMaxGroupsPerRank / 32;
    static_assert(kMaxGroupsPerRank % 32 == 0, "whole groups per lane");
    static_assert(kNumRanks <= kMaxRanks, "too many ranks");

    __shared__ void* peer_windows[kNumRanks];
    __shared__ int rank_total[kNumRanks];
    // Fresh dispatch: the first slot of every (token group, destination), and the CTA's tokens per
    // expert
    __shared__ int group_base[kCached ? 1 : kMaxGroupInts];
    __shared__ int cta_expert_counts[kCached ? 1 : kMaxSharedExpertCounts];
    __shared__ int num_recv[kNumRanks];
    // Hybrid mode: our tokens per node (the forward records each forwarder gets; fresh dispatch)
    constexpr bool kForward = Transport::kHybrid;
    __shared__ int node_total[kForward and not kCached ? 32 : 1];
    char* own_window = args.window_base;
    const RankMask<kRankMasking> mask = load_rank_mask<kRankMasking>(own_window, args.rank);
    const uint64_t dropped_ranks = mask.dropped_ranks();
    // This operation's epoch (the number of operations this rank completed on the buffer), read
    // before anything can change it: the grid barrier's tag and the signature of our count flags
    const int epoch = *reinterpret_cast<const int*>(own_window + kEpochOffset);
    const uint32_t signature = op_signature(epoch, args.op_hash);
    // Peers' windows take our records once they are done with what we sent before (their count
    // flags and arrival counters are zero again)
    if (!open_peer_windows<kNumRanks>(own_window, peer_windows, args.rank, kPhaseDispatchEntry, fault, args.timeout_ns,
                                      mask, scaleout))
        return;
    // Every destination's epilogue checks that we run the same operation before it reads our records
    post_op_signature<kNumRanks>(peer_windows, args.rank, signature, mask, transport, scaleout);

    const int channel = blockIdx.x, num_channels = num_issuing_ctas<Transport>();
    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    const int num_tokens = args.num_tokens, num_local_experts = args.num_experts_per_rank;
    const int tokens_per_group = args.tokens_per_group;
    const int num_groups = ceil_div(num_tokens, tokens_per_group);
    auto group_end = [&](int g) { return min(num_tokens, (g + 1) * tokens_per_group); };
    bool is_bad = false;
    // The layout's columns: the destination ranks, then in hybrid mode the nodes, whose slots number
    // our tokens to each node (where they wait at its forwarder)
    const int num_nodes = Transport::kHybrid ? args.num_hybrid_nodes : 0;
    const int num_columns = kNumRanks + num_nodes;
    // Hybrid mode: where the forwarding words are, in shared memory (the sends hold many registers)
    __shared__ Forwarding fw;
    if constexpr (kForward) {
        if (threadIdx.x == 0)
            fw = Forwarding(scaleout, args.rank, kNumRanks, Record::kBytes, args.num_max_tokens_per_rank);
        __syncthreads();
    }

    if constexpr (not kCached) {
        int* scratch = args.layout_scratch;
        // The grid barrier's tag: this operation's epoch, which no earlier fresh dispatch of the buffer had
        const int barrier_tag = static_cast<int>(static_cast<unsigned>(epoch) + 1u);
        int* group_counts = scratch + kScratchGroupCounts;  // [group][column]
        // Tokens per expert are counted per CTA in shared memory, then added to the device-wide
        // counters once per (CTA, expert): the counters of all experts share a few L2 lines, whose
        // slices serialize atomics (one per (token, lane) made the count pass slow: bench/NOTES.md).
        // Experts past the shared counters (more than 4 ranks of 1024) add directly.
        const int num_shared_experts = min(num_local_experts * kNumRanks, kMaxSharedExpertCounts);
        for (int e = threadIdx.x; e < num_shared_experts; e += kNumThreads) cta_expert_counts[e] = 0;
        __syncthreads();
        // Every warp counts whole groups (any of them: only the counts leave this pass), adds its
        // tokens per expert to the CTA's counts and validates its rows
        int num_dropped = 0;  // by this lane (rank masking)
        for (int g = channel * kNumWarps + warp_idx; g < num_groups; g += num_channels * kNumWarps) {
            int num_hits[kRanksPerLane] = {};
            int num_node_hits = 0;  // lane n: node n's
            for (int base = g * tokens_per_group; base < group_end(g); base += 32) {
                if (args.topk_idx_copy != nullptr) {
                    // The handle's copy of these rows, made here: a copy launch of its own costs the
                    // host as much as a kernel's
                    const int64_t first = static_cast<int64_t>(base) * kNumTopk;
                    const int num_words = (min(base + 32, group_end(g)) - base) * kNumTopk;
                    for (int i = lane_idx; i < num_words; i += 32)
                        args.topk_idx_copy[first + i] = __ldg(args.topk_idx + first + i);
                }
                const int t = base + lane_idx;
                bool is_bad_row = false;
                const uint64_t ranks = t < group_end(g)
                                           ? token_rank_mask<kNumRanks, kNumTopk>(args.topk_idx, t, num_local_experts,
                                                                                  dropped_ranks, is_bad_row)
                                           : 0;
                is_bad |= is_bad_row;
                if (t < group_end(g) and not is_bad_row) {
#pragma unroll
                    for (int k = 0; k < kNumTopk; ++k) {
                        // Two calls, not one on a selected pointer: a shared-memory add then compiles to
                        // ATOMS rather than a generic atomic
                        const int64_t expert = __ldg(args.topk_idx + static_cast<int64_t>(t) * kNumTopk + k);
                        if constexpr (kRankMasking) {
                            if (expert >= 0 and (dropped_ranks >> (expert / num_local_experts)) & 1) {
                                ++num_dropped;
                                continue;
                            }
                        }
                        if (expert >= kMaxSharedExpertCounts)
                            atomicAdd(scratch + kScratchExpertCounts + expert, 1);
                        else if (expert >= 0)
                            atomicAdd(cta_expert_counts + expert, 1);
                    }
                }
#pragma unroll
                for (int d = 0; d < kNumRanks; ++d) {
                    const int hits = __popc(__ballot_sync(0xffffffff, (ranks >> d) & 1));
                    if (lane_idx == d % 32) num_hits[d / 32] += hits;
                }
                if constexpr (Transport::kHybrid) {
                    const uint32_t nodes = num_nodes > 0 ? token_node_mask<kNumRanks>(ranks, num_nodes) : 0;
                    for (int n = 0; n < num_nodes; ++n) {
                        const int hits = __popc(__ballot_sync(0xffffffff, (nodes >> n) & 1));
                        if (lane_idx == n) num_node_hits += hits;
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < kRanksPerLane; ++j)
                if (j * 32 + lane_idx < kNumRanks) group_counts[g * num_columns + j * 32 + lane_idx] = num_hits[j];
            if constexpr (Transport::kHybrid)
                if (lane_idx < num_nodes) group_counts[g * num_columns + kNumRanks + lane_idx] = num_node_hits;
        }
        if constexpr (kRankMasking)
            if (num_dropped != 0) atomicAdd(scratch + kScratchMaskedLanes, num_dropped);
        is_bad = __syncthreads_or(is_bad);
        if (threadIdx.x == 0) scratch[kScratchChannelBad + channel] = is_bad;
        for (int e = threadIdx.x; e < num_shared_experts; e += kNumThreads)
            if (cta_expert_counts[e] != 0) atomicAdd(scratch + kScratchExpertCounts + e, cta_expert_counts[e]);

        if (!grid_barrier(scratch + kScratchArrive, scratch + kScratchGeneration, barrier_tag, num_channels, fault,
                          kPhaseDispatchGrid, args.rank, args.timeout_ns))
            return;
        // Per destination (one warp each), an exclusive scan of the group counts in token order gives
        // every group its first slot (every CTA scans them all: any of its warps may send any group).
        // Lane l holds groups [l * kGroupsPerLane, (l + 1) * kGroupsPerLane), so each warp loads its
        // counts in one batch, issued with the invalid-row flags' loads (L2 loads, `.cg`, ordered
        // after the barrier's acquire), and only the lanes' sums go through the shuffles.
        int any_bad = 0;
        for (int c = threadIdx.x; c < num_channels; c += kNumThreads)
            any_bad |= __ldcg(scratch + kScratchChannelBad + c);
        for (int d = warp_idx; d < num_columns; d += kNumWarps) {
            int counts[kGroupsPerLane];
#pragma unroll
            for (int k = 0; k < kGroupsPerLane; ++k) {
                const int g = lane_idx * kGroupsPerLane + k;
                counts[k] = g < num_groups ? __ldcg(group_counts + g * num_columns + d) : 0;
            }
            int lane_sum = 0;
#pragma unroll
            for (int k = 0; k < kGroupsPerLane; ++k) lane_sum += counts[k];
            int inclusive = lane_sum;
#pragma unroll
            for (int offset = 1; offset < 32; offset *= 2) {
                const int below = __shfl_up_sync(0xffffffff, inclusive, offset);
                if (lane_idx >= offset) inclusive += below;
            }
            int first = inclusive - lane_sum;
#pragma unroll
            for (int k = 0; k < kGroupsPerLane; ++k) {
                const int g = lane_idx * kGroupsPerLane + k;
                if (g < num_groups) group_base[g * num_columns + d] = first;
                first += counts[k];
            }
            if (lane_idx == 31) {
                if (not Transport::kHybrid or d < kNumRanks)
                    rank_total[d] = inclusive;
                else if constexpr (kForward and not kCached)
                    node_total[d - kNumRanks] = inclusive;
            }
        }
        is_bad = __syncthreads_or(any_bad);
        if constexpr (kRankMasking) {
            // Every CTA added its dropped lanes before the barrier; the next fresh dispatch starts from zero
            if (channel == 0 and threadIdx.x == 0) {
                if (args.num_masked_lanes != nullptr) *args.num_masked_lanes = __ldcg(scratch + kScratchMaskedLanes);
                scratch[kScratchMaskedLanes] = 0;
            }
        }
        if (channel == 0 and threadIdx.x < kNumRanks)
            args.num_tokens_per_rank[threadIdx.x] = is_bad ? 0 : rank_total[threadIdx.x];
        if constexpr (kForward)
            if (channel == 0 and threadIdx.x < num_nodes)
                args.num_tokens_per_node[threadIdx.x] = is_bad ? 0 : node_total[threadIdx.x];
        if (is_bad) {
            // Nothing is sent: the handle says so (every slot -1), and the host learns the first bad value
            const int64_t stride = static_cast<int64_t>(num_channels) * kNumThreads;
            for (int64_t j = static_cast<int64_t>(channel) * kNumThreads + threadIdx.x;
                 j < static_cast<int64_t>(num_tokens) * kNumRanks; j += stride)
                args.slot_idx[j] = -1;
            if (args.dst_slot_idx != nullptr)
                for (int64_t j = static_cast<int64_t>(channel) * kNumThreads + threadIdx.x;
                     j < static_cast<int64_t>(num_tokens) * kNumTopk; j += stride)
                    args.dst_slot_idx[j] = -1;
            if constexpr (Transport::kHybrid)
                for (int64_t j = static_cast<int64_t>(channel) * kNumThreads + threadIdx.x;
                     j < static_cast<int64_t>(num_tokens) * num_nodes; j += stride)
                    args.node_slot_idx[j] = -1;
            if (channel == 0)
                report_invalid_topk<kNumTopk>(args.topk_idx, num_tokens,
                                              static_cast<int64_t>(num_local_experts) * kNumRanks, args.error_block);
        }
    }

    // Tell destinations channel, channel + grid, ... how many tokens, and (fresh) how many per local
    // expert, they get from us
    for (int d = channel; d < kNumRanks; d += num_channels) {
        if (mask.skips(d)) continue;  // the same on every thread
        char* peer = static_cast<char*>(peer_windows[d]);
        // A remote destination's counts are staged here and put, before their flag's signal
        const bool is_remote = scaleout.is_remote(d);
        if constexpr (not kCached) {
            // Hand over our per-expert counts for `d` and return their scratch to zero
            int* counts = is_remote
                              ? scaleout.count_staging(d)
                              : reinterpret_cast<int*>(peer + kRecvExpertCountOffset) + args.rank * kMaxLocalExperts;
            int* pending = args.layout_scratch + kScratchExpertCounts + d * num_local_experts;
            for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
                counts[e] = is_bad ? 0 : __ldcg(pending + e);
                pending[e] = 0;
            }
        }
        __syncthreads();
        if constexpr (kForward) {
            if (is_remote) {
                if (threadIdx.x < 32) {
                    // Hybrid mode: to `d`'s forwarder, which passes them on (forward.cuh); the one of the node
                    // that is `d` itself also learns how many forward records we send it
                    const int num_sent = kCached ? args.num_tokens_per_rank[d] : (is_bad ? 0 : rank_total[d]);
                    const int count = min(max(num_sent, 0), args.num_max_tokens_per_rank);
                    const int dst_node = d / fw.num_ranks_per_node, forwarder = fw.forwarder(dst_node);
                    const int pair = fw.rank_of(fw.node, d % fw.num_ranks_per_node);
                    if constexpr (not kCached)
                        transport.put_warp(lane_idx, forwarder, forward_expert_counts_offset(scaleout, pair),
                                           scaleout.count_staging_offset(d), align_up(num_local_experts * 4, 16));
                    if (threadIdx.x == 0) {
                        transport.signal_add(forwarder, forward_count_flag_offset(scaleout, pair),
                                             count_flag(signature, count));
                        if (d == forwarder) {
                            const int num_records =
                                kCached ? args.num_tokens_per_node[dst_node] : (is_bad ? 0 : node_total[dst_node]);
                            transport.signal_add(
                                forwarder, forward_record_flag_offset(scaleout, fw.node),
                                count_flag(signature, min(max(num_records, 0), args.num_max_tokens_per_rank)));
                        }
                    }
                }
                continue;
            }
        }
        if (is_remote and threadIdx.x < 32) {
            const int num_sent = kCached ? args.num_tokens_per_rank[d] : (is_bad ? 0 : rank_total[d]);
            const int count = min(max(num_sent, 0), args.num_max_tokens_per_rank);
            if constexpr (not kCached)
                transport.put_warp(lane_idx, d, kRecvExpertCountOffset + size_t(args.rank) * kMaxLocalExperts * 4,
                                   scaleout.count_staging_offset(d), align_up(num_local_experts * 4, 16));
            if (threadIdx.x == 0)
                transport.signal_add(d, kRecvCountOffset + size_t(args.rank) * 8, count_flag(signature, count));
        } else if (threadIdx.x == 0) {
            const int num_sent = kCached ? args.num_tokens_per_rank[d] : (is_bad ? 0 : rank_total[d]);
            const int count = min(max(num_sent, 0), args.num_max_tokens_per_rank);
            // A fresh count is released after the per-expert counts; a cached one guards nothing (a
            // fence would hold back this CTA's sends), and the flag is one 64-bit store
            if constexpr (not kCached) fence_acq_rel_sys();
            st_relaxed_sys_u64(count_flags(peer) + args.rank, count_flag(signature, count));
        }
    }
    // The epilogue may launch now (programmatic dependent launch); it follows the arrival counters
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
                    words[q] = word < kNumScaleInts
                                   ? __ldg(args.x_scales + static_cast<int64_t>(t) * kNumScaleInts + word)
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
                    words[q] = args.topk_weights != nullptr
                                   ? __float_as_int(__ldg(args.topk_weights + at + word - kNumTopk))
                                   : 0;
                else
                    words[q] = word == 2 * kNumTopk ? t : 0;
            }
        }
        return make_int4(words[0], words[1], words[2], words[3]);
    };

    // One CTA waits for every source's count and sums the per-expert counts they sent. With CPU sync
    // (`counts_before_sends`) it does so before its sends and tells the host at once, which then
    // allocates the outputs and launches the epilogue while the records are still on the wire (other
    // CTAs take its tasks meanwhile); without, after them. Not where a peer's expired wait masks it
    // (rank masking on timeout): a dead peer would hold our sends back for a whole deadline, long
    // enough for the live peers to mask us
    const bool is_count_cta = not kCached and channel == args.rank % num_channels;
    const bool counts_first = args.counts_ready != nullptr and args.counts_before_sends != 0;
    auto receive_counts = [&]() -> bool {
        if (!wait_recv_counts<kNumRanks>(own_window, signature, args.num_max_tokens_per_rank, num_recv, fault,
                                         args.rank, args.timeout_ns, mask))
            return false;
        const int* recv_expert_counts = reinterpret_cast<const int*>(own_window + kRecvExpertCountOffset);
        for (int e = threadIdx.x; e < num_local_experts; e += kNumThreads) {
            int sum = 0;
            // A masked source's words are stale (also one masked by a wait of this dispatch): it sent none
            for (int s = 0; s < kNumRanks; ++s)
                if (not kRankMasking or num_recv[s] != 0)
                    sum += ld_relaxed_sys(recv_expert_counts + s * kMaxLocalExperts + e);
            args.num_recv_tokens_per_expert[e] = sum;
            if (args.counts_out != nullptr) args.counts_out[kNumRanks + e] = sum;
            if (args.cumulative_stats != nullptr and not is_bad) args.cumulative_stats[e] += sum;
        }
        if (args.counts_out != nullptr) {
            if (threadIdx.x < kNumRanks) args.counts_out[threadIdx.x] = num_recv[threadIdx.x];
            if (threadIdx.x == 0) args.counts_out[kNumRanks + num_local_experts] = is_bad;
            // Every thread's counts, then the word the host polls (released to the system)
            __syncthreads();
            if (threadIdx.x == 0 and args.counts_ready != nullptr) {
                fence_acq_rel_sys();
                st_relaxed_sys_u64(args.counts_ready, args.counts_sequence);
            }
        }
        return true;
    };
    // Hybrid mode: first the counts that remote sources sent through us, which our node's ranks
    // (we too) wait for
    if constexpr (kForward)
        if (channel == args.rank % num_channels and
            not forward_counts(fw, scaleout, peer_windows, args.rank, signature, kCached ? 0 : num_local_experts,
                               args.num_max_tokens_per_rank, fault, args.timeout_ns,
                               kCached ? nullptr : args.forward_counts))
            return;
    if constexpr (not kCached)
        if (is_count_cta and counts_first and not receive_counts()) return;

    // Tasks of `tokens_per_task` consecutive tokens (inside one group), one warp each, in order.
    // The last round (one task per warp) takes single tokens: a warp sends at a fraction of the link,
    // and whole tasks left a few warps sending alone at the end (bench/NOTES.md).
    const int tokens_per_task = args.tokens_per_task;
    const int whole_end = max(0, num_tokens - num_channels * kNumWarps) / tokens_per_task * tokens_per_task;
    const int num_whole_tasks = whole_end / tokens_per_task;
    const int num_tasks = num_whole_tasks + num_tokens - whole_end;
    // Hybrid mode: after our own tasks, relay items (source node, block of its forward records), so
    // that warps done sending relay while the others still send
    const int num_relay_blocks = kForward ? ceil_div(args.num_max_tokens_per_rank, args.arrival_block) : 0;
    const int num_all_tasks = num_tasks + (kForward ? fw.num_nodes * num_relay_blocks : 0);
    const TaskQueue tasks(reinterpret_cast<int*>(own_window + kDispatchTaskQueueOffset), num_all_tasks, kNumWarps,
                          num_issuing_ctas<Transport>());
    for (int task = tasks.first(), claimed = 0; (kForward or not is_bad) and task < num_all_tasks;
         task = tasks.next(claimed)) {
        claimed = tasks.claim(task);
        if constexpr (kForward) {
            if (task >= num_tasks) {
                const int m = (task - num_tasks) / num_relay_blocks, block = (task - num_tasks) % num_relay_blocks;
                if (m != fw.node and not relay_forward_block<Record, kNumTopk>(
                                         fw, scaleout, peer_windows, m, block, args.arrival_block, signature,
                                         args.num_max_tokens_per_rank, fault, args.rank, args.timeout_ns,
                                         kCached ? nullptr : args.forward_map, kCached ? nullptr : args.forward_counts,
                                         num_local_experts))
                    break;
                continue;
            }
            if (is_bad) continue;
        }
        const bool is_whole = task < num_whole_tasks;
        const int task_begin = is_whole ? task * tokens_per_task : whole_end + task - num_whole_tasks;
        const int task_end = is_whole ? task_begin + tokens_per_task : task_begin + 1;
        if constexpr (not kCached) {
            // Slots of the task's tokens (lane j: token task_begin + j): the group's first slot,
            // plus the group's hits before the task, plus the task's hits before the token
            const int g = task_begin / tokens_per_group;
            int num_before[kRanksPerLane];
#pragma unroll
            for (int j = 0; j < kRanksPerLane; ++j)
                num_before[j] = j * 32 + lane_idx < kNumRanks ? group_base[g * num_columns + j * 32 + lane_idx] : 0;
            int node_before = 0;  // lane n: node n's
            if constexpr (Transport::kHybrid)
                if (lane_idx < num_nodes) node_before = group_base[g * num_columns + kNumRanks + lane_idx];
            for (int base = g * tokens_per_group; base < task_begin; base += 32) {
                const int t = base + lane_idx;
                bool unused = false;
                const uint64_t ranks = t < task_begin ? token_rank_mask<kNumRanks, kNumTopk>(
                                                            args.topk_idx, t, num_local_experts, dropped_ranks, unused)
                                                      : 0;
#pragma unroll
                for (int d = 0; d < kNumRanks; ++d) {
                    const int hits = __popc(__ballot_sync(0xffffffff, (ranks >> d) & 1));
                    if (lane_idx == d % 32) num_before[d / 32] += hits;
                }
                if constexpr (Transport::kHybrid) {
                    const uint32_t nodes = num_nodes > 0 ? token_node_mask<kNumRanks>(ranks, num_nodes) : 0;
                    for (int n = 0; n < num_nodes; ++n) {
                        const int hits = __popc(__ballot_sync(0xffffffff, (nodes >> n) & 1));
                        if (lane_idx == n) node_before += hits;
                    }
                }
            }
            const int t = task_begin + lane_idx;
            bool unused = false;
            const uint64_t ranks = t < task_end ? token_rank_mask<kNumRanks, kNumTopk>(
                                                      args.topk_idx, t, num_local_experts, dropped_ranks, unused)
                                                : 0;
            const uint32_t lanes_below = (1u << lane_idx) - 1;
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                const bool hit = (ranks >> d) & 1;
                const uint32_t hits = __ballot_sync(0xffffffff, hit);
                const int first = __shfl_sync(0xffffffff, num_before[d / 32], d % 32);
                if (t < task_end)
                    args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d] =
                        hit ? first + __popc(hits & lanes_below) : -1;
            }
            if constexpr (Transport::kHybrid) {
                const uint32_t nodes = num_nodes > 0 ? token_node_mask<kNumRanks>(ranks, num_nodes) : 0;
                for (int n = 0; n < num_nodes; ++n) {
                    const bool hit = (nodes >> n) & 1;
                    const uint32_t hits = __ballot_sync(0xffffffff, hit);
                    const int first = __shfl_sync(0xffffffff, node_before, n);
                    if (t < task_end)
                        args.node_slot_idx[static_cast<int64_t>(t) * num_nodes + n] =
                            hit ? first + __popc(hits & lanes_below) : -1;
                }
            }
            if (t < task_end and args.dst_slot_idx != nullptr) {
                // V2's encoding: `rank * Tmax + slot` at the destination, on the token's highest lane
                // to that destination only (the others, and `-1` lanes, hold -1)
                int lane_rank[kNumTopk];
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k) {
                    const int64_t expert = __ldg(args.topk_idx + static_cast<int64_t>(t) * kNumTopk + k);
                    lane_rank[k] = expert < 0 ? -1 : static_cast<int>(expert / num_local_experts);
                }
#pragma unroll
                for (int k = 0; k < kNumTopk; ++k) {
                    bool is_master = lane_rank[k] >= 0;
#pragma unroll
                    for (int j = k + 1; j < kNumTopk; ++j) is_master = is_master and lane_rank[j] != lane_rank[k];
                    const int slot = is_master ? args.slot_idx[static_cast<int64_t>(t) * kNumRanks + lane_rank[k]] : -1;
                    args.dst_slot_idx[static_cast<int64_t>(t) * kNumTopk + k] =
                        slot < 0 ? -1 : args.rank * args.num_max_tokens_per_rank + slot;
                }
            }
            // The lanes' slot writes, before every lane reads them
            __syncwarp();
        }
        for (int item = 0; item < (task_end - task_begin) * kNumParts; ++item) {
            const int t = task_begin + item / kNumParts, part = item % kNumParts;
            char* dst_records[kNumRanks];
            uint64_t remote_hits = 0;  // the remote destinations of token t (the same on every lane)
#pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                // Plain loads: a fresh dispatch wrote these slots earlier in this kernel
                const int slot = args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d];
                const bool is_sent = slot >= 0 and slot < args.num_max_tokens_per_rank;
                if (is_sent and scaleout.is_remote(d)) remote_hits |= 1ull << d;
                dst_records[d] =
                    (not is_sent or scaleout.is_remote(d))
                        ? nullptr
                        : static_cast<char*>(peer_windows[d]) + kWorkspaceBytes +
                              (static_cast<int64_t>(args.rank) * args.num_max_tokens_per_rank + slot) * Record::kBytes;
            }
            warp_copy_part<kRecordVectors, kUnroll>(
                lane_idx, part, [&](int v) { return load_vector(t, v); },
                [&](int v, const int4& value) {
#pragma unroll
                    for (int d = 0; d < kNumRanks; ++d)
                        if (dst_records[d] != nullptr and (d != args.rank or v >= kScaleVectorsEnd))
                            st_na_v4(reinterpret_cast<int4*>(dst_records[d]) + v, value);
                });
            if constexpr (Transport::kHasRemote) {
                // The part again, into the token's staging entry (a second pass over the input: one
                // more destination in the pass above would hold too many registers)
                if (remote_hits == 0) continue;
                int4* staged = reinterpret_cast<int4*>(scaleout.window() + scaleout.staging_offset(t, Record::kBytes));
                warp_copy_part<kRecordVectors, kUnroll>(
                    lane_idx, part, [&](int v) { return load_vector(t, v); },
                    [&](int v, const int4& value) { st_na_v4(staged + v, value); });
            }
        }
        if constexpr (kForward) {
            // Hybrid mode: every staged record once to each remote node it goes to, at its forwarder,
            // with the header of its slots there
            for (int t = task_begin; t < task_end; ++t) {
#pragma unroll 1
                for (int n = 0; n < num_nodes; ++n) {
                    const int node_slot = args.node_slot_idx[static_cast<int64_t>(t) * num_nodes + n];
                    if (n == fw.node or node_slot < 0 or node_slot >= args.num_max_tokens_per_rank) continue;
                    int* header = reinterpret_cast<int*>(scaleout.window() +
                                                         fw.header_staging_offset(n, t, args.num_max_tokens_per_rank));
                    if (lane_idx < fw.num_ranks_per_node)
                        header[lane_idx] = args.slot_idx[static_cast<int64_t>(t) * kNumRanks + fw.rank_of(n, lane_idx)];
                    const size_t at =
                        fw.record_offset(fw.node, n, node_slot, Record::kBytes, args.num_max_tokens_per_rank);
                    // The body, then the header (one call site: the transport's put inlines large)
#pragma unroll 1
                    for (int piece = 0; piece < 2; ++piece)
                        transport.put_warp(lane_idx, fw.forwarder(n), piece == 0 ? at : at + Record::kBytes,
                                           piece == 0 ? scaleout.staging_offset(t, Record::kBytes)
                                                      : fw.header_staging_offset(n, t, args.num_max_tokens_per_rank),
                                           piece == 0 ? Record::kBytes : fw.header_bytes);
                }
            }
        } else if constexpr (Transport::kHasRemote) {
            // Every staged record to each of its remote destinations (after the copies: their
            // registers are free for the transport's)
            for (int t = task_begin; t < task_end; ++t) {
#pragma unroll 1
                for (int d = 0; d < kNumRanks; ++d) {
                    const int slot = args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d];
                    if (not scaleout.is_remote(d) or slot < 0 or slot >= args.num_max_tokens_per_rank) continue;
                    transport.put_warp(
                        lane_idx, d,
                        kWorkspaceBytes + (size_t(args.rank) * args.num_max_tokens_per_rank + slot) * Record::kBytes,
                        scaleout.staging_offset(t, Record::kBytes), Record::kBytes);
                }
            }
        }
        // Release the task's records (the warp's stores, ordered before the fence by __syncwarp)
        // and count them in: a task's tokens hold consecutive slots at every destination
        __syncwarp();
        fence_acq_rel_sys();
        const int t = task_begin + lane_idx;
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const int slot = t < task_end ? args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d] : -1;
            const uint32_t hits = __ballot_sync(0xffffffff, slot >= 0 and slot < args.num_max_tokens_per_rank);
            if (kForward and scaleout.is_remote(d)) continue;  // its forwarder counts them in
            if (hits != 0 and lane_idx == __ffs(hits) - 1) {
                // A remote destination's on the context of the task's puts, after them
                if (scaleout.is_remote(d))
                    signal_remote_arrivals(transport, scaleout, d, args.rank, slot, __popc(hits), args.arrival_block);
                else
                    signal_arrivals(peer_windows[d], args.rank, slot, __popc(hits), args.arrival_block);
            }
        }
        if constexpr (kForward) {
            // Per remote node, the task's forward records (consecutive forward slots) at its forwarder
            for (int n = 0; n < num_nodes; ++n) {
                const int node_slot =
                    t < task_end and n != fw.node ? args.node_slot_idx[static_cast<int64_t>(t) * num_nodes + n] : -1;
                const uint32_t hits =
                    __ballot_sync(0xffffffff, node_slot >= 0 and node_slot < args.num_max_tokens_per_rank);
                if (hits != 0 and lane_idx == __ffs(hits) - 1)
                    signal_forward_arrivals(transport, scaleout, fw.forwarder(n), fw.node, node_slot, __popc(hits),
                                            args.arrival_block);
            }
        }
    }

    tasks.finish();
    if constexpr (not kCached)
        if (is_count_cta and not counts_first) receive_counts();
}

template <int kNumRanks, int kHiddenBytes, int kNumScaleBytes, int kNumTopk, int kNumThreads, bool kCached,
          bool kRankMasking, typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    dispatch_impl(DispatchArgs args, typename Transport::Args transport_args) {
    // With an emulated NIC, the grid's last CTA is the NIC
    run_with_transport<Transport, kNumThreads>(
        args, transport_args, true, [&](const Transport& transport, const auto& scaleout, const FaultSink& fault) {
            dispatch_body<kNumRanks, kHiddenBytes, kNumScaleBytes, kNumTopk, kNumThreads, kCached, kRankMasking>(
                args, transport, scaleout, fault);
        });
}

}  // namespace deep_ep
