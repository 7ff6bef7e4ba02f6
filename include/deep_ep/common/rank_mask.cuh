#pragma once

// Rank masking (ElasticBuffer.mask_ranks): the ranks a kernel leaves out. The host keeps the mask
// in our own workspace (a 64-bit word, bit r for rank r, written in stream order), and every kernel
// reads it once at its start, so CUDA-graph replays pick up a new mask without a re-capture. A
// masked rank may be gone: no kernel waits on it or writes into its window, and no lane goes to its
// experts. A rank that finds itself masked drops every lane of its own and leaves out every peer.
// `kEnabled` false is the buffer without rank masking: the mask is the constant zero and every test
// on it folds away at compile time (zero cost).
//
// Automatic mode (`mask_ranks_on_timeout`): a wait on a peer for the start of its operation (window
// credit, operation signature, dispatch count, barrier) that passes its deadline masks the peer
// instead of failing: its bit goes into a second word, which every later kernel adds to the mask and
// every such wait checks before it starts. A wait for data that was announced (arrival counters)
// still fails: what has not landed cannot be left out.

#include <cstdint>

#include <deep_ep/common/layout.cuh>

namespace deep_ep {

template <bool kEnabled>
struct RankMask {
    uint64_t skipped = 0;          // peers not waited on and not written to
    uint64_t dropped = 0;          // ranks whose experts' lanes count as -1
    uint64_t* timed_out = nullptr;  // automatic mode: the peers masked by an expired wait; else null

    __device__ __forceinline__ bool skips(int peer) const {
        if constexpr (kEnabled)
            return (skipped >> peer) & 1;
        else
            return false;
    }

    __device__ __forceinline__ uint64_t dropped_ranks() const { return kEnabled ? dropped : 0; }

    // A wait on `peer` may end at once: an expired wait of this or an earlier kernel masked it
    __device__ __forceinline__ bool timed_out_already(int peer) const {
        if constexpr (kEnabled)
            return timed_out != nullptr and (*reinterpret_cast<volatile uint64_t*>(timed_out) >> peer) & 1;
        else
            return false;
    }

    // A wait on `peer` passed its deadline: true when that masks the peer (automatic mode), so the
    // wait ends as if the peer were masked; false when it is a failure
    __device__ __forceinline__ bool mask_on_timeout(int peer) const {
        if constexpr (kEnabled) {
            if (timed_out != nullptr) {
                atomicOr(reinterpret_cast<unsigned long long*>(timed_out), 1ull << peer);
                return true;
            }
        }
        return false;
    }
};

template <bool kEnabled>
__device__ __forceinline__ RankMask<kEnabled> load_rank_mask(char* own_window, int rank) {
    RankMask<kEnabled> mask;
    if constexpr (kEnabled) {
        uint64_t* timed_out = reinterpret_cast<uint64_t*>(own_window + kTimedOutRanksOffset);
        // Written by the host before this kernel in stream order (the timed-out word by earlier
        // kernels): plain loads see them
        const uint64_t masked = *reinterpret_cast<const uint64_t*>(own_window + kMaskedRanksOffset) |
                                *reinterpret_cast<volatile uint64_t*>(timed_out);
        const bool is_self_masked = (masked >> rank) & 1;
        mask.dropped = is_self_masked ? ~0ull : masked;
        mask.skipped = is_self_masked ? ~(1ull << rank) : masked & ~(1ull << rank);
        if (*reinterpret_cast<const int*>(own_window + kMaskOnTimeoutOffset) != 0) mask.timed_out = timed_out;
    }
    return mask;
}

}  // namespace deep_ep
