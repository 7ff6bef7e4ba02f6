#pragma once

// Hybrid mode's forwarding (docs/hybrid.md): a source sends each token across the transport once
// per destination node, to its forwarder there (the rank of that node with the source's local
// index), as a forward record: the dispatch record, then a header of one int32 per rank of the node,
// the token's slot at that rank (-1: the token does not go there). The forwarder copies each record
// by stores into the normal receive slot of every rank of its node that the header names, and adds
// to their arrival counters for the source; it does the same with the source's counts. So every word
// a receiving rank reads for a remote source has one writer (the source's forwarder), and the
// dispatch epilogue reads the same words as in direct mode.
//
// The forwarder's words, in its scale-out region (per source node `m`, which writes them through
// the transport; the forwarder's epilogue resets them, before its credit lets `m` write again):
//   forward count flags [m][j]   the count flag `m`'s source sends to local rank j of our node
//   forward expert counts [m][j] its per-expert counts for j
//   forward record flag [m]      a count flag of the forward records `m`'s source sends us
//   forward arrivals [m][block]  the records of each block of forward slots that landed
// In the data region, after the dispatch's records (one block per source rank), the forward region:
// [other node m][forward slot] records with their headers, for the nodes other than ours (our own
// node's sources store into their destinations directly). The combine's slots reuse that memory:
// a forwarder's credit, which lets a holder write its slots, comes after its dispatch kernel ended.
// The source stages each header after its staged records: [node][token] at the end of the staging.

#include <cstdint>

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/combine_forward.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/math.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>

namespace deep_ep {

// Where the forwarding words of a window are, and the shape of the nodes. Lives in registers.
struct Forwarding {
    int num_ranks_per_node;  // S
    int num_nodes;
    int node;                // ours
    int local_rank;          // ours, inside the node
    int header_bytes;        // align(4 S, 16)
    int64_t forward_offset;  // window offset of the forward region (the same at every forwarder)
    int64_t header_staging;  // window offset of the headers' staging ([node][token])

    // `rank` of `num_ranks`; the scale-out region `scaleout`; records of `record_bytes` and
    // `num_max_tokens` per rank (the call's: they place the forward region after its records)
    Forwarding() = default;
    __device__ __forceinline__ Forwarding(const Scaleout<true>& scaleout, int rank, int num_ranks, int record_bytes,
                                          int num_max_tokens) {
        const ScaleoutWords& words = Scaleout<true>::words();
        num_ranks_per_node = words.scaleup_end - words.scaleup_begin;
        num_nodes = num_ranks / num_ranks_per_node;
        node = rank / num_ranks_per_node;
        local_rank = rank % num_ranks_per_node;
        header_bytes = align_up(4 * num_ranks_per_node, 16);
        forward_offset = kWorkspaceBytes + int64_t(num_ranks) * num_max_tokens * record_bytes;
        header_staging = scaleout.region_offset() + kStagingRingOffset + int64_t(num_max_tokens) * record_bytes;
    }

    __device__ __forceinline__ int forwarder(int dst_node) const { return dst_node * num_ranks_per_node + local_rank; }
    __device__ __forceinline__ int rank_of(int node_idx, int local) const {
        return node_idx * num_ranks_per_node + local;
    }

