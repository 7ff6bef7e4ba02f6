#pragma once

// Hybrid mode's combine (docs/hybrid.md): a token's holders in one node send the home rank one
// partial for the node, across the transport once. A holder whose home `s` is in another node
// stores its row by NVLink into `s`'s forwarder in the holder's node (its rank with `s`'s local
// index), at the holder slot index `node(s) S + local(holder)` and the holder's dispatch slot, as
// a direct-mode holder stores into the home, and adds to the forwarder's arrival counters under the
// same index. A rank never gets rows straight from a remote holder in hybrid mode, so those indices
// of its combine slots and arrival counters are free. With fewer lanes than ranks per node
// (`Transport::kHybridLaneSlots`) the rows land instead per (source node, token, holder's last
// lane), `[S_o][Tmax][K]` slots, as direct mode's lane slots per node. The forwarder sums each
// forwarded token's holder rows in the contract's order (docs/semantics.md: from +0.0 in FP32,
// holders in ascending order of their last lane), rounds once to BF16 and puts the partial into the
// home's partial region `[node(forwarder)][forward slot]`, after the holder (or lane) slots, then
// signals the home's arrival words for the forwarder per block of forward slots.
//
// The forwarder learns a forwarded token's holders from the forward map its fresh dispatch wrote
// while relaying the records (the records do not outlive their dispatch: the next one, perhaps of
// another handle, writes over them); a cached dispatch relays the same routing and keeps it:
//   forward map    [m][forward slot][lane]  per top-k lane of a token the source of node m sent us:
//                                           `(local rank << 24) | slot there` for a lane whose expert
//                                           is in our node, else -1; then (column K) the token's
//                                           index at its source
//   forward counts [m][j] and [m][S]        tokens that source sent our local rank j, and the forward
//                                           records it sent us

#include <cstdint>

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/bf16.cuh>
#include <deep_ep/common/copy.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/math.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>

