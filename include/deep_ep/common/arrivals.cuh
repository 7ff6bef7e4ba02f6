#pragma once

// Arrival tracking between a communication kernel and the epilogue that consumes what it sent.
// A sending warp releases a task of records (or rows) with one fence and adds its size to
// per-(source, slot block) counters in the receiver's window workspace; the receiver's epilogue,
// which runs concurrently (programmatic dependent launch), waits on the block it is about to read.
// Plain device memory operations only (no NCCL), so epilogues include it without the NCCL headers.

#include <cstdint>

#include "fault.cuh"
#include "layout.cuh"
#include "math.cuh"
#include "ptx.cuh"

namespace deep_ep {

// One thread waits until `*counter >= expected`, compared as a difference so that counters may
// wrap around (acquire: what was released before the counter's increments is visible to this
// thread, and to its warp after a __syncwarp). Returns false when the deadline passed or another
// wait of this buffer failed; the error is then recorded. Polls back off a little: hundreds of
// warps spinning on a few counters load the L2 slices that also take the incoming NVLink writes.
__device__ __forceinline__ bool counter_reached(int observed, int expected) {
    return static_cast<int>(static_cast<unsigned>(observed) - static_cast<unsigned>(expected)) >= 0;
}

__device__ __forceinline__ bool wait_counter(const int* counter, int expected, const FaultSink& fault, int phase,
                                             int rank, int peer, int channel, uint64_t timeout_ns) {
    constexpr unsigned kPollBackoffNs = 200;
    int observed = ld_acquire_sys(counter);
    if (counter_reached(observed, expected)) return true;
    const uint64_t deadline = global_timer_ns() + timeout_ns;
    while (not counter_reached(observed = ld_acquire_sys(counter), expected)) {
        if (fault.has_error() || global_timer_ns() > deadline) {
            fault.report_timeout(phase, rank, peer, channel, observed, expected);
            return false;
        }
        __nanosleep(kPollBackoffNs);
    }
    return true;
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

// How many slots of block `block` a source fills when it sends `num_slots` in all.
__device__ __forceinline__ int arrival_block_size(int num_slots, int block, int arrival_block) {
    return min(arrival_block, num_slots - block * arrival_block);
}

// Returns the arrival counters of the blocks that were used (`num_slots(s)` slots from each source
// s) to zero, so the next kernel pair starts from zero. Every thread of one CTA calls it, once
// every wait on these counters is over.
template <int kNumRanks, typename NumSlots>
__device__ __forceinline__ void reset_arrival_counters(char* window, int arrival_block, NumSlots num_slots) {
    for (int s = 0; s < kNumRanks; ++s) {
        int* counters = arrival_counters(window, s);
        const int num_blocks = ceil_div(num_slots(s), arrival_block);
        for (int block = threadIdx.x; block < num_blocks; block += blockDim.x) counters[block] = 0;
    }
}

// Dispatch, receiving side: how many records each source sends us (the senders' count flags hold
// count + 1), into `num_recv[kNumRanks]` in shared memory. Every thread of the CTA calls it;
// returns false on every thread when a wait failed.
template <int kNumRanks>
__device__ __forceinline__ bool wait_recv_counts(const char* window, int num_max_tokens_per_rank, int* num_recv,
                                                 const FaultSink& fault, int rank, uint64_t timeout_ns) {
    bool ok = true;
    if (threadIdx.x < kNumRanks) {
        const int* flag = reinterpret_cast<const int*>(window + kRecvCountOffset) + threadIdx.x;
        ok = wait_counter(flag, 1, fault, kPhaseDispatchCounts, rank, threadIdx.x, blockIdx.x, timeout_ns);
        num_recv[threadIdx.x] = ok ? min(ld_relaxed_sys(flag) - 1, num_max_tokens_per_rank) : 0;
    }
    return __syncthreads_and(ok);
}

// Every record of every source has landed (for passes that need them all at once).
template <int kNumRanks>
__device__ __forceinline__ bool wait_all_arrivals(char* window, const int* num_recv, int arrival_block,
                                                  const FaultSink& fault, int rank, uint64_t timeout_ns) {
    bool ok = true;
    for (int s = 0; s < kNumRanks; ++s) {
        const int* counters = arrival_counters(window, s);
        for (int block = threadIdx.x; ok and block < ceil_div(num_recv[s], arrival_block); block += blockDim.x)
            ok = wait_counter(counters + block, arrival_block_size(num_recv[s], block, arrival_block), fault,
                              kPhaseDispatchArrival, rank, s, block, timeout_ns);
    }
    return __syncthreads_and(ok);
}

}  // namespace deep_ep
