#pragma once

// Arrival tracking between a communication kernel and the epilogue that consumes what it sent.
// A sending warp releases a task of records (or rows) with one fence and adds its size to
// per-(source, slot block) counters in the receiver's window workspace; the receiver's epilogue,
// which runs concurrently (programmatic dependent launch), waits on the block it is about to read.
// Plain device memory operations only (no NCCL), so epilogues include it without the NCCL headers.

#include <cstdint>

#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/math.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/rank_mask.cuh>
#include <deep_ep/common/scaleout.cuh>

namespace deep_ep {

// One thread waits until `*counter >= expected`, compared as a difference so that counters may
// wrap around (acquire: what was released before the counter's increments is visible to this
// thread, and to its warp after a __syncwarp). Returns false when the deadline passed or the buffer
// failed (here or on a peer; fault.cuh), also when the counter is there already; the error is then
// recorded. Polls back off a little: hundreds of warps spinning on a few counters load the L2
// slices that also take the incoming NVLink writes. With `mask` in automatic mode (rank_mask.cuh)
// a wait on a peer masked already ends at once, and an expired one masks `peer` and returns true.
__device__ __forceinline__ bool counter_reached(int observed, int expected) {
    return static_cast<int>(static_cast<unsigned>(observed) - static_cast<unsigned>(expected)) >= 0;
}

constexpr unsigned kPollBackoffNs = 200;

// `Word`: int, or the uint64 signal words of remote peers (scaleout.cuh), compared on their low 32 bits.
template <bool kMasking = false, typename Word = int>
__device__ __forceinline__ bool wait_counter(const Word* counter, int expected, const FaultSink& fault, int phase,
                                             int rank, int peer, int channel, uint64_t timeout_ns,
                                             const RankMask<kMasking>& mask = {}) {
    int observed = static_cast<int>(ld_acquire_sys(counter));
    if (counter_reached(observed, expected)) return not fault.check();
    if (mask.timed_out_already(peer)) return true;
    const uint64_t deadline = global_timer_ns() + timeout_ns;
    while (not counter_reached(observed = static_cast<int>(ld_acquire_sys(counter)), expected)) {
        if (fault.check()) return false;
        if (global_timer_ns() > deadline) {
            if (mask.mask_on_timeout(peer)) return true;
            fault.report_timeout(phase, rank, peer, channel, observed, expected);
            return false;
        }
        __nanosleep(kPollBackoffNs);
    }
    return true;
}

// An operation's signature: the low 16 bits of the epoch it runs at (every rank runs its k-th
// operation at epoch k), then the host's hash of what it is, whose top bit is set so that a
// signature is never zero. Peers that run a different operation, or the same one with other
// sizes, leave a different one.
__device__ __forceinline__ uint32_t op_signature(int epoch, int op_hash) {
    return static_cast<uint32_t>(epoch) << 16 | (static_cast<uint32_t>(op_hash) & 0xffffu) | 0x8000u;
}

// A dispatch count flag: the signature, then the token count + 1
__device__ __forceinline__ uint64_t count_flag(uint32_t signature, int count) {
    return static_cast<uint64_t>(signature) << 32 | static_cast<uint32_t>(count + 1);
}

__device__ __forceinline__ uint64_t* count_flags(void* window) {
    return reinterpret_cast<uint64_t*>(static_cast<char*>(window) + kRecvCountOffset);
}

// One thread waits for `src_rank`'s count flag in `window` and returns its count (clamped to
// [0, num_max_tokens_per_rank]), or -1 when the wait failed or the source runs another operation
// (recorded as a failure: the ranks' sequences of operations diverged). In automatic mode a source
// whose flag does not come is masked and sends nothing (rank_mask.cuh).
template <bool kMasking>
__device__ __forceinline__ int wait_count_flag(char* window, int src_rank, uint32_t signature,
                                               int num_max_tokens_per_rank, const FaultSink& fault, int rank,
                                               int channel, uint64_t timeout_ns, const RankMask<kMasking>& mask) {
    const uint64_t* flag = count_flags(window) + src_rank;
    uint64_t value = ld_acquire_sys_u64(flag);
    if (static_cast<uint32_t>(value) == 0) {
        if (mask.timed_out_already(src_rank)) return 0;
        const uint64_t deadline = global_timer_ns() + timeout_ns;
        while (static_cast<uint32_t>(value = ld_acquire_sys_u64(flag)) == 0) {
            if (fault.check()) return -1;
            if (global_timer_ns() > deadline) {
                if (mask.mask_on_timeout(src_rank)) return 0;
                fault.report_timeout(kPhaseDispatchCounts, rank, src_rank, channel, 0, 1);
                return -1;
            }
            __nanosleep(kPollBackoffNs);
        }
    }
    if (fault.check()) return -1;
    if (static_cast<uint32_t>(value >> 32) != signature) {
        fault.report_timeout(kPhaseOpMismatch, rank, src_rank, channel, static_cast<int>(value >> 32),
                             static_cast<int>(signature));
        return -1;
    }
    return min(max(static_cast<int>(static_cast<uint32_t>(value)) - 1, 0), num_max_tokens_per_rank);
}

__device__ __forceinline__ int* arrival_counters(void* window, int src_rank) {
    return reinterpret_cast<int*>(static_cast<char*>(window) + kArrivalOffset) + src_rank * kMaxArrivalBlocks;
}

// Records (or rows) [first_slot, first_slot + num_slots) of `src_rank` have been written to
// `window`: add them to its arrival counters. The caller has fenced after the writes.
__device__ __forceinline__ void signal_arrivals(void* window, int src_rank, int first_slot, int num_slots,
                                                int arrival_block) {
    int* counters = arrival_counters(window, src_rank);
    const int end_slot = first_slot + num_slots;
    for (int block = first_slot / arrival_block; block * arrival_block < end_slot; ++block) {
        const int begin = max(first_slot, block * arrival_block), end = min(end_slot, (block + 1) * arrival_block);
        red_add_relaxed_sys(counters + block, end - begin);
    }
}

// The same for a remote peer (scaleout.cuh): one transport signal per block, on the context of the
// puts it covers (a strong signal: the peer sees those puts' data once it sees the signal). One thread.
template <typename Transport, bool kScaleout>
__device__ __forceinline__ void signal_remote_arrivals(const Transport& transport, const Scaleout<kScaleout>& scaleout,
                                                       int peer, int src_rank, int first_slot, int num_slots,
                                                       int arrival_block) {
    const int end_slot = first_slot + num_slots;
    for (int block = first_slot / arrival_block; block * arrival_block < end_slot; ++block) {
        const int begin = max(first_slot, block * arrival_block), end = min(end_slot, (block + 1) * arrival_block);
        transport.signal_add(peer, scaleout.arrival_offset(src_rank, block), static_cast<uint64_t>(end - begin));
    }
}

// One thread waits until block `block` of `source`'s records (or rows) holds `expected` of them:
// its arrival counter, or its remote signal word when `source` is remote (wait_counter's rules).
template <bool kScaleout>
__device__ __forceinline__ bool wait_arrivals(char* window, const Scaleout<kScaleout>& scaleout, int source, int block,
                                              int expected, const FaultSink& fault, int phase, int rank,
                                              uint64_t timeout_ns) {
    if (scaleout.is_remote(source))
        return wait_counter(scaleout.arrivals(source) + block, expected, fault, phase, rank, source, block, timeout_ns);
    return wait_counter(arrival_counters(window, source) + block, expected, fault, phase, rank, source, block,
                        timeout_ns);
}

// How many slots of block `block` a source fills when it sends `num_slots` in all.
__device__ __forceinline__ int arrival_block_size(int num_slots, int block, int arrival_block) {
    return min(arrival_block, num_slots - block * arrival_block);
}

// No rows under a remote rank's index in our workspace counters (all but hybrid mode's combine)
struct NoForwardedRows {
    __device__ __forceinline__ int operator()(int) const { return 0; }
};

// Returns the arrival counters of the blocks that were used (`num_slots(s)` slots from each source
// s) to zero, so the next kernel pair starts from zero; for a remote s also the workspace counters
// of the `num_forwarded(s)` rows our node's holders left under its index (hybrid mode's combine,
// combine_forward.cuh). Every thread of one CTA calls it, once every wait on these counters is over.
template <int kNumRanks, bool kScaleout, typename NumSlots, typename NumForwarded = NoForwardedRows>
__device__ __forceinline__ void reset_arrival_counters(char* window, const Scaleout<kScaleout>& scaleout,
                                                       int arrival_block, NumSlots num_slots,
                                                       NumForwarded num_forwarded = {}) {
    for (int s = 0; s < kNumRanks; ++s) {
        if (scaleout.is_remote(s)) {
            uint64_t* words = scaleout.arrivals(s);
            const int num_blocks = ceil_div(num_slots(s), arrival_block);
            for (int block = threadIdx.x; block < num_blocks; block += blockDim.x) words[block] = 0;
            int* forwarded = arrival_counters(window, s);
            const int num_forwarded_blocks = ceil_div(num_forwarded(s), arrival_block);
            for (int block = threadIdx.x; block < num_forwarded_blocks; block += blockDim.x) forwarded[block] = 0;
            continue;
        }
        int* counters = arrival_counters(window, s);
        const int num_blocks = ceil_div(num_slots(s), arrival_block);
        for (int block = threadIdx.x; block < num_blocks; block += blockDim.x) counters[block] = 0;
    }
}

// Dispatch, receiving side: how many records each source sends us, from the sources' count flags
// (which must carry `signature`), into `num_recv[kNumRanks]` in shared memory. Every thread of the
// CTA calls it; returns false on every thread when a wait failed. A masked source sends nothing.
template <int kNumRanks, bool kMasking>
__device__ __forceinline__ bool wait_recv_counts(char* window, uint32_t signature, int num_max_tokens_per_rank,
                                                 int* num_recv, const FaultSink& fault, int rank, uint64_t timeout_ns,
                                                 const RankMask<kMasking>& mask) {
    bool ok = true;
    if (threadIdx.x < kNumRanks and mask.skips(threadIdx.x)) {
        num_recv[threadIdx.x] = 0;
    } else if (threadIdx.x < kNumRanks) {
        const int count = wait_count_flag(window, threadIdx.x, signature, num_max_tokens_per_rank, fault, rank,
                                          blockIdx.x, timeout_ns, mask);
        ok = count >= 0;
        num_recv[threadIdx.x] = ok ? count : 0;
    }
    return __syncthreads_and(ok);
}

// Every record of every source has landed (for passes that need them all at once).
template <int kNumRanks, bool kScaleout>
__device__ __forceinline__ bool wait_all_arrivals(char* window, const Scaleout<kScaleout>& scaleout,
                                                  const int* num_recv, int arrival_block, const FaultSink& fault,
                                                  int rank, uint64_t timeout_ns) {
    bool ok = true;
    for (int s = 0; s < kNumRanks; ++s) {
        for (int block = threadIdx.x; ok and block < ceil_div(num_recv[s], arrival_block); block += blockDim.x)
            ok = wait_arrivals(window, scaleout, s, block, arrival_block_size(num_recv[s], block, arrival_block), fault,
                               kPhaseDispatchArrival, rank, timeout_ns);
    }
    return __syncthreads_and(ok);
}

}  // namespace deep_ep
