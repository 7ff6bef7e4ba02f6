#pragma once

// After combine, on the home rank: for every token, in FP32 from +0.0, bias 0, bias 1, then the
// rows its holder ranks sent back: one partial per holder, holders in ascending order of their last
// top-k lane (without multiple reduction, every lane's row, lanes ascending), with one rounding to
// BF16. This is DeepEP V2's order (its kernel and `refs.combine`) and the contract that
// `deep_ep.reference` models, so the result is bitwise V2's and reproducible. Top-k weights come back from
// the holder of each lane's expert. In the plain layout this rank's own rows are read from the
// combine input itself (combine.cuh does not copy them).
// Work is split into (token, part) items so that small batches still use many warps.
// Launched with programmatic dependent launch while the combine still sends: before reading a
// holder's row it waits for that row's arrival block (arrivals.cuh); tokens are taken in order,
// which is the order their rows land in, by whichever warp asks next (tasks.cuh). An item loads its
// token's slots once (kept in lanes) and this rank's own row before it waits, so only the holders'
// rows are read after they land. The last CTA out returns the arrival counters to zero and posts
// our window credit to the peers (credits.cuh). Before it reads any row, every CTA checks that
// every peer runs this combine too (its signature in our workspace). Counts and slots come from the
// handle and are clamped: a slot outside what its holder sends is no row. A remote holder's rows
// land here by the transport (scaleout.cuh), its signature and arrival counters in the scale-out
// region; its credit goes back through the transport. In hybrid mode (`Hybrid<T>`, one row per
// holder) a remote node's holders come as one partial, summed by our forwarder there
// (combine_forward.cuh) and put into our partial region.

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/bf16.cuh>
#include <deep_ep/common/combine_forward.cuh>
#include <deep_ep/common/copy.cuh>
#include <deep_ep/common/credits.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/common/tasks.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

struct CombineEpilogueArgs {
    char* window_base;
    const int64_t* topk_idx;  // [num_tokens, topk], global expert ids
    const int* slot_idx;      // [num_tokens, num_ranks]
    const int4* bias_0;       // [num_tokens, hidden] BF16 or null
    const int4* bias_1;
    int4* combined_x;
    float* combined_topk_weights;              // null when no weights travel
    const int4* local_x;                       // plain layout: the combine input, whose own rows stay here; else null
    const float* local_topk_weights;           // plain layout: [rows, topk] or null
    const int* psum_num_recv_tokens_per_rank;  // where this rank's own rows start in local_x
    const int* num_tokens_per_rank;            // [num_ranks]: rows each holder sends back
    int num_local_rows;                        // rows of local_x
    int num_tokens;
    int num_max_tokens_per_rank;
    int num_experts_per_rank;
    int rank;
    int arrival_block;
    int op_hash;  // what this operation is (arrivals.cuh: op_signature)
    int64_t* error_block;
    uint64_t timeout_ns;
    // Hybrid mode (`Hybrid<T>` transports): the ranks of a node, whose holders' rows are summed and
    // rounded per node first; the dispatch's `[num_tokens, num_nodes]` forward slots of our tokens and
    // `[num_nodes]` tokens per node, where the partials land; and the forward counts of our fresh
    // dispatch (combine_forward.cuh: the rows our node's holders left us to forward)
    int num_ranks_per_node;
    const int* node_slot_idx;
    const int* num_tokens_per_node;
    const int* forward_counts;
};

// The kernel's work on one of its issuing CTAs; `transport` is the warp's.
template <int kNumRanks, int kHidden, int kNumTopk, int kNumRows, int kNumThreads, bool kRankMasking,
          typename Transport>
