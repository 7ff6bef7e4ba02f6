#pragma once

// Cross-rank synchronisation over the symmetric window: stores, loads and atomics on every rank's
// window base, which the host leaves in each window's workspace when the window is created (NCCL's
// LSA pointers over NVLink, or the windows of virtual ranks on one GPU). No NCCL call on the device.
// Channel c of every rank pairs with channel c of every other rank through counting semaphores:
// rank r signals peer p by adding 1 to p's semaphore [c][r], and waits until its own [c][p] is
// positive, then takes the token back. Semaphores return to zero after every completed barrier,
// so the workspace stays zeroed between kernels.

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/credits.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>

namespace deep_ep {

// Every rank's window base, from our own workspace (our own base is the address we write through).
__device__ __forceinline__ void* const* peer_window_table(const char* own_window) {
    return reinterpret_cast<void* const*>(own_window + kPeerWindowsOffset);
}

__device__ __forceinline__ int* workspace_semaphore(void* workspace, int channel, int src_rank) {
    return reinterpret_cast<int*>(static_cast<char*>(workspace) + kSemaphoreOffset) + channel * kMaxRanks + src_rank;
}

// Every thread of the CTA must call it. Returns false (on every thread) when a peer missed the
// deadline or the buffer failed; the error is recorded. Masked peers take no part. A remote peer
// (scaleout.cuh) takes no add from us and we take none back from it: it counts the barriers we
// entered in a word of ours (a transport signal), and we count those we passed with it in a word
// only we write, so neither is ever reset.
template <int kNumRanks, bool kMasking, typename Transport, bool kScaleout>
__device__ __forceinline__ bool channel_barrier(char* own_window, int rank, int channel, int phase,
                                                const FaultSink& fault, uint64_t timeout_ns,
                                                const RankMask<kMasking>& mask, const Transport& transport,
                                                const Scaleout<kScaleout>& scaleout) {
    bool ok = not buffer_failed(fault);
    if (ok and threadIdx.x < kNumRanks and not mask.skips(threadIdx.x) and scaleout.is_remote(threadIdx.x)) {
        const int peer = threadIdx.x;
        // Release everything this CTA wrote before the peer may read it (a strong signal)
        fence_acq_rel_sys();
        transport.signal_add(peer, scaleout.barrier_offset(rank), 1);
        const uint64_t expected = *scaleout.barrier_passed(peer) + 1;
        ok = wait_counter(scaleout.barrier(peer), static_cast<int>(expected), fault, phase, rank, peer, channel,
                          timeout_ns, mask);
        if (ok and not mask.timed_out_already(peer)) *scaleout.barrier_passed(peer) = expected;
    } else if (ok and threadIdx.x < kNumRanks and not mask.skips(threadIdx.x)) {
        const int peer = threadIdx.x;
        void* const* peers = peer_window_table(own_window);
        // Release everything this CTA wrote (to any rank) before the peer may read it.
        fence_acq_rel_sys();
        atomic_add_release_sys(workspace_semaphore(peers[peer], channel, rank), 1);
        int* mine = workspace_semaphore(own_window, channel, peer);
        const uint64_t deadline = global_timer_ns() + timeout_ns;
        int observed;
        bool is_masked = false;  // automatic mode: a peer that does not come is masked
        while ((observed = ld_acquire_sys(mine)) < 1) {
            if (fault.check()) {
                ok = false;
                break;
            }
            if (global_timer_ns() > deadline) {
                is_masked = mask.mask_on_timeout(peer);
                if (not is_masked) fault.report_timeout(phase, rank, peer, channel, observed, 1);
                ok = is_masked;
                break;
            }
        }
        if (ok and not is_masked) atomic_add_relaxed_sys(mine, -1);
    }
    return __syncthreads_and(ok);
}

// Every one of the first `num_ctas` CTAs of the grid waits for all the others (they must be
// co-resident: the fresh dispatch is a cooperative launch). `arrive` returns to zero; the last CTA in
// publishes `tag` in `generation`, which must differ from the tag of the previous barrier on these
// words (so no CTA reads `generation` before it arrives). Returns false (on every thread) when the
// deadline passed or the buffer failed; the error is recorded.
__device__ __forceinline__ bool grid_barrier(int* arrive, int* generation, int tag, int num_ctas,
                                             const FaultSink& fault, int phase, int rank, uint64_t timeout_ns) {
    __shared__ int passed;
    __syncthreads();
    if (threadIdx.x == 0) {
        // Releases the CTA's writes (ordered before thread 0 by __syncthreads); the last CTA in has
        // acquired every other CTA's before it releases them all
        bool ok = true;
        if (atomic_add_acq_rel_gpu(arrive, 1) == num_ctas - 1) {
            *arrive = 0;
            st_release_sys(generation, tag);
        } else {
            const uint64_t deadline = global_timer_ns() + timeout_ns;
            while (ld_acquire_sys(generation) != tag) {
                if (fault.check()) {
                    ok = false;
                    break;
                }
                if (global_timer_ns() > deadline) {
                    fault.report_timeout(phase, rank, rank, blockIdx.x, ld_relaxed_sys(arrive), num_ctas);
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

// A communication kernel's entry: every rank's window base into shared memory (null for a remote
// peer: the host leaves none), and the wait until every peer's window takes our writes
// (credits.cuh), which also stops the kernel when the buffer has failed. Every thread of the CTA
// calls it; returns false (on every thread) when a peer missed the deadline or the buffer failed.
// Masked peers are not waited for.
template <int kNumRanks, bool kMasking, bool kScaleout>
__device__ __forceinline__ bool open_peer_windows(char* own_window, void** smem_peer_windows, int rank, int phase,
                                                  const FaultSink& fault, uint64_t timeout_ns,
                                                  const RankMask<kMasking>& mask, const Scaleout<kScaleout>& scaleout) {
    bool ok = true;
    if (threadIdx.x < kNumRanks) {
        smem_peer_windows[threadIdx.x] = peer_window_table(own_window)[threadIdx.x];
        ok = mask.skips(threadIdx.x) or
             wait_window_credit(own_window, scaleout, threadIdx.x, rank, phase, fault, timeout_ns, mask);
    }
    return __syncthreads_and(ok);
}

}  // namespace deep_ep
