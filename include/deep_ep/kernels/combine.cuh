#pragma once

// Combine, communication part: every received row goes back to its source rank, into that
// source's combine slot (layout.cuh: kCombineLaneSlots) for (this rank, slot), or for (token,
// last lane of this rank), or per lane, over NVLink. In the expanded layout with multiple
// reduction the rows of a token's local experts are first summed here (FP32, top-k lane order,
// one rounding to BF16); without it each local lane's row travels on its own.
// In the plain layout the rows this rank received from itself stay where they are: the combine
// epilogue reads them straight from `x`, so only rows for other ranks are copied.
// Work comes in tasks of `rows_per_task` consecutive slots of one source, one warp each, ordered
// slot-major with the sources interleaved and taken in order (tasks.cuh), so every source's slots
// fill in order over time. After a task the warp releases its rows with one fence and adds them to
// the source's arrival counters: the source's epilogue reduces the rows that have landed while the
// rest are on the wire. There is no exit barrier, and no entry barrier: every CTA starts by
// checking each source's window credit (credits.cuh); CTA 0 then leaves the operation's signature
// in every source's workspace. Row counts and slots come from the handle and are clamped to what the
// window and `x` hold, whatever the handle says. A remote source (scaleout.cuh) gets its rows through
// the transport: each slot's row(s) are staged in the warp's entries of the staging ring, put to the
// source, and the task's arrival signal follows the puts on the warp's context.
// In hybrid mode (`Transport::kHybrid`, combine_forward.cuh: one row per holder) nothing goes to a
// remote source straight: its rows go by stores to its forwarder in our node, and every rank, after
// its own tasks, sums the rows its node's holders left it for the other nodes' sources and puts one
// partial per token to each of them.

#include <deep_ep/common/bf16.cuh>
#include <deep_ep/common/combine_forward.cuh>
#include <deep_ep/common/comm.cuh>
#include <deep_ep/common/copy.cuh>
#include <deep_ep/common/credits.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/common/tasks.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

struct CombineArgs {
    char* window_base;                         // this rank's window
    const int4* x;                             // BF16 rows to send back
    const float* topk_weights;                 // plain: [rows, topk]; expanded: [rows]; may be null
    const int* recv_src_metadata;              // [num_meta_rows, 2 + topk]
    const int* psum_num_recv_tokens_per_rank;  // [num_ranks]
    int num_x_rows;                            // rows of x (and of topk_weights)
    int num_meta_rows;                         // rows of recv_src_metadata
    int num_max_tokens_per_rank;
    int rank;
    int rows_per_task;
    int arrival_block;
    int op_hash;  // what this operation is (arrivals.cuh: op_signature)
    int64_t* error_block;
    uint64_t timeout_ns;
    // Hybrid mode (combine_forward.cuh): the forward map and counts our fresh dispatch wrote; else null
    const int* forward_map;     // [num_nodes, num_max_tokens_per_rank, topk + 1]
    const int* forward_counts;  // [num_nodes, num_ranks_per_node + 1]
};

// Without multiple reduction, a slot for a remote source stages one row per local lane: lane k's is
// the j-th entry when k is the j-th local lane (clamped: metadata of a bad handle stays in the slot's)
template <int kEntriesPerSlot>
__device__ __forceinline__ int staged_lane(int k, uint32_t local_lanes) {
    return min(__popc(local_lanes & ((1u << k) - 1)), kEntriesPerSlot - 1);
}

// The kernel's work on one of its issuing CTAs; `transport` is the warp's.
template <int kNumRanks, int kHidden, int kNumTopk, int kNumRows, int kNumThreads, bool kExpand, bool kRankMasking,
          typename Transport>
