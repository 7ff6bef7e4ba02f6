#pragma once

// Peers outside this rank's scale-up domain (other nodes: NCCL GIN, or the emulated NIC of virtual
// nodes) cannot be written by stores, so everything that reaches them follows the transport's word
// rules (docs/transport.md): data by `put` from our own window, then a 64-bit `signal_add` on the
// same context; every word they write has one writer, and its owner resets it only when no write
// can be in flight. Their words live in a scale-out region of the window, placed by the host after
// the data region (its offset is the same on every rank, so our offsets are the peers' offsets):
//
//   region = [remote words | per-expert counts staged for remote ranks | forwarding words | staging
//             | forward region]
//
// The staging holds what goes to remote ranks until the transport has read it: a dispatch stages
// each token's record at the token's place (read by the puts before the kernel ends: every warp
// flushes then), a combine its rows in a ring of entries per warp, flushed before an entry is reused.
// Peers of our own scale-up domain are reached by stores, exactly as without this region.

#include <cstddef>
#include <cstdint>

#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/math.cuh>

namespace deep_ep {

// Remote words (uint64, indexed by the writing rank); offsets inside the region
constexpr int64_t kRemoteCreditOffset = 0;                   // operations the peer completed (credits.cuh)
constexpr int64_t kRemoteSignatureOffset = kMaxRanks * 8;    // the source's running operation; owner resets
constexpr int64_t kRemoteFaultOffset = 2 * kMaxRanks * 8;    // the fault the source posted (fault.cuh)
constexpr int64_t kRemoteBarrierOffset = 3 * kMaxRanks * 8;  // barriers the peer entered (comm.cuh)
constexpr int64_t kBarrierPassedOffset = 4 * kMaxRanks * 8;  // ours: barriers passed with each remote peer
constexpr int64_t kRemoteArrivalOffset = 4096;               // [source][block] (arrivals.cuh); owner resets
constexpr int64_t kCountStagingOffset =                      // [destination][local expert] int32
    kRemoteArrivalOffset + int64_t(kMaxRanks) * kMaxArrivalBlocks * 8;
// Hybrid mode's forwarding words (forward.cuh): per (source node, local rank) the per-expert counts
// (int32) and a count flag, per source node a flag of its forward records and [block] arrival counters
constexpr int64_t kForwardExpertCountOffset = kCountStagingOffset + int64_t(kMaxRanks) * kMaxLocalExperts * 4;
constexpr int64_t kForwardCountFlagOffset = kForwardExpertCountOffset + int64_t(kMaxRanks) * kMaxLocalExperts * 4;
constexpr int64_t kForwardRecordFlagOffset = kForwardCountFlagOffset + kMaxRanks * 8;
constexpr int64_t kForwardArrivalOffset = kForwardRecordFlagOffset + kMaxRanks * 8;
constexpr int64_t kStagingRingOffset =
    align_up(kForwardArrivalOffset + int64_t(kMaxRanks) * kMaxArrivalBlocks * 8, int64_t(64 * 1024));
static_assert(kBarrierPassedOffset + kMaxRanks * 8 <= kRemoteArrivalOffset, "remote words overflow");

// What the host wrote of the region in our workspace (layout.cuh places those words), copied once
// per CTA into shared memory: every kernel with remote peers reads it throughout, and registers are
// what the transport's calls need.
struct ScaleoutWords {
    char* window;           // our window
    int64_t region_offset;  // the region's offset in the window (the same on every rank)
    int scaleup_begin;      // our scale-up domain: ranks [scaleup_begin, scaleup_end)
    int scaleup_end;
};

template <bool kEnabled>
struct Scaleout {
    __device__ __forceinline__ static ScaleoutWords& words() {
        __shared__ ScaleoutWords cta_words;
        return cta_words;
    }

    // Whether `peer` is reached through the transport (else by stores)
    __device__ __forceinline__ bool is_remote(int peer) const {
        if constexpr (kEnabled)
            return peer < words().scaleup_begin or peer >= words().scaleup_end;
        else
            return false;
    }

    __device__ __forceinline__ char* window() const { return words().window; }
    __device__ __forceinline__ int64_t region_offset() const { return words().region_offset; }

    // Bit r for every remote rank r of `num_ranks`
    __device__ __forceinline__ uint64_t remote_ranks(int num_ranks) const {
        if constexpr (not kEnabled) return 0;
        const uint64_t all = num_ranks >= 64 ? ~0ull : (1ull << num_ranks) - 1;
        const int size = words().scaleup_end - words().scaleup_begin;
        const uint64_t local = (size >= 64 ? ~0ull : (1ull << size) - 1) << words().scaleup_begin;
        return all & ~local;
    }

    __device__ __forceinline__ char* region() const { return window() + region_offset(); }

    // Our words, written by remote ranks (or by us, for `barrier_passed`)
    __device__ __forceinline__ uint64_t* word(int64_t offset, int index) const {
        return reinterpret_cast<uint64_t*>(region() + offset) + index;
    }
    __device__ __forceinline__ uint64_t* credit(int peer) const { return word(kRemoteCreditOffset, peer); }
    __device__ __forceinline__ uint64_t* signature(int source) const { return word(kRemoteSignatureOffset, source); }
    __device__ __forceinline__ uint64_t* fault(int source) const { return word(kRemoteFaultOffset, source); }
    __device__ __forceinline__ uint64_t* barrier(int peer) const { return word(kRemoteBarrierOffset, peer); }
    __device__ __forceinline__ uint64_t* barrier_passed(int peer) const { return word(kBarrierPassedOffset, peer); }
    __device__ __forceinline__ uint64_t* arrivals(int source) const {
        return word(kRemoteArrivalOffset, source * kMaxArrivalBlocks);
    }
    // Hybrid mode's forward count flag `index` and forward record flag `index` (forward.cuh) to zero
    __device__ __forceinline__ void reset_forward_flags(int index) const {
        if constexpr (kEnabled) {
            *word(kForwardCountFlagOffset, index) = 0;
            *word(kForwardRecordFlagOffset, index) = 0;
        }
    }
    __device__ __forceinline__ int* count_staging(int destination) const {
        return reinterpret_cast<int*>(region() + kCountStagingOffset) + destination * kMaxLocalExperts;
    }

