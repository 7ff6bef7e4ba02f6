#pragma once

// Byte layout of the symmetric window and of the token records that travel through it.
// deep_ep/backends/kernels/layout.py (and deep_ep/records.py, for the records and the workspace
// size) mirror every constant here; a CPU test checks that they agree.
//
//   window = [workspace | data region]
//   workspace: per-CTA, per-source-rank counting semaphores (the standalone barrier), per-source
//              count flags, status, epilogue exit counter, epoch, task queues, fault-reported flag,
//              rank and world size, per-peer window credits, every rank's window base, per-source
//              combine signatures, per-(source, local expert) received counts, per-(source, slot
//              block) arrival counters
//   data region: kNumRanks source blocks of `num_max_tokens_per_rank` slots each; a source owns
//                its block in every destination, so it places tokens without asking anyone.
//                Dispatch records and combine slots share the region: they are never live at once.

#include <cstdint>

#include <deep_ep/common/math.cuh>

namespace deep_ep {

constexpr int kMaxRanks = 64;
constexpr int kMaxChannels = 256;  // CTAs of one communication kernel
constexpr int kMaxLocalExperts = 1024;
constexpr int64_t kSemaphoreOffset = 0;
// Per source rank, its count flag for the running dispatch (64 bits: the operation's signature, then
// the token count + 1, so that zero means "not told yet"), written once per dispatch by the source
constexpr int64_t kRecvCountOffset = kSemaphoreOffset + int64_t(kMaxChannels) * kMaxRanks * sizeof(int);
// Non-zero once this buffer failed (fault.cuh): kernels poll it here, in device memory, because reads
// of host-mapped memory cost microseconds each (the host-mapped error block is only written).
constexpr int64_t kStatusOffset = kRecvCountOffset + kMaxRanks * sizeof(uint64_t);
// CTAs of the running epilogue that are done: the last one returns the arrival counters to zero.
constexpr int64_t kEpilogueDoneOffset = kStatusOffset + 8;
// Dispatches and combines this rank has completed on the window (its epilogues count them), and
// per peer the count that peer has completed: a peer's window takes our next records only once
// it is done with what we sent before (credits.cuh). Both wrap around.
constexpr int64_t kEpochOffset = kEpilogueDoneOffset + 4;
// The task queues of the dispatch and combine kernels and of their epilogues (tasks.cuh): two
// words each, zero between launches (epilogues run one at a time, so they share one)
constexpr int64_t kDispatchTaskQueueOffset = kEpochOffset + 4;
constexpr int64_t kCombineTaskQueueOffset = kDispatchTaskQueueOffset + 8;
constexpr int64_t kEpilogueTaskQueueOffset = kCombineTaskQueueOffset + 8;
// Set by the one kernel that copies a failure into the host-mapped error block (fault.cuh)
constexpr int64_t kFaultReportedOffset = kEpilogueTaskQueueOffset + 8;
// This rank and the number of ranks, written by the host when the window is created
constexpr int64_t kRankOffset = kFaultReportedOffset + 4;
constexpr int64_t kNumRanksOffset = kRankOffset + 4;
// The masked ranks (rank_mask.cuh), bit r for rank r, written by the host (ElasticBuffer.mask_ranks)
constexpr int64_t kMaskedRanksOffset = kStatusOffset + 56;
constexpr int64_t kCreditOffset = kStatusOffset + 64;
// Every rank's window base (this rank's own by the address its allocation has, so that every access
// to our window goes through one virtual address), written by the host when the window is created
constexpr int64_t kPeerWindowsOffset = kCreditOffset + kMaxRanks * sizeof(int);
// Per source rank, the signature of the operation it runs (credits.cuh: a check that every rank runs
// the same sequence of operations), left by its communication kernel before any data
constexpr int64_t kOpSignatureOffset = kPeerWindowsOffset + kMaxRanks * sizeof(void*);
// Per source rank, the text of the error that made it stop the buffer (`post_fault.cuh`): a peer's
// host reads it to say why, in words, once that rank's fault has reached it. NUL-terminated UTF-8.
constexpr int64_t kPeerMessageOffset = align_up(kOpSignatureOffset + kMaxRanks * 4, int64_t(16));
constexpr int kPeerMessageBytes = 256;
// Rank masking's automatic mode (rank_mask.cuh): non-zero when an expired wait masks its peer (the
// host writes it when the window is created), and the peers masked that way (bit r for rank r)
constexpr int64_t kMaskOnTimeoutOffset = kPeerMessageOffset + int64_t(kMaxRanks) * kPeerMessageBytes;
constexpr int64_t kTimedOutRanksOffset = kMaskOnTimeoutOffset + 8;
// Peers outside this rank's scale-up domain (scaleout.cuh), written by the host when the window is
// created: where the scale-out region starts (0: every peer is reached by stores) and the bytes of
// its staging ring (int64 each), the ranks per scale-up domain (int32), whether this rank's own
// failure was forwarded to its remote peers (fault.cuh), and a cap on a combine ring's entries per warp
constexpr int64_t kScaleoutRegionOffset = kTimedOutRanksOffset + 8;
constexpr int64_t kScaleoutRingBytesOffset = kScaleoutRegionOffset + 8;
constexpr int64_t kNumScaleupRanksOffset = kScaleoutRingBytesOffset + 8;
constexpr int64_t kFaultForwardedOffset = kNumScaleupRanksOffset + 4;
// At most this many staging entries per warp in a combine's ring (0: as many as the ring holds; tests
// make entries few, so that a warp reuses them within a kernel)
constexpr int64_t kStagingEntriesCapOffset = kFaultForwardedOffset + 4;
// AGRS sessions (kernels/agrs.cuh): per source rank, two 64-bit flags, the calls of even and odd
// numbers: the call's signature (high 32 bits) and number (low 32) whose data that source has
// copied into this window, written by its kernel
constexpr int64_t kAgrsFlagOffset = align_up(kStagingEntriesCapOffset + 4, int64_t(16));
constexpr int kAgrsFlagsPerRank = 2;
// Senders publish how many of their tokens go to each of our local experts, so no receiver-side
// pass over the records is needed to count them.
constexpr int64_t kRecvExpertCountOffset = 128 * 1024;
static_assert(kAgrsFlagOffset + kMaxRanks * kAgrsFlagsPerRank * 8 <= kRecvExpertCountOffset,
              "the workspace's words overlap");
// Arrival counters: how many records (dispatch) or rows (combine) of each block of
// `arrival_block` slots have landed here from each source. The sender adds to them after a
// release fence once per task (tasks.cuh), so the receiver's epilogue can copy or reduce the rows
// that are here while the rest are still on the wire, without per-token flags.
constexpr int64_t kArrivalOffset = 384 * 1024;
constexpr int kMaxArrivalBlocks = 512;  // per source rank
constexpr int64_t kWorkspaceBytes = 512 * 1024;
static_assert(kStatusOffset % 8 == 0 and kNumRanksOffset + 4 <= kMaskedRanksOffset and
                  kMaskedRanksOffset + 8 <= kCreditOffset,
              "workspace overflow");
static_assert(kPeerWindowsOffset % 8 == 0 and kTimedOutRanksOffset % 8 == 0 and
                  kStagingEntriesCapOffset + 4 <= kRecvExpertCountOffset,
              "workspace overflow");
static_assert(kRecvExpertCountOffset + int64_t(kMaxRanks) * kMaxLocalExperts * sizeof(int) <= kArrivalOffset,
              "workspace overflow");
static_assert(kArrivalOffset + int64_t(kMaxRanks) * kMaxArrivalBlocks * sizeof(int) <= kWorkspaceBytes,
              "workspace overflow");

// Device scratch of a fresh dispatch (int32 words, zeroed at buffer creation; the barrier and the
// expert counts are zero again after every dispatch): a grid barrier, per-CTA invalid-row flags,
// per-(token group, destination) counts, and per-expert token counts.
constexpr int kScratchArrive = 0;
constexpr int kScratchGeneration = 1;
// Lanes a fresh dispatch dropped under rank masking (all CTAs add, CTA 0 reports and resets)
constexpr int kScratchMaskedLanes = 2;
// Token groups x destination ranks: every dispatch CTA keeps the groups' first slots in shared memory
constexpr int kMaxGroupInts = 4096;
// Token groups per destination: a warp scans them with a fixed number per lane (one batch of loads)
constexpr int kMaxGroupsPerRank = 256;
// Experts whose token counts every fresh dispatch CTA gathers in shared memory first
constexpr int kMaxSharedExpertCounts = 4096;
constexpr int kScratchChannelBad = 32;
constexpr int kScratchGroupCounts = kScratchChannelBad + kMaxChannels;
constexpr int kScratchExpertCounts = kScratchGroupCounts + kMaxGroupInts;
constexpr int kDispatchScratchInts = kScratchExpertCounts + kMaxRanks * kMaxLocalExperts;

// One dispatched token: hidden bytes, scale bytes, then metadata (top-k ids as int32, top-k
// weights as float, source token index), each part padded to 16 bytes for vector copies. Records
// start on 128-byte lines (stores that straddle lines cost NVLink bandwidth) where that keeps them
// within DeepEP V2's record for the token (`kV2Bytes`, what its buffer hint counts), else on 16
// bytes: a window is never larger than V2's buffer.
template <int kHiddenBytes, int kNumScaleBytes, int kNumTopk>
struct DispatchRecord {
    static_assert(kHiddenBytes % 16 == 0, "hidden bytes must be a multiple of 16");
    static constexpr int kScaleOffset = kHiddenBytes;
    static constexpr int kMetaOffset = kScaleOffset + align_up(kNumScaleBytes, 16);
    static constexpr int kTopkIdxOffset = kMetaOffset;
    static constexpr int kWeightOffset = kTopkIdxOffset + kNumTopk * 4;
    static constexpr int kSrcIdxOffset = kWeightOffset + kNumTopk * 4;
    static constexpr int kPackedBytes = kMetaOffset + align_up(kNumTopk * 8 + 4, 16);
    static constexpr int kV2Bytes = kMetaOffset + align_up(kNumTopk * 8 + (1 + kNumTopk) * 4, 16);
    static constexpr int kBytes = align_up(kPackedBytes, 128) <= kV2Bytes ? align_up(kPackedBytes, 128) : kPackedBytes;
};

// One combine slot: a BF16 row, then the top-k weights of the token as seen by the holder rank.
template <int kHidden, int kNumTopk>
struct CombineSlot {
    static_assert(kHidden % 8 == 0, "hidden must be a multiple of 8");
    static constexpr int kRowBytes = kHidden * 2;
    static constexpr int kWeightOffset = kRowBytes;
    static constexpr int kBytes = kWeightOffset + align_up(kNumTopk * 4, 16);
};

// Where combine rows land in the home rank's window: per holder rank, a block of `Tmax` slots
// indexed like the token's dispatch slot there (`N * Tmax` slots), or per token, `K` slots indexed
// by top-k lane (`Tmax * K` slots): a holder's partial at its last lane, or without multiple
// reduction (`kNumRows` > 1) every lane's own row. The smaller of the two, as DeepEP V2 sizes its
// combine buffer (`min(N, K)` rows per token with multiple reduction, `K` without); the holder's
// weights travel in the slot of its last lane.
template <int kNumRanks, int kNumTopk, int kNumRows>
constexpr bool kCombineLaneSlots = kNumRows > 1 or kNumRanks > kNumTopk;

}  // namespace deep_ep