namespace deep_ep {

constexpr int kForwardSlotBits = 24;

__device__ __forceinline__ int pack_forward_entry(int local_rank, int slot) {
    return (local_rank << kForwardSlotBits) | slot;
}

// The ranks of our node, `S`
__device__ __forceinline__ int num_scaleup_ranks() {
    const ScaleoutWords& words = Scaleout<true>::words();
    return words.scaleup_end - words.scaleup_begin;
}

// Where a holder's rows for home `s` go in hybrid mode: `s` itself in our node, else its forwarder
// in our node; and under which holder index. `rank` is ours.
struct CombineDestination {
    int rank;
    int holder_index;
};
__device__ __forceinline__ CombineDestination combine_destination(const Scaleout<true>& scaleout, int s, int rank) {
    if (not scaleout.is_remote(s)) return {s, rank};
    const int S = num_scaleup_ranks();
    return {Scaleout<true>::words().scaleup_begin + s % S, s - s % S + rank % S};
}

// Where the node partials start among the combine slots: after the holder (or lane) slots
template <int kNumRanks, int kNumTopk, bool kLaneSlots>
__device__ __forceinline__ int64_t partial_slots_begin(int num_nodes, int num_max_tokens) {
    return int64_t(kLaneSlots ? num_nodes * kNumTopk : kNumRanks) * num_max_tokens;
}

// The relay's part of the map, for the forward record at `slot` of source node `m`: lane k's entry
// from the record's top-k id (lane k's expert) and the header's slot at its rank (in lane j for local
// rank j), and the token's index at its source. Every lane calls it.
template <int kNumTopk>
__device__ __forceinline__ void write_forward_map(int* forward_map, int m, int slot, int num_max_tokens,
                                                  const int* record_topk, int src_token, int header_slot,
                                                  int node_first_expert, int num_experts_per_rank,
                                                  int num_ranks_per_node) {
    const int lane_idx = threadIdx.x % 32;
    const int expert = lane_idx < kNumTopk ? ld_relaxed_sys(record_topk + lane_idx) : -1;
    const int local_expert = expert - node_first_expert;
    const bool in_node = expert >= 0 and local_expert >= 0 and local_expert < num_experts_per_rank * num_ranks_per_node;
    const int j = in_node ? local_expert / num_experts_per_rank : 0;
    const int slot_at_j = __shfl_sync(0xffffffff, header_slot, j);
    int* entries = forward_map + (int64_t(m) * num_max_tokens + slot) * (kNumTopk + 1);
    if (lane_idx < kNumTopk) entries[lane_idx] = in_node and slot_at_j >= 0 ? pack_forward_entry(j, slot_at_j) : -1;
    if (lane_idx == 0) entries[kNumTopk] = src_token;
}

// One forwarding item of a combine: the partials of block `block` of the forward slots of source node
// `m` (the tokens of `home`, our rail peer there), each summed from our node's holder rows here and
// put to `home`, then counted in its arrival words for us. `Slot` the combine slot, `kNumRanks` N.
// Every lane of the warp calls it; false when a wait or a flush failed (recorded).
template <int kNumRanks, int kHidden, int kNumTopk, typename Slot, typename Transport, typename Ring>
__device__ __forceinline__ bool reduce_forward_block(const Transport& transport, const Scaleout<true>& scaleout,
                                                     Ring& ring, const int* forward_map, const int* forward_counts,
                                                     int m, int block, int rank, int num_max_tokens, int arrival_block,
                                                     const FaultSink& fault, uint64_t timeout_ns) {
    constexpr int kRowVectors = kHidden / 8;
    // Few values per lane: the kernel's own sends hold most registers
    constexpr int kUnroll = 2;
    constexpr int kNumParts = num_copy_parts<kRowVectors, kUnroll>();
    constexpr bool kLaneSlots = Transport::kHybridLaneSlots;
    const int lane_idx = threadIdx.x % 32;
    const int S = num_scaleup_ranks(), node_first = Scaleout<true>::words().scaleup_begin;
    const int home = m * S + rank % S;
    const int* counts = forward_counts + m * (S + 1);
    const int num_records = min(max(counts[S], 0), num_max_tokens);
    const int begin = block * arrival_block, end = min(num_records, begin + arrival_block);
    if (begin >= end) return true;
    // Lane j: the rows our local rank j sends us for `home` (bounds its slots, and its last block)
    const int num_held = lane_idx < S ? min(max(counts[lane_idx], 0), num_max_tokens) : 0;
    char* slots = scaleout.window() + kWorkspaceBytes;
    for (int i = begin; i < end; ++i) {
        // Lane k: the local rank holding lane k's expert and its slot there, or -1
        const int* entries = forward_map + (int64_t(m) * num_max_tokens + i) * (kNumTopk + 1);
        const int entry = lane_idx < kNumTopk ? entries[lane_idx] : -1;
        int j = entry >= 0 ? entry >> kForwardSlotBits : -1;
        const int slot = entry & ((1 << kForwardSlotBits) - 1);
        const int limit = __shfl_sync(0xffffffff, num_held, j < 0 or j >= S ? 0 : j);
        if (j >= S or slot >= limit) j = -1;
        const uint32_t lanes_of_j = __match_any_sync(0xffffffff, j);
        const bool is_last_lane = j >= 0 and (lane_idx == 31 or (lanes_of_j >> (lane_idx + 1)) == 0);
        // The holder's row is in once its block is (each holder's last lane waits)
        bool ok = true;
        if (is_last_lane) {
            const int b = slot / arrival_block;
            ok = wait_counter(arrival_counters(scaleout.window(), m * S + j) + b,
                              arrival_block_size(limit, b, arrival_block), fault, kPhaseCombineArrival, rank,
                              node_first + j, b, timeout_ns);
        }
        __syncwarp();
        if (not __all_sync(0xffffffff, ok)) return false;
        int staged = 0;
        if (not ring.next(transport, timeout_ns, staged)) {
            if (lane_idx == 0) fault.report_timeout(kPhaseNic, rank, rank, blockIdx.x, 0, 0);
            return false;
        }
        char* partial = ring.address(scaleout, staged);
        const uint32_t last_lanes = __ballot_sync(0xffffffff, is_last_lane);
        // The slot of this lane's holder's row: `[m S + j][slot]`, or with lane slots `[m][token][its
        // last lane]`
        int64_t row_slot = int64_t(m * S + max(j, 0)) * num_max_tokens + slot;
        if constexpr (kLaneSlots) {
            const int token = min(max(entries[kNumTopk], 0), num_max_tokens - 1);
            row_slot = (int64_t(m) * num_max_tokens + token) * kNumTopk + (31 - __clz(lanes_of_j));
        }
        const char* holder_row = slots + row_slot * Slot::kBytes;
        // The contract's order: holders by their last lane, from +0.0, one rounding
        for (int part = 0; part < kNumParts; ++part) {
            float acc[kUnroll][8] = {};
            int4 values[kUnroll];
            for (uint32_t lanes = last_lanes; lanes != 0; lanes &= lanes - 1) {
                const int k = __ffs(lanes) - 1;
                const int4* row =
                    reinterpret_cast<const int4*>(slots + __shfl_sync(0xffffffff, row_slot, k) * Slot::kBytes);
                load_part<kRowVectors, kUnroll, true>(lane_idx, part, row, values);
                add_part<kRowVectors, kUnroll>(lane_idx, part, acc, values);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int v = part * 32 * kUnroll + u * 32 + lane_idx;
                if (v < kRowVectors) st_na_v4(reinterpret_cast<int4*>(partial) + v, round_bf16x8(acc[u]));
            }
        }
        // Lane k's weight from the slot of its holder, which carries the holder's weights (0: not ours)
        if (lane_idx < kNumTopk)
            reinterpret_cast<float*>(partial + Slot::kWeightOffset)[lane_idx] =
                j >= 0 ? reinterpret_cast<const float*>(holder_row + Slot::kWeightOffset)[lane_idx] : 0.0f;
        const size_t at =
            kWorkspaceBytes + (partial_slots_begin<kNumRanks, kNumTopk, kLaneSlots>(kNumRanks / S, num_max_tokens) +
                               int64_t(node_first / S) * num_max_tokens + i) *
                                  Slot::kBytes;
        transport.put_warp(lane_idx, home, at, ring.offset(staged), Slot::kBytes);
    }
    // The block's signal follows its puts on the warp's context
    __syncwarp();
    if (lane_idx == 0) signal_remote_arrivals(transport, scaleout, home, rank, begin, end - begin, arrival_block);
    return true;
}

}  // namespace deep_ep
