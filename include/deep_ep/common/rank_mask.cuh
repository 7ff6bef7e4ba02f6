#pragma once

// Rank masking (ElasticBuffer.mask_ranks): the ranks a kernel leaves out. The host keeps the mask
// in our own workspace (a 64-bit word, bit r for rank r, written in stream order), and every kernel
// reads it once at its start, so CUDA-graph replays pick up a new mask without a re-capture. A
// masked rank may be gone: no kernel waits on it or writes into its window, and no lane goes to its
// experts. A rank that finds itself masked drops every lane of its own and leaves out every peer.
// `kEnabled` false is the buffer without rank masking: the mask is the constant zero and every test
// on it folds away at compile time (zero cost).

#include <cstdint>

#include <deep_ep/common/layout.cuh>

namespace deep_ep {

template <bool kEnabled>
struct RankMask {
    uint64_t skipped = 0;  // peers not waited on and not written to
    uint64_t dropped = 0;  // ranks whose experts' lanes count as -1

    __device__ __forceinline__ bool skips(int peer) const {
        if constexpr (kEnabled)
            return (skipped >> peer) & 1;
        else
            return false;
    }

    __device__ __forceinline__ uint64_t dropped_ranks() const { return kEnabled ? dropped : 0; }
};

template <bool kEnabled>
__device__ __forceinline__ RankMask<kEnabled> load_rank_mask(const char* own_window, int rank) {
    RankMask<kEnabled> mask;
    if constexpr (kEnabled) {
        // Written by the host before this kernel in stream order: a plain load sees it
        const uint64_t masked = *reinterpret_cast<const uint64_t*>(own_window + kMaskedRanksOffset);
        const bool is_self_masked = (masked >> rank) & 1;
        mask.dropped = is_self_masked ? ~0ull : masked;
        mask.skipped = is_self_masked ? ~(1ull << rank) : masked & ~(1ull << rank);
    }
    return mask;
}

}  // namespace deep_ep