    // Window offsets of the words a peer reads, for `rank` (the writer): the same on every rank
    __device__ __forceinline__ size_t word_offset(int64_t offset, int index) const {
        return static_cast<size_t>(region_offset() + offset + int64_t(index) * 8);
    }
    __device__ __forceinline__ size_t credit_offset(int rank) const { return word_offset(kRemoteCreditOffset, rank); }
    __device__ __forceinline__ size_t signature_offset(int rank) const {
        return word_offset(kRemoteSignatureOffset, rank);
    }
    __device__ __forceinline__ size_t fault_offset(int rank) const { return word_offset(kRemoteFaultOffset, rank); }
    __device__ __forceinline__ size_t barrier_offset(int rank) const { return word_offset(kRemoteBarrierOffset, rank); }
    __device__ __forceinline__ size_t arrival_offset(int rank, int block) const {
        return word_offset(kRemoteArrivalOffset, rank * kMaxArrivalBlocks + block);
    }
    __device__ __forceinline__ size_t count_staging_offset(int destination) const {
        return static_cast<size_t>(region_offset() + kCountStagingOffset + int64_t(destination) * kMaxLocalExperts * 4);
    }
    // A dispatch stages each token's record at its own place, `index` items of `item_bytes` into the
    // staging region (the combine's ring uses the same bytes: the kernels never run at once)
    __device__ __forceinline__ size_t staging_offset(int index, int item_bytes) const {
        return static_cast<size_t>(region_offset() + kStagingRingOffset + int64_t(index) * item_bytes);
    }
};

// The region as the host described it in `own_window`'s workspace; without `kEnabled`, nothing
// (every test on it folds away at compile time). Every thread of the CTA calls it.
template <bool kEnabled>
__device__ __forceinline__ Scaleout<kEnabled> load_scaleout(char* own_window, int rank) {
    if constexpr (kEnabled) {
        if (threadIdx.x == 0) {
            ScaleoutWords& words = Scaleout<true>::words();
            words.window = own_window;
            words.region_offset = *reinterpret_cast<const int64_t*>(own_window + kScaleoutRegionOffset);
            const int num_scaleup_ranks = *reinterpret_cast<const int*>(own_window + kNumScaleupRanksOffset);
            words.scaleup_begin = rank - rank % num_scaleup_ranks;
            words.scaleup_end = words.scaleup_begin + num_scaleup_ranks;
        }
        __syncthreads();
    }
    return {};
}

// The CTAs of a kernel's grid that do its work: all of them, less the last one where the transport
// runs an emulated NIC (a function, not a value handed down: the kernels over LSA read `gridDim`
// where they need it, as they did before the transports)
template <typename Transport>
__device__ __forceinline__ unsigned num_issuing_ctas() {
    return gridDim.x - (Transport::kHasNic ? 1u : 0u);
}

// One warp's entries of the staging ring: `next` hands out the next entries, and before the warp
// reuses an entry it flushes the transport (every put it posted has read its source). `kEntryBytes`
// a multiple of 16. Lives in registers, the same on every lane.
template <typename Transport, int kEntryBytes>
struct StagingRing {
    int64_t first_offset = 0;  // window offset of the warp's first entry
    int num_entries = 0;
    int num_used = 0;  // entries handed out since the last flush

    StagingRing() = default;

    // The warp's share of the ring over `num_warps` warps (the host checks that every warp gets as
    // many entries as one task takes)
    __device__ __forceinline__ StagingRing(const Scaleout<true>& scaleout, int global_warp_idx, int num_warps) {
        const int64_t ring_bytes = *reinterpret_cast<const int64_t*>(scaleout.window() + kScaleoutRingBytesOffset);
        const int cap = *reinterpret_cast<const int*>(scaleout.window() + kStagingEntriesCapOffset);
        num_entries = static_cast<int>(ring_bytes / (int64_t(num_warps) * kEntryBytes));
        if (cap > 0) num_entries = min(num_entries, cap);
        first_offset =
            scaleout.region_offset() + kStagingRingOffset + int64_t(global_warp_idx) * num_entries * kEntryBytes;
    }

    // Every lane: the first of `count` consecutive free entries (after a flush when too few are left).
    // False when the flush passed its deadline: the transport may still read the entries
    __device__ __forceinline__ bool next(const Transport& transport, uint64_t timeout_ns, int& entry, int count = 1) {
        if (num_used + count > num_entries) {
            if (not transport.flush_warp(timeout_ns)) return false;
            num_used = 0;
        }
        entry = num_used;
        num_used += count;
        return true;
    }

    __device__ __forceinline__ size_t offset(int entry) const {
        return static_cast<size_t>(first_offset + int64_t(entry) * kEntryBytes);
    }
    template <bool kEnabled>
    __device__ __forceinline__ char* address(const Scaleout<kEnabled>& scaleout, int entry) const {
        return scaleout.window() + offset(entry);
    }
};

}  // namespace deep_ep
