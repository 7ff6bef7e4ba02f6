#pragma once

// Cross-rank synchronisation over the symmetric window (LSA: plain loads/stores over NVLink).
// Channel c of every rank pairs with channel c of every other rank through counting semaphores:
// rank r signals peer p by adding 1 to p's semaphore [c][r], and waits until its own [c][p] is
// positive, then takes the token back. Semaphores return to zero after every completed barrier,
// so the workspace stays zeroed between kernels.

#include <nccl_device.h>

#include "arrivals.cuh"
#include "credits.cuh"
#include "fault.cuh"
#include "layout.cuh"
#include "ptx.cuh"

namespace deep_ep {

__device__ __forceinline__ int* workspace_semaphore(void* workspace, int channel, int src_rank) {
    return reinterpret_cast<int*>(static_cast<char*>(workspace) + kSemaphoreOffset) + channel * kMaxRanks + src_rank;
}

// Every thread of the CTA must call it. `peer_windows[r]` is rank r's window base (LSA pointer).
// Returns false (on every thread) when a peer missed the deadline; the error is already recorded.
template <int kNumRanks>
__device__ __forceinline__ bool channel_barrier(void* const* peer_windows, int rank, int channel, int phase,
                                                int64_t* error_block, uint64_t timeout_ns) {
    const FaultSink fault = make_fault_sink(peer_windows[rank], error_block);
    bool ok = true;
    __syncthreads();
    if (threadIdx.x < kNumRanks) {
        const int peer = threadIdx.x;
        // Release everything this CTA wrote (to any rank) before the peer may read it.
        fence_acq_rel_sys();
        atomic_add_release_sys(workspace_semaphore(peer_windows[peer], channel, rank), 1);
        int* mine = workspace_semaphore(peer_windows[rank], channel, peer);
        const uint64_t deadline = global_timer_ns() + timeout_ns;
        int observed;
        while ((observed = ld_acquire_sys(mine)) < 1) {
            if (fault.has_error() || global_timer_ns() > deadline) {
                fault.report_timeout(phase, rank, peer, channel, observed, 1);
                ok = false;
                break;
            }
        }
        if (ok) atomic_add_relaxed_sys(mine, -1);
    }
    return __syncthreads_and(ok);
}

// Every CTA of the grid waits for all the others (the grid must be co-resident: at most one CTA
// per SM, as for every communication kernel). `arrive` returns to zero; the last CTA in publishes
// `tag` in `generation`, which must differ from the tag of the previous barrier on these words (so
// no CTA reads `generation` before it arrives). Returns false (on every thread) when the deadline
// passed; the error is recorded.
__device__ __forceinline__ bool grid_barrier(int* arrive, int* generation, int tag, const FaultSink& fault, int phase,
                                             int rank, uint64_t timeout_ns) {
    __shared__ int passed;
    __syncthreads();
    if (threadIdx.x == 0) {
        // The CTA's writes (ordered before thread 0 by __syncthreads) become visible device-wide
        __threadfence();
        bool ok = true;
        if (atomicAdd(arrive, 1) == static_cast<int>(gridDim.x) - 1) {
            *arrive = 0;
            st_release_sys(generation, tag);
        } else {
            const uint64_t deadline = global_timer_ns() + timeout_ns;
            while (ld_acquire_sys(generation) != tag) {
                if (fault.has_error() || global_timer_ns() > deadline) {
                    fault.report_timeout(phase, rank, rank, blockIdx.x, ld_relaxed_sys(arrive), gridDim.x);
                    ok = false;
                    break;
                }
            }
        }
        passed = ok;
    }
    __syncthreads();
    return passed;
}

// LSA base pointers of every rank's window, gathered once per CTA into shared memory.
template <int kNumRanks>
__device__ __forceinline__ void load_peer_windows(ncclWindow_t window, void** smem_peer_windows) {
    if (threadIdx.x < kNumRanks) smem_peer_windows[threadIdx.x] = ncclGetLsaPointer(window, 0, threadIdx.x);
    __syncthreads();
}

// A communication kernel's entry: the LSA base pointers of every rank's window into shared memory,
// and the wait until every peer's window takes our writes (credits.cuh), with both sets of loads
// in flight together. CTA 0 also leaves the pointers in our workspace for the epilogue, which
// posts our credits but is built without NCCL. `own_window` is our window base. Every thread of the
// CTA calls it; returns false (on every thread) when a peer missed the deadline.
template <int kNumRanks>
__device__ __forceinline__ bool open_peer_windows(ncclWindow_t window, char* own_window, void** smem_peer_windows,
                                                  int rank, int phase, const FaultSink& fault, uint64_t timeout_ns) {
    bool ok = true;
    if (threadIdx.x < kNumRanks) {
        void* peer_window = ncclGetLsaPointer(window, 0, threadIdx.x);
        ok = wait_window_credit(own_window, threadIdx.x, rank, phase, fault, timeout_ns);
        smem_peer_windows[threadIdx.x] = peer_window;
        if (blockIdx.x == 0) reinterpret_cast<void**>(own_window + kPeerWindowsOffset)[threadIdx.x] = peer_window;
    }
    return __syncthreads_and(ok);
}

}  // namespace deep_ep