__device__ __forceinline__ void combine_body(const CombineArgs& args, const Transport& transport,
                                             const Scaleout<Transport::kHasRemote>& scaleout, const FaultSink& fault) {
    using Slot = CombineSlot<kHidden, kNumTopk>;
    // Hybrid mode's slots are the transport's choice (combine_forward.cuh)
    constexpr bool kLaneSlots =
        Transport::kHybrid ? Transport::kHybridLaneSlots : kCombineLaneSlots<kNumRanks, kNumTopk, kNumRows>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kRowVectors = kHidden / 8;
    constexpr int kMetaCols = 2 + kNumTopk;
    constexpr bool kReduce = kExpand and kNumRows == 1;
    static_assert(not Transport::kHybrid or kNumRows == 1, "hybrid mode's combine sends one row per holder");
    // Hybrid mode's forwarding items share the kernel's registers: half the values in flight
    constexpr int kUnroll = (kReduce ? kCopyUnroll / 2 : kCopyUnroll) / (Transport::kHybrid ? 2 : 1);
    constexpr int kNumParts = num_copy_parts<kRowVectors, kUnroll>();
    static_assert(kExpand or kNumRows == 1, "the plain layout sends one row per token");

    __shared__ void* peer_windows[kNumRanks];
    // Where each source's rows start in `x` (plain) or the metadata, and one past its last
    __shared__ int psum_src[kNumRanks + 1];
    const int num_rows_limit = kExpand ? args.num_meta_rows : args.num_x_rows;
    if (threadIdx.x == 0) {
        psum_src[0] = 0;
        for (int s = 0; s < kNumRanks; ++s)
            psum_src[s + 1] = min(max(args.psum_num_recv_tokens_per_rank[s], psum_src[s]),
                                  min(psum_src[s] + args.num_max_tokens_per_rank, num_rows_limit));
    }
    // Sources' windows take our rows once they are done with what we sent before
    // A masked source sent us nothing (the handle's counts say so): only the waits must leave it out
    const RankMask<kRankMasking> mask = load_rank_mask<kRankMasking>(args.window_base, args.rank);
    const int epoch = *reinterpret_cast<const int*>(args.window_base + kEpochOffset);
    if (!open_peer_windows<kNumRanks>(args.window_base, peer_windows, args.rank, kPhaseCombineEntry, fault,
                                      args.timeout_ns, mask, scaleout))
        return;
    // Every source's epilogue checks that we run the same operation before it reads a row of ours
    post_op_signature<kNumRanks>(peer_windows, args.rank, op_signature(epoch, args.op_hash), mask, transport, scaleout);

    // The epilogue may launch now (programmatic dependent launch); it follows the arrival counters
    griddep_launch_dependents();

    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    // The plain layout sends nothing to this rank itself
    const int num_sources = kExpand ? kNumRanks : kNumRanks - 1;
    int max_rows = 0;
    for (int s = 0; s < kNumRanks; ++s) max_rows = max(max_rows, psum_src[s + 1] - psum_src[s]);
    // Per source, chunks of `rows_per_task` slots, but the last round (one task per warp) takes
    // single slots, as in dispatch.cuh: so that the final sends end together
    const int rows_per_task = args.rows_per_task;
    const int num_warps = num_issuing_ctas<Transport>() * kNumWarps;
    const int whole_end = max(0, max_rows - num_warps / max(1, num_sources)) / rows_per_task * rows_per_task;
    const int num_whole_chunks = whole_end / rows_per_task;
    const int num_tasks = num_sources * (num_whole_chunks + max_rows - whole_end);
    // Hybrid mode: after our own tasks, forwarding items (source node, block of its forward slots)
    const int num_forward_blocks = Transport::kHybrid ? ceil_div(args.num_max_tokens_per_rank, args.arrival_block) : 0;
    int num_all_tasks = num_tasks;
    if constexpr (Transport::kHybrid) num_all_tasks += kNumRanks / num_scaleup_ranks() * num_forward_blocks;
    const TaskQueue tasks(reinterpret_cast<int*>(args.window_base + kCombineTaskQueueOffset), num_all_tasks, kNumWarps,
                          num_issuing_ctas<Transport>());
    // Rows for remote sources: staged in the warp's entries of the ring, `kEntriesPerSlot` per slot
    // (one row, or one per local lane without multiple reduction)
    constexpr bool kRowPerLane = kExpand and not kReduce;
    constexpr int kEntriesPerSlot = kRowPerLane ? kNumRows : 1;
    StagingRing<Transport, Slot::kBytes> ring;
    if constexpr (Transport::kHasRemote)
        ring = StagingRing<Transport, Slot::kBytes>(scaleout, blockIdx.x * kNumWarps + warp_idx, num_warps);
    bool ring_failed = false;  // a flush passed its deadline: nothing more is sent
    for (int task = tasks.first(), claimed = 0; not ring_failed and task < num_all_tasks; task = tasks.next(claimed)) {
        claimed = tasks.claim(task);
        if constexpr (Transport::kHybrid) {
            if (task >= num_tasks) {
                const int m = (task - num_tasks) / num_forward_blocks, block = (task - num_tasks) % num_forward_blocks;
                if (scaleout.is_remote(m * num_scaleup_ranks()) and
                    not reduce_forward_block<kNumRanks, kHidden, kNumTopk, Slot>(
                        transport, scaleout, ring, args.forward_map, args.forward_counts, m, block, args.rank,
                        args.num_max_tokens_per_rank, args.arrival_block, fault, args.timeout_ns))
                    ring_failed = true;
                continue;
            }
        }
        const int source_idx = task % num_sources, chunk = task / num_sources;
        const int s = kExpand or source_idx < args.rank ? source_idx : source_idx + 1;
        const bool is_whole = chunk < num_whole_chunks;
        const int slot_begin = is_whole ? chunk * rows_per_task : whole_end + chunk - num_whole_chunks;
        const int slot_end = min(psum_src[s + 1] - psum_src[s], slot_begin + (is_whole ? rows_per_task : 1));
        if (slot_begin >= slot_end) continue;
        // Where the rows go, under which holder index: the source, under ours; in hybrid mode a remote
        // source's forwarder in our node
        int dst = s, holder_index = args.rank;
        if constexpr (Transport::kHybrid) {
            const CombineDestination destination = combine_destination(scaleout, s, args.rank);
            dst = destination.rank;
            holder_index = destination.holder_index;
        }
        char* source_slots = static_cast<char*>(peer_windows[dst]) + kWorkspaceBytes;
        if constexpr (not kLaneSlots)
            source_slots += static_cast<int64_t>(holder_index) * args.num_max_tokens_per_rank * Slot::kBytes;
        else if constexpr (Transport::kHybrid)  // the lane slots of the source's node
            source_slots +=
                static_cast<int64_t>(s / num_scaleup_ranks()) * args.num_max_tokens_per_rank * kNumTopk * Slot::kBytes;
        const bool is_remote = not Transport::kHybrid and scaleout.is_remote(dst);
        int staged_entry = 0;  // the slot's first staging entry (a remote source)
        for (int item = 0; not ring_failed and item < (slot_end - slot_begin) * kNumParts; ++item) {
            const int part = item % kNumParts, slot_idx = slot_begin + item / kNumParts;
            const int i = psum_src[s] + slot_idx;
            // Per token and lane: the source's token index and our last lane of it (the handle's
            // metadata; one outside the window is no row)
            int token = 0, last_lane = 0;
            if constexpr (kLaneSlots) {
                token = args.recv_src_metadata[static_cast<int64_t>(i) * kMetaCols] - s * args.num_max_tokens_per_rank;
                last_lane = args.recv_src_metadata[static_cast<int64_t>(i) * kMetaCols + 1] - s * kNumTopk;
                if (token < 0 or token >= args.num_max_tokens_per_rank or last_lane < 0 or last_lane >= kNumTopk)
                    continue;
            }
            auto slot_of_lane = [&](int k) {
                return source_slots +
                       (kLaneSlots ? static_cast<int64_t>(token) * kNumTopk + k : slot_idx) * Slot::kBytes;
            };
            char* slot = slot_of_lane(last_lane);
            if constexpr (Transport::kHasRemote) {
                // A remote source's rows go to the slot's staging entries first (the one, or the first
                // of `kEntriesPerSlot`)
                if (is_remote and part == 0 and
                    not ring.next(transport, args.timeout_ns, staged_entry, kEntriesPerSlot)) {
                    if (lane_idx == 0) fault.report_timeout(kPhaseNic, args.rank, args.rank, blockIdx.x, 0, 0);
                    ring_failed = true;
                    break;
                }
                if (is_remote and not kRowPerLane) slot = ring.address(scaleout, staged_entry);
            }
            float* slot_weights = reinterpret_cast<float*>(slot + Slot::kWeightOffset);
            int4* slot_rows = reinterpret_cast<int4*>(slot);

            if constexpr (not kExpand) {
                const int4* src = args.x + static_cast<int64_t>(i) * kRowVectors;
                warp_copy_part<kRowVectors, kUnroll>(
                    lane_idx, part, [&](int v) { return ld_nc_v4(src + v); },
                    [&](int v, const int4& value) { st_na_v4(slot_rows + v, value); });
                if (part == 0 and lane_idx < kNumTopk)
                    slot_weights[lane_idx] = args.topk_weights != nullptr
                                                 ? args.topk_weights[static_cast<int64_t>(i) * kNumTopk + lane_idx]
                                                 : 0.0f;
            } else {
                int expanded_row = lane_idx < kNumTopk
                                       ? args.recv_src_metadata[static_cast<int64_t>(i) * kMetaCols + 2 + lane_idx]
                                       : -1;
                if (expanded_row >= args.num_x_rows) expanded_row = -1;
                const uint32_t local_lanes = __ballot_sync(0xffffffff, expanded_row >= 0);
                if constexpr (Transport::kHasRemote) {
                    // The holder's weights travel in its last lane's row
                    if (is_remote and kRowPerLane) {
                        slot =
                            ring.address(scaleout, staged_entry + staged_lane<kEntriesPerSlot>(last_lane, local_lanes));
                        slot_weights = reinterpret_cast<float*>(slot + Slot::kWeightOffset);
                    }
                }
                if (part == 0 and lane_idx < kNumTopk)
                    slot_weights[lane_idx] =
                        (args.topk_weights != nullptr and expanded_row >= 0) ? args.topk_weights[expanded_row] : 0.0f;
                if constexpr (kReduce) {
                    // Multiple reduction: sum the local lanes here, in lane order
                    float acc[kUnroll][8];
                    reduce_part<kRowVectors, kUnroll>(lane_idx, part, acc, [&](auto accumulate) {
                        uint32_t lanes = local_lanes;
                        while (lanes != 0) {
                            const int k = __ffs(lanes) - 1;
                            lanes &= lanes - 1;
                            accumulate(args.x +
                                       static_cast<int64_t>(__shfl_sync(0xffffffff, expanded_row, k)) * kRowVectors);
                        }
                    });
#pragma unroll
                    for (int u = 0; u < kUnroll; ++u) {
                        const int v = part * 32 * kUnroll + u * 32 + lane_idx;
                        if (v < kRowVectors) st_na_v4(slot_rows + v, round_bf16x8(acc[u]));
                    }
                } else {
                    // No multiple reduction: each local lane's row goes to the slot of its lane
                    uint32_t lanes = local_lanes;
                    while (lanes != 0) {
                        const int k = __ffs(lanes) - 1;
                        lanes &= lanes - 1;
                        const int4* src =
                            args.x + static_cast<int64_t>(__shfl_sync(0xffffffff, expanded_row, k)) * kRowVectors;
                        int4* dst = reinterpret_cast<int4*>(slot_of_lane(k));
                        if constexpr (Transport::kHasRemote)
                            if (is_remote)
                                dst = reinterpret_cast<int4*>(ring.address(
                                    scaleout, staged_entry + staged_lane<kEntriesPerSlot>(k, local_lanes)));
                        warp_copy_part<kRowVectors, kUnroll>(
                            lane_idx, part, [&](int v) { return ld_nc_v4(src + v); },
                            [&](int v, const int4& value) { st_na_v4(dst + v, value); });
                    }
                }
            }
            if constexpr (Transport::kHasRemote) {
                // The slot's rows are staged: put each to the source, where lane k's slot is
                auto slot_offset = [&](int k) -> size_t {
                    const int64_t index =
                        kLaneSlots ? static_cast<int64_t>(token) * kNumTopk + k
                                   : static_cast<int64_t>(args.rank) * args.num_max_tokens_per_rank + slot_idx;
                    return kWorkspaceBytes + size_t(index) * Slot::kBytes;
                };
                if (is_remote and part == kNumParts - 1) {
                    if constexpr (kRowPerLane) {
                        const int expanded_row =
                            lane_idx < kNumTopk
                                ? args.recv_src_metadata[static_cast<int64_t>(i) * kMetaCols + 2 + lane_idx]
                                : -1;
                        const uint32_t local_lanes =
                            __ballot_sync(0xffffffff, expanded_row >= 0 and expanded_row < args.num_x_rows);
                        for (uint32_t lanes = local_lanes; lanes != 0; lanes &= lanes - 1) {
                            const int k = __ffs(lanes) - 1;
                            transport.put_warp(lane_idx, s, slot_offset(k),
                                               ring.offset(staged_entry + staged_lane<kEntriesPerSlot>(k, local_lanes)),
                                               Slot::kBytes);
                        }
                    } else {
                        transport.put_warp(lane_idx, s, slot_offset(last_lane), ring.offset(staged_entry),
                                           Slot::kBytes);
                    }
                }
            }
        }
        // Release the task's rows (the warp's stores, ordered before the fence by __syncwarp); a
        // remote source's signal follows the task's puts on the warp's context
        __syncwarp();
        fence_acq_rel_sys();
        if (lane_idx == 0) {
            if (is_remote)
                signal_remote_arrivals(transport, scaleout, s, args.rank, slot_begin, slot_end - slot_begin,
                                       args.arrival_block);
            else
                signal_arrivals(peer_windows[dst], holder_index, slot_begin, slot_end - slot_begin, args.arrival_block);
        }
    }
    tasks.finish();
}

template <int kNumRanks, int kHidden, int kNumTopk, int kNumRows, int kNumThreads, bool kExpand, bool kRankMasking,
          typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    combine_impl(CombineArgs args, typename Transport::Args transport_args) {
    // With an emulated NIC, the grid's last CTA is the NIC
    run_with_transport<Transport, kNumThreads>(
        args, transport_args, true, [&](const Transport& transport, const auto& scaleout, const FaultSink& fault) {
            combine_body<kNumRanks, kHidden, kNumTopk, kNumRows, kNumThreads, kExpand, kRankMasking>(args, transport,
                                                                                                     scaleout, fault);
        });
}

}  // namespace deep_ep