    // The forward record of source node `m` at forward slot `slot`, in the window of a forwarder of
    // node `forwarder_node` (never `m`: the blocks skip the forwarder's own node)
    __device__ __forceinline__ size_t record_offset(int m, int forwarder_node, int slot, int record_bytes,
                                                    int num_max_tokens) const {
        const int block = m < forwarder_node ? m : m - 1;
        return static_cast<size_t>(forward_offset +
                                   (int64_t(block) * num_max_tokens + slot) * (int64_t(record_bytes) + header_bytes));
    }
    __device__ __forceinline__ size_t header_staging_offset(int dst_node, int t, int num_max_tokens) const {
        return static_cast<size_t>(header_staging + (int64_t(dst_node) * num_max_tokens + t) * header_bytes);
    }
};

// Window offsets (inside the scale-out region, the same on every rank) of the forwarding words
__device__ __forceinline__ size_t forward_count_flag_offset(const Scaleout<true>& scaleout, int pair) {
    return scaleout.word_offset(kForwardCountFlagOffset, pair);
}
__device__ __forceinline__ size_t forward_record_flag_offset(const Scaleout<true>& scaleout, int m) {
    return scaleout.word_offset(kForwardRecordFlagOffset, m);
}
__device__ __forceinline__ size_t forward_arrival_offset(const Scaleout<true>& scaleout, int m, int block) {
    return scaleout.word_offset(kForwardArrivalOffset, m * kMaxArrivalBlocks + block);
}
__device__ __forceinline__ size_t forward_expert_counts_offset(const Scaleout<true>& scaleout, int pair) {
    return static_cast<size_t>(scaleout.region_offset() + kForwardExpertCountOffset +
                               int64_t(pair) * kMaxLocalExperts * 4);
}

// A count flag's wait on any 64-bit word (the forwarder's words): its count, or -1 when the wait
// failed or the flag carries another signature (recorded, naming `source`). One thread.
__device__ __forceinline__ int wait_forward_flag(const uint64_t* flag, int source, uint32_t signature,
                                                 int num_max_tokens, const FaultSink& fault, int rank,
                                                 uint64_t timeout_ns) {
    uint64_t value = ld_acquire_sys_u64(flag);
    if (static_cast<uint32_t>(value) == 0) {
        const uint64_t deadline = global_timer_ns() + timeout_ns;
        while (static_cast<uint32_t>(value = ld_acquire_sys_u64(flag)) == 0) {
            if (fault.check()) return -1;
            if (global_timer_ns() > deadline) {
                fault.report_timeout(kPhaseForwardCounts, rank, source, blockIdx.x, 0, 1);
                return -1;
            }
            __nanosleep(kPollBackoffNs);
        }
    }
    if (fault.check()) return -1;
    if (static_cast<uint32_t>(value >> 32) != signature) {
        fault.report_timeout(kPhaseOpMismatch, rank, source, blockIdx.x, static_cast<int>(value >> 32),
                             static_cast<int>(signature));
        return -1;
    }
    return min(max(static_cast<int>(static_cast<uint32_t>(value)) - 1, 0), num_max_tokens);
}

// The count CTA's first step in hybrid mode: the counts every remote source with our local index
// sent through us, to the ranks of our node (ourselves included), as that source would have stored
// them. Before the CTA waits for its own counts, which come this way from those sources (docs/hybrid.md).
// A cached dispatch sends no per-expert counts (`num_local_experts` 0). A fresh one keeps each
// source's token counts for our node's ranks in `map_counts` (combine_forward.cuh: the forward
// counts; null when cached). Every thread of the CTA calls it; false on every thread when a wait failed.
__device__ __forceinline__ bool forward_counts(const Forwarding& fw, const Scaleout<true>& scaleout,
                                               void* const* peer_windows, int rank, uint32_t signature,
                                               int num_local_experts, int num_max_tokens, const FaultSink& fault,
                                               uint64_t timeout_ns, int* map_counts) {
    __shared__ uint64_t flags[kMaxRanks];
    const int S = fw.num_ranks_per_node, num_pairs = fw.num_nodes * S;
    bool ok = true;
    // Thread (m, j): source node m's counts for our local rank j
    if (threadIdx.x < num_pairs) {
        const int m = threadIdx.x / S;
        if (m != fw.node) {
            const uint64_t* flag = scaleout.word(kForwardCountFlagOffset, threadIdx.x);
            const int count = wait_forward_flag(flag, fw.rank_of(m, fw.local_rank), signature, num_max_tokens, fault,
                                                rank, timeout_ns);
            ok = count >= 0;
            flags[threadIdx.x] = ok ? ld_acquire_sys_u64(flag) : 0;
            if (ok and map_counts != nullptr) map_counts[m * (S + 1) + threadIdx.x % S] = count;
        }
    }
    if (not __syncthreads_and(ok)) return false;
    for (int i = threadIdx.x; i < num_pairs * num_local_experts; i += blockDim.x) {
        const int pair = i / num_local_experts, e = i % num_local_experts, m = pair / S;
        if (m == fw.node) continue;
        const int source = fw.rank_of(m, fw.local_rank);
        const int* from =
            reinterpret_cast<const int*>(scaleout.window() + forward_expert_counts_offset(scaleout, pair));
        int* to = reinterpret_cast<int*>(static_cast<char*>(peer_windows[fw.rank_of(fw.node, pair % S)]) +
                                         kRecvExpertCountOffset) +
                  source * kMaxLocalExperts;
        st_relaxed_sys(to + e, ld_relaxed_sys(from + e));
    }
    __syncthreads();
    if (threadIdx.x < num_pairs and threadIdx.x / S != fw.node) {
        const int m = threadIdx.x / S, source = fw.rank_of(m, fw.local_rank);
        // The CTA's per-expert counts (ordered before this thread by the barrier) before the flag
        fence_acq_rel_sys();
        st_relaxed_sys_u64(count_flags(peer_windows[fw.rank_of(fw.node, threadIdx.x % S)]) + source,
                           flags[threadIdx.x]);
    }
    return true;
}

// One relay item: block `block` of the forward records from source node `m`, copied into the receive
// slots of the ranks of our node its headers name, then counted in their arrival counters for the
// source. A fresh dispatch also writes the forward map and the number of records into the forward
// counts (`forward_map`, `map_counts`: combine_forward.cuh; null when cached). `Record` the dispatch
// record. Every lane of the warp calls it; false when a wait failed.
template <typename Record, int kNumTopk>
__device__ __forceinline__ bool relay_forward_block(const Forwarding& fw, const Scaleout<true>& scaleout,
                                                    void* const* peer_windows, int m, int block, int arrival_block,
                                                    uint32_t signature, int num_max_tokens, const FaultSink& fault,
                                                    int rank, uint64_t timeout_ns, int* forward_map, int* map_counts,
                                                    int num_experts_per_rank) {
    constexpr int kRecordBytes = Record::kBytes;
    constexpr int kRecordVectors = kRecordBytes / 16;
    const int lane_idx = threadIdx.x % 32;
    const int source = fw.rank_of(m, fw.local_rank);
    int num_records = 0;
    bool ok = true;
    // Twice the deadline: a source whose sends wait for a third rank's counts (they come first) holds
    // its records back with it, and that source's own wait, which names the third rank, must expire
    // and reach every rank first (a stalled source itself is named a deadline later)
    const uint64_t relay_timeout_ns = 2 * timeout_ns;
    if (lane_idx == 0) {
        num_records = wait_forward_flag(scaleout.word(kForwardRecordFlagOffset, m), source, signature, num_max_tokens,
                                        fault, rank, relay_timeout_ns);
        ok = num_records >= 0;
        const int expected = ok ? arrival_block_size(num_records, block, arrival_block) : 0;
        if (ok and expected > 0) {
            uint64_t* counter = scaleout.word(kForwardArrivalOffset, m * kMaxArrivalBlocks + block);
            ok = wait_counter(counter, expected, fault, kPhaseForwardArrival, rank, source, block, relay_timeout_ns);
            // Ours alone, and every record of the block is in: its source adds again only after our credit
            if (ok) *counter = 0;
        }
    }
    if (not __shfl_sync(0xffffffff, ok, 0)) return false;
    num_records = __shfl_sync(0xffffffff, num_records, 0);
    if (map_counts != nullptr and block == 0 and lane_idx == 0)
        map_counts[m * (fw.num_ranks_per_node + 1) + fw.num_ranks_per_node] = num_records;
    const int begin = block * arrival_block, end = min(num_records, begin + arrival_block);
    if (begin >= end) return true;
    // Lane j: the first slot at local rank j of the block's records, and how many
    int first_slot = -1, num_slots = 0;
    for (int slot = begin; slot < end; ++slot) {
        const char* record = scaleout.window() + fw.record_offset(m, fw.node, slot, kRecordBytes, num_max_tokens);
        const int dst_slot = lane_idx < fw.num_ranks_per_node
                                 ? ld_relaxed_sys(reinterpret_cast<const int*>(record + kRecordBytes) + lane_idx)
                                 : -1;
        if (dst_slot >= 0) {
            if (num_slots == 0) first_slot = dst_slot;
            ++num_slots;
        }
        if (forward_map != nullptr)
            write_forward_map<kNumTopk>(
                forward_map, m, slot, num_max_tokens, reinterpret_cast<const int*>(record + Record::kTopkIdxOffset),
                ld_relaxed_sys(reinterpret_cast<const int*>(record + Record::kSrcIdxOffset)), dst_slot,
                fw.node * fw.num_ranks_per_node * num_experts_per_rank, num_experts_per_rank, fw.num_ranks_per_node);
        uint32_t dsts = __ballot_sync(0xffffffff, dst_slot >= 0);
        while (dsts != 0) {
            const int j = __ffs(dsts) - 1;
            dsts &= dsts - 1;
            const int slot_at_j = __shfl_sync(0xffffffff, dst_slot, j);
            int4* dst =
                reinterpret_cast<int4*>(static_cast<char*>(peer_windows[fw.rank_of(fw.node, j)]) + kWorkspaceBytes +
                                        (int64_t(source) * num_max_tokens + slot_at_j) * kRecordBytes);
            const int4* src = reinterpret_cast<const int4*>(record);
            for (int v = lane_idx; v < kRecordVectors; v += 32) st_na_v4(dst + v, ld_window_v4(src + v));
        }
    }
    // The block's records (every lane's stores, ordered by __syncwarp) before the counters
    __syncwarp();
    fence_acq_rel_sys();
    if (num_slots > 0) {
        char* peer = static_cast<char*>(peer_windows[fw.rank_of(fw.node, lane_idx)]);
        const int end_slot = first_slot + num_slots;
        for (int b = first_slot / arrival_block; b * arrival_block < end_slot; ++b) {
            const int lo = max(first_slot, b * arrival_block), hi = min(end_slot, (b + 1) * arrival_block);
            red_add_release_sys_u64(reinterpret_cast<uint64_t*>(peer + scaleout.arrival_offset(source, b)),
                                    static_cast<uint64_t>(hi - lo));
        }
    }
    return true;
}

// A sending warp's forward records [first_slot, first_slot + num_slots) from our node `node` have
// been put to `forwarder`: a signal per block of its forward arrival counters, on the puts' context
// after them. One thread.
template <typename Transport>
__device__ __forceinline__ void signal_forward_arrivals(const Transport& transport, const Scaleout<true>& scaleout,
                                                        int forwarder, int node, int first_slot, int num_slots,
                                                        int arrival_block) {
    const int end_slot = first_slot + num_slots;
    for (int block = first_slot / arrival_block; block * arrival_block < end_slot; ++block) {
        const int begin = max(first_slot, block * arrival_block), end = min(end_slot, (block + 1) * arrival_block);
        transport.signal_add(forwarder, forward_arrival_offset(scaleout, node, block),
                             static_cast<uint64_t>(end - begin));
    }
}

}  // namespace deep_ep
