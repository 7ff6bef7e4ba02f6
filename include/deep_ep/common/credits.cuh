#pragma once

// Window credits: when a communication kernel may write into a peer's window. A rank's epilogue,
// once it and the communication kernel before it have read everything the peers sent, counts the
// operation in its epoch and posts the new epoch to every peer's credit word for it. The next
// communication kernel of a peer writes only once its credit word for us has reached its own
// epoch: both ranks run the same sequence of dispatches and combines, so equal epochs mean we are
// done with the previous one. The credit is posted at the end of an operation, so in steady state
// it is already there when the next one starts: no entry barrier, no round trip before sending.
// A remote peer (scaleout.cuh) cannot take a store: it gets its credit as a transport signal that adds
// 1 to a word of ours in its scale-out region, which so counts the operations we completed, as the
// stored epoch does; op signatures reach it the same way, into a word its owner resets at the end.
// Plain device memory operations and the transport's verbs only, so every kernel includes it.

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/tasks.cuh>

namespace deep_ep {

__device__ __forceinline__ int* window_credits(void* window) {
    return reinterpret_cast<int*>(static_cast<char*>(window) + kCreditOffset);
}

// One thread waits until `peer`'s window takes our writes: its credit for us has reached our
// epoch, which our previous epilogue counted before this kernel started. `own_window` is our
// window base. Returns false when the deadline passed (the error is recorded), true when that
// masked the peer instead (automatic mode, rank_mask.cuh).
template <bool kMasking, bool kScaleout>
__device__ __forceinline__ bool wait_window_credit(char* own_window, const Scaleout<kScaleout>& scaleout, int peer,
                                                   int rank, int phase, const FaultSink& fault, uint64_t timeout_ns,
                                                   const RankMask<kMasking>& mask) {
    const int epoch = *reinterpret_cast<const int*>(own_window + kEpochOffset);
    if (scaleout.is_remote(peer))
        return wait_counter(scaleout.credit(peer), epoch, fault, phase, rank, peer, blockIdx.x, timeout_ns, mask);
    return wait_counter(window_credits(own_window) + peer, epoch, fault, phase, rank, peer, blockIdx.x, timeout_ns,
                        mask);
}

// The end of every epilogue: every thread of every CTA that reads (`num_ctas`, the first of the grid)
// calls it once, after its last read of the window. The last CTA out waits for the communication
// kernel to complete (programmatic dependent launch: until then it may still read the count flags),
// returns the epilogue's task queue, the arrival counters (`num_slots(s)` slots from each source s,
// and `num_forwarded`'s: reset_arrival_counters), the remote sources' op signatures and, with
// `clear_recv_counts`, the dispatch count flags to zero,
// counts the operation in the epoch and posts it to every rank as our credit. After a failure
// (fault.cuh) it does none of that: the window is left as it is and no peer may write into it
// again. Masked peers get no credit (they may be gone).
template <int kNumRanks, bool kMasking, typename Transport, bool kScaleout, typename NumSlots,
          typename NumForwarded = NoForwardedRows>
__device__ __forceinline__ void finish_epilogue(char* window, int rank, int arrival_block, bool clear_recv_counts,
                                                int num_ctas, const FaultSink& fault, const RankMask<kMasking>& mask,
                                                const Transport& transport, const Scaleout<kScaleout>& scaleout,
                                                NumSlots num_slots, NumForwarded num_forwarded = {}) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        int* done = reinterpret_cast<int*>(window + kEpilogueDoneOffset);
        // Our CTA's reads of the window come before the last CTA's zeroing, and the last CTA's
        // zeroing after every CTA's reads
        is_last = atomic_add_acq_rel_gpu(done, 1) == num_ctas - 1;
        if (is_last) *done = 0;
    }
    __syncthreads();
    if (not is_last) return;
    griddep_wait();
    if (buffer_failed(fault)) return;
    if (threadIdx.x == 0) TaskQueue::reset(reinterpret_cast<int*>(window + kEpilogueTaskQueueOffset));
    reset_arrival_counters<kNumRanks>(window, scaleout, arrival_block, num_slots, num_forwarded);
    if (clear_recv_counts and threadIdx.x < kNumRanks) count_flags(window)[threadIdx.x] = 0;
    if (threadIdx.x < kNumRanks and scaleout.is_remote(threadIdx.x)) *scaleout.signature(threadIdx.x) = 0;
    // Hybrid mode's flags of what remote sources sent us to forward (forward.cuh; words nothing
    // writes in direct mode): read by the communication kernel, which is complete
    if (threadIdx.x < kNumRanks) scaleout.reset_forward_flags(threadIdx.x);
    int* epoch_word = reinterpret_cast<int*>(window + kEpochOffset);
    const int epoch = static_cast<int>(static_cast<unsigned>(*epoch_word) + 1u);
    __syncthreads();
    if (threadIdx.x == 0) *epoch_word = epoch;
    if (threadIdx.x < kNumRanks and not mask.skips(threadIdx.x)) {
        if (scaleout.is_remote(threadIdx.x)) {
            // The CTA's resets (ordered before this thread by the barrier) first
            fence_acq_rel_sys();
            transport.signal_add(threadIdx.x, scaleout.credit_offset(rank), 1);
        } else {
            void* peer = reinterpret_cast<void* const*>(window + kPeerWindowsOffset)[threadIdx.x];
            // The CTA's resets (ordered before this thread by the barrier) and the epoch first
            fence_acq_rel_sys();
            st_relaxed_sys(window_credits(peer) + rank, epoch);
        }
    }
}