__device__ __forceinline__ void combine_epilogue_body(const CombineEpilogueArgs& args, const Transport& transport,
                                                      const Scaleout<Transport::kHasRemote>& scaleout,
                                                      const FaultSink& fault) {
    using Slot = CombineSlot<kHidden, kNumTopk>;
    constexpr bool kHybrid = Transport::kHybrid;
    static_assert(not kHybrid or kNumRows == 1, "hybrid mode's node stage takes one row per holder");
    constexpr bool kLaneSlots =
        kHybrid ? Transport::kHybridLaneSlots : kCombineLaneSlots<kNumRanks, kNumTopk, kNumRows>;
    constexpr int kNumWarps = kNumThreads / 32;
    constexpr int kRowVectors = kHidden / 8;
    constexpr int kUnroll = 4;
    constexpr int kNumParts = num_copy_parts<kRowVectors, kUnroll>();
    constexpr int kRanksPerLane = ceil_div(kNumRanks, 32);
    const RankMask<kRankMasking> mask = load_rank_mask<kRankMasking>(args.window_base, args.rank);
    const int epoch = *reinterpret_cast<const int*>(args.window_base + kEpochOffset);
    bool warp_ok = wait_op_signatures<kNumRanks>(args.window_base, op_signature(epoch, args.op_hash), fault, args.rank,
                                                 args.timeout_ns, mask, scaleout);

    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    // Lane d % 32 watches holder d: how many rows it sends back, the last block seen complete
    int num_sent[kRanksPerLane], ready_block[kRanksPerLane];
#pragma unroll
    for (int j = 0; j < kRanksPerLane; ++j) {
        num_sent[j] = j * 32 + lane_idx < kNumRanks
                          ? min(max(args.num_tokens_per_rank[j * 32 + lane_idx], 0), args.num_max_tokens_per_rank)
                          : 0;
        ready_block[j] = -1;
    }
    const bool has_local_rows = args.local_x != nullptr;
    const int own_rows_begin =
        has_local_rows
            ? min(max(args.rank == 0 ? 0 : args.psum_num_recv_tokens_per_rank[args.rank - 1], 0), args.num_local_rows)
            : 0;
    // Hybrid mode: lane n watches the partials of node n (put by our forwarder there)
    const int num_ranks_per_node = kHybrid ? args.num_ranks_per_node : 1;
    const int num_nodes = kNumRanks / num_ranks_per_node, own_node = args.rank / num_ranks_per_node;
    // The slot of token `t`'s row from holder `d` at lane `k` (layout.cuh: kCombineLaneSlots; in
    // hybrid mode's lane slots, those of our node, combine_forward.cuh)
    auto slot_at = [&](int t, int d, int slot, int k) {
        const int64_t lane_index =
            (kHybrid ? static_cast<int64_t>(own_node) * args.num_max_tokens_per_rank + t : t) * kNumTopk + k;
        const int64_t index = kLaneSlots ? lane_index : static_cast<int64_t>(d) * args.num_max_tokens_per_rank + slot;
        return args.window_base + kWorkspaceBytes + index * Slot::kBytes;
    };
    const int num_partials = kHybrid and lane_idx < num_nodes and lane_idx != own_node
                                 ? min(max(args.num_tokens_per_node[lane_idx], 0), args.num_max_tokens_per_rank)
                                 : 0;
    // Node n's partial of token `t` at forward slot `slot` (lane n's)
    auto partial_at = [&](int n, int slot) {
        return args.window_base + kWorkspaceBytes +
               (partial_slots_begin<kNumRanks, kNumTopk, kLaneSlots>(num_nodes, args.num_max_tokens_per_rank) +
                static_cast<int64_t>(n) * args.num_max_tokens_per_rank + slot) *
                   Slot::kBytes;
    };

    const int num_items = args.num_tokens * kNumParts;
    const TaskQueue items(reinterpret_cast<int*>(args.window_base + kEpilogueTaskQueueOffset), num_items, kNumWarps,
                          num_issuing_ctas<Transport>());
    for (int item = items.first(), claimed = 0; warp_ok and item < num_items; item = items.next(claimed)) {
        claimed = items.claim(item);
        const int t = item / kNumParts, part = item % kNumParts;
        const int64_t expert = lane_idx < kNumTopk ? args.topk_idx[static_cast<int64_t>(t) * kNumTopk + lane_idx] : -1;
        int holder = expert >= 0 ? static_cast<int>(expert / args.num_experts_per_rank) : -1;
        // Lane d % 32: the token's slot at holder d (in our window, or its row in `local_x`), -1
        // for no row (also for a slot past what d sends: the handle's routing was rejected)
        int slot[kRanksPerLane];
#pragma unroll
        for (int j = 0; j < kRanksPerLane; ++j) {
            const int d = j * 32 + lane_idx;
            slot[j] = d < kNumRanks ? args.slot_idx[static_cast<int64_t>(t) * kNumRanks + d] : -1;
            const int limit = (d == args.rank and has_local_rows) ? args.num_local_rows - own_rows_begin : num_sent[j];
            // A holder masked since the dispatch (automatic mode) sends no row: its lanes count as -1
            if (slot[j] >= limit or (d < kNumRanks and mask.skips(d))) slot[j] = -1;
        }
        // Selected, not indexed: `d` is a run-time value, and an indexed register array would go to local memory
        auto slot_of_rank = [&](int d) {
            int value = slot[0];
#pragma unroll
            for (int j = 1; j < kRanksPerLane; ++j)
                if (d / 32 == j) value = slot[j];
            return __shfl_sync(0xffffffff, value, d % 32);
        };
        // The slot of this lane's holder (every lane takes part in the shuffles); a lane whose
        // holder sends no row for this token counts as a `-1` lane
        int holder_slot = -1;
#pragma unroll
        for (int j = 0; j < kRanksPerLane; ++j) {
            const int value = __shfl_sync(0xffffffff, slot[j], (holder < 0 ? 0 : holder) % 32);
            if (holder >= 0 and holder / 32 == j) holder_slot = value;
        }
        if (holder_slot < 0) holder = -1;
        // The last lane of this lane's holder: its slot carries the holder's weights
        const uint32_t lanes_of_holder = __match_any_sync(0xffffffff, holder);
        const int holder_last_lane = 31 - __clz(lanes_of_holder);

        // This rank's own row is here already: load it while the holders' rows may still be on the wire
        const bool is_own_holder = has_local_rows and __ballot_sync(0xffffffff, holder == args.rank) != 0;
        // (not in hybrid mode, whose node stage has no registers left for it: read where it is added)
        int4 own_values[kUnroll];
        if (not kHybrid and is_own_holder)
            load_part<kRowVectors, kUnroll>(
                lane_idx, part,
                args.local_x + static_cast<int64_t>(own_rows_begin + slot_of_rank(args.rank)) * kRowVectors,
                own_values);

        // Wait until every other holder's row of `t` has landed
        bool lane_ok = true;
#pragma unroll
        for (int d = 0; d < kNumRanks; ++d) {
            const bool is_holder = __ballot_sync(0xffffffff, holder == d) != 0;
            // Hybrid mode: a remote holder's row is in its node's partial
            if (kHybrid and scaleout.is_remote(d)) continue;
            if (is_holder and lane_idx == d % 32 and not(d == args.rank and has_local_rows)) {
                const int block = slot[d / 32] / args.arrival_block;
                if (block != ready_block[d / 32]) {
                    lane_ok = wait_arrivals(args.window_base, scaleout, d, block,
                                            arrival_block_size(num_sent[d / 32], block, args.arrival_block), fault,
                                            kPhaseCombineArrival, args.rank, args.timeout_ns);
                    ready_block[d / 32] = block;
                }
            }
        }
        // Hybrid mode: lane n, the forward slot of node n's partial (-1: none), which must have landed
        int node_slot = -1;
        if constexpr (kHybrid) {
            const uint32_t holder_nodes =
                __reduce_or_sync(0xffffffff, holder >= 0 ? 1u << (holder / num_ranks_per_node) : 0u);
            if ((holder_nodes >> lane_idx) & 1 and num_partials > 0) {
                node_slot = args.node_slot_idx[static_cast<int64_t>(t) * num_nodes + lane_idx];
                if (node_slot >= num_partials) node_slot = -1;
                // No block seen complete is kept: one load when it is (the registers are all taken)
                const int block = node_slot / args.arrival_block;
                if (node_slot >= 0)
                    lane_ok = wait_arrivals(args.window_base, scaleout,
                                            lane_idx * num_ranks_per_node + args.rank % num_ranks_per_node, block,
                                            arrival_block_size(num_partials, block, args.arrival_block), fault,
                                            kPhaseCombineArrival, args.rank, args.timeout_ns);
            }
        }
        __syncwarp();
        warp_ok = __all_sync(0xffffffff, lane_ok);
        if (not warp_ok) break;

        // DeepEP V2's order: the biases, then per top-k lane ascending the lane's holder row(s). With
        // one row per holder (a partial) it is added at the holder's last lane, so holders come in
        // ascending order of their last lane; with a row per lane, each lane adds its own row
        float acc[kUnroll][8] = {};
        int4 values[kUnroll];
        for (const int4* bias : {args.bias_0, args.bias_1}) {
            if (bias == nullptr) continue;
            load_part<kRowVectors, kUnroll>(lane_idx, part, bias + static_cast<int64_t>(t) * kRowVectors, values);
            add_part<kRowVectors, kUnroll>(lane_idx, part, acc, values);
        }
        // Hybrid mode (one row per holder): per node, at the node's last lane, the partial of its
        // holders (ascending order of their last lane, from +0.0, rounded once to BF16), so nodes come
        // in ascending order of their last lane (docs/semantics.md): another node's from its
        // forwarder, our own node's summed here. A kernel of its own (`Hybrid<T>`): the node stage's
        // registers would make the direct-mode epilogue over GIN spill
        if constexpr (kHybrid) {
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const int d = __shfl_sync(0xffffffff, holder, k);
                if (d < 0) continue;
                const int node = d / num_ranks_per_node;
                const uint32_t lanes_of_node =
                    __ballot_sync(0xffffffff, holder >= 0 and holder / num_ranks_per_node == node);
                if (k != 31 and (lanes_of_node >> (k + 1)) != 0) continue;
                if (node != own_node) {
                    const int slot_of_node = __shfl_sync(0xffffffff, node_slot, node);
                    if (slot_of_node < 0) continue;
                    load_part<kRowVectors, kUnroll, true>(
                        lane_idx, part, reinterpret_cast<const int4*>(partial_at(node, slot_of_node)), values);
                    add_part<kRowVectors, kUnroll>(lane_idx, part, acc, values);
                    continue;
                }
                float partial[kUnroll][8] = {};
#pragma unroll
                for (int j = 0; j <= k; ++j) {
                    const int d_j = __shfl_sync(0xffffffff, holder, j);
                    const uint32_t lanes_of_d_j = __ballot_sync(0xffffffff, holder == d_j);
                    if (d_j < 0 or d_j / num_ranks_per_node != node or (j != 31 and (lanes_of_d_j >> (j + 1)) != 0))
                        continue;
                    if (d_j == args.rank and has_local_rows) {
                        load_part<kRowVectors, kUnroll>(
                            lane_idx, part,
                            args.local_x + static_cast<int64_t>(own_rows_begin + slot_of_rank(args.rank)) * kRowVectors,
                            values);
                        add_part<kRowVectors, kUnroll>(lane_idx, part, partial, values);
                        continue;
                    }
                    load_part<kRowVectors, kUnroll, true>(
                        lane_idx, part, reinterpret_cast<const int4*>(slot_at(t, d_j, slot_of_rank(d_j), j)), values);
                    add_part<kRowVectors, kUnroll>(lane_idx, part, partial, values);
                }
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) values[u] = round_bf16x8(partial[u]);
                add_part<kRowVectors, kUnroll>(lane_idx, part, acc, values);
            }
        } else {
#pragma unroll
            for (int k = 0; k < kNumTopk; ++k) {
                const int d = __shfl_sync(0xffffffff, holder, k);  // the same on every lane
                if (d < 0) continue;
                const uint32_t lanes_of_d = __ballot_sync(0xffffffff, holder == d);
                const bool is_last_lane = k == 31 or (lanes_of_d >> (k + 1)) == 0;
                if (d == args.rank and has_local_rows) {
                    if (is_last_lane) add_part<kRowVectors, kUnroll>(lane_idx, part, acc, own_values);
                    continue;
                }
                if (kNumRows == 1 and not is_last_lane) continue;
                load_part<kRowVectors, kUnroll, true>(
                    lane_idx, part, reinterpret_cast<const int4*>(slot_at(t, d, slot_of_rank(d), k)), values);
                add_part<kRowVectors, kUnroll>(lane_idx, part, acc, values);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int v = part * 32 * kUnroll + u * 32 + lane_idx;
            if (v < kRowVectors) args.combined_x[static_cast<int64_t>(t) * kRowVectors + v] = round_bf16x8(acc[u]);
        }

        if (part == 0 and args.combined_topk_weights != nullptr) {
            // Lanes past top-k write nothing
            float weight = 0.0f;
            // Hybrid mode: the forward slot of the node of this lane's holder
            const int slot_of_node =
                kHybrid ? __shfl_sync(0xffffffff, node_slot, holder >= 0 ? holder / num_ranks_per_node : 0) : -1;
            if (holder == args.rank and has_local_rows) {
                if (args.local_topk_weights != nullptr)
                    weight = args.local_topk_weights[static_cast<int64_t>(own_rows_begin + holder_slot) * kNumTopk +
                                                     lane_idx];
            } else if (kHybrid and holder >= 0 and holder / num_ranks_per_node != own_node) {
                // Another node's lanes: from its partial
                if (slot_of_node >= 0)
                    weight = reinterpret_cast<const float*>(partial_at(holder / num_ranks_per_node, slot_of_node) +
                                                            Slot::kWeightOffset)[lane_idx];
            } else if (holder >= 0) {
                weight = reinterpret_cast<const float*>(slot_at(t, holder, holder_slot, holder_last_lane) +
                                                        Slot::kWeightOffset)[lane_idx];
            }
            if (lane_idx < kNumTopk) args.combined_topk_weights[static_cast<int64_t>(t) * kNumTopk + lane_idx] = weight;
        }
    }

    // The last CTA out also makes the kernel complete only after the combine kernel, as a plain
    // launch would
    // Hybrid mode: a remote rank sent us rows only as the forwarder of its node (a partial per forward
    // slot), and our node's holders left us rows under its index to forward (combine_forward.cuh)
    auto clamp_count = [&](int count) { return min(max(count, 0), args.num_max_tokens_per_rank); };
    if constexpr (kHybrid) {
        finish_epilogue<kNumRanks>(
            args.window_base, args.rank, args.arrival_block, false, num_issuing_ctas<Transport>(), fault, mask,
            transport, scaleout,
            [&](int d) {
                if (not scaleout.is_remote(d)) return clamp_count(args.num_tokens_per_rank[d]);
                return d % num_ranks_per_node == args.rank % num_ranks_per_node
                           ? clamp_count(args.num_tokens_per_node[d / num_ranks_per_node])
                           : 0;
            },
            [&](int d) {
                return clamp_count(
                    args.forward_counts[(d / num_ranks_per_node) * (num_ranks_per_node + 1) + d % num_ranks_per_node]);
            });
    } else {
        finish_epilogue<kNumRanks>(args.window_base, args.rank, args.arrival_block, false,
                                   num_issuing_ctas<Transport>(), fault, mask, transport, scaleout,
                                   [&](int d) { return clamp_count(args.num_tokens_per_rank[d]); });
    }
}

template <int kNumRanks, int kHidden, int kNumTopk, int kNumRows, int kNumThreads, bool kRankMasking,
          typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    combine_epilogue_impl(CombineEpilogueArgs args, typename Transport::Args transport_args) {
    // With an emulated NIC, the grid's last CTA is the NIC
    // Inlined by force: a call would take the transport's state by reference, into a stack frame
    // (472 bytes over GIN GDAKI in hybrid mode, where the body is largest)
    run_with_transport<Transport, kNumThreads>(
        args, transport_args, false,
        [&](const Transport& transport, const auto& scaleout, const FaultSink& fault) __attribute__((always_inline)) {
            combine_epilogue_body<kNumRanks, kHidden, kNumTopk, kNumRows, kNumThreads, kRankMasking>(args, transport,
                                                                                                     scaleout, fault);
        });
}

}  // namespace deep_ep