__device__ __forceinline__ int* op_signatures(void* window) {
    return reinterpret_cast<int*>(static_cast<char*>(window) + kOpSignatureOffset);
}

// A communication kernel's CTA 0 leaves its operation's signature in every peer's workspace (after
// its credits: the peer's previous epilogue has checked the previous one). Every thread calls it.
template <int kNumRanks, bool kMasking, typename Transport, bool kScaleout>
__device__ __forceinline__ void post_op_signature(void* const* peer_windows, int rank, uint32_t signature,
                                                  const RankMask<kMasking>& mask, const Transport& transport,
                                                  const Scaleout<kScaleout>& scaleout) {
    if (blockIdx.x == 0 and threadIdx.x < kNumRanks and not mask.skips(threadIdx.x)) {
        if (scaleout.is_remote(threadIdx.x))
            transport.signal_add(threadIdx.x, scaleout.signature_offset(rank), signature);
        else
            st_relaxed_sys(op_signatures(peer_windows[threadIdx.x]) + rank, static_cast<int>(signature));
    }
}

// An epilogue's check that every peer runs this operation too: each peer's communication kernel
// leaves its signature in our workspace right after its window credits, before any data. Every
// thread of the CTA calls it; returns false (on every thread) when a peer runs another operation
// (a failure, recorded) or the wait failed. Masked peers are not checked.
template <int kNumRanks, bool kMasking, bool kScaleout>
__device__ __forceinline__ bool wait_op_signatures(char* window, uint32_t signature, const FaultSink& fault, int rank,
                                                   uint64_t timeout_ns, const RankMask<kMasking>& mask,
                                                   const Scaleout<kScaleout>& scaleout) {
    bool ok = true;
    if (threadIdx.x < kNumRanks and not mask.skips(threadIdx.x)) {
        const int* word = op_signatures(window) + threadIdx.x;
        const uint64_t* remote_word = scaleout.signature(threadIdx.x);
        const bool is_remote = scaleout.is_remote(threadIdx.x);
        // A remote source's word holds its signature (in the low half) once it is posted, else zero
        auto load = [&]() -> uint32_t {
            return is_remote ? static_cast<uint32_t>(ld_acquire_sys(remote_word))
                             : static_cast<uint32_t>(ld_acquire_sys(word));
        };
        const uint32_t epoch_bits = signature >> 16;
        // Zero: never written (a signature never is zero, also at epoch 0)
        auto is_current = [&](uint32_t value) { return value != 0 and value >> 16 == epoch_bits; };
        uint32_t observed = load();
        // Automatic mode: a peer whose signature does not come is masked, not checked
        bool is_masked = false;
        if (not is_current(observed)) {
            is_masked = mask.timed_out_already(threadIdx.x);
            const uint64_t deadline = global_timer_ns() + timeout_ns;
            while (not is_masked and not is_current(observed = load())) {
                if (fault.check()) {
                    ok = false;
                    break;
                }
                if (global_timer_ns() > deadline) {
                    is_masked = mask.mask_on_timeout(threadIdx.x);
                    if (is_masked) break;
                    fault.report_timeout(kPhaseOpSignature, rank, threadIdx.x, blockIdx.x, static_cast<int>(observed),
                                         static_cast<int>(signature));
                    ok = false;
                    break;
                }
                __nanosleep(kPollBackoffNs);
            }
        }
        if (ok and not is_masked and observed != signature) {
            fault.report_timeout(kPhaseOpMismatch, rank, threadIdx.x, blockIdx.x, static_cast<int>(observed),
                                 static_cast<int>(signature));
            ok = false;
        }
    }
    return __syncthreads_and(ok);
}

}  // namespace deep_ep
