#pragma once

// Device-side faults. A wait that passes its deadline records what it waited for in a host-mapped
// error block and makes the kernel return: Python turns the record into `EPTimeoutError`. Never
// `trap`: a trapped context is lost for the whole process.
//
// A failure is sticky and shared: the rank whose wait expired writes it into its window's status
// word and into every peer's, so every kernel of the buffer on every rank stops within one deadline:
// kernels check the word at entry and in every wait, and a failed epilogue neither resets the
// window's words nor posts its credit (a peer must not write into a window whose owner stopped
// reading). The first kernel of a rank that finds a failure copies it into that rank's error block,
// so every host raises. A failed buffer stays failed until it is destroyed.
//
// Peers outside our scale-up domain (scaleout.cuh) cannot take a compare-and-swap: the rank whose
// wait expired posts its status to each of them by a transport signal into a word of its own in
// their scale-out region (`forward_fault`, at the end of the kernel), and their waits look at those
// words as well as at the status word.
//
// Invalid routing that a dispatch finds on the device without a CPU sync (CUDA graphs) is not a
// failure: nothing is sent, the handle says so, and the input error block words name the first bad
// value for the host to raise at its next call.

#include <cstdint>

#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>

namespace deep_ep {

// Error block layout (int64 words); deep_ep/backends/kernels/layout.py mirrors it. `kErrRank` is
// the rank whose wait expired, `kErrReporter` the rank that owns the block (they differ when a peer
// told us).
enum ErrorWord : int {
    kErrStatus = 0,
    kErrPhase,
    kErrRank,
    kErrPeer,
    kErrChannel,
    kErrObserved,
    kErrExpected,
    kErrReporter,
    kErrInputStatus,
    kErrInputRow,
    kErrInputLane,
    kErrInputValue,
    kErrInputReason,
    kErrWords
};

// `kErrStatus` values, and `kErrInputReason` values
constexpr int64_t kErrTimedOutHere = 1, kErrReportedByPeer = 2;
// (`kInputPpSize`: a pipeline receive's tensor is not the size of the message, kernels/pp.cuh)
constexpr int64_t kInputOutOfRange = 1, kInputRepeated = 2, kInputPpSize = 3;

enum Phase : int {
    kPhaseBarrier = 1,
    kPhaseDispatchEntry = 2,
    kPhaseDispatchArrival = 3,
    kPhaseCombineEntry = 4,
    kPhaseCombineArrival = 5,
    kPhaseDispatchGrid = 6,
    kPhaseDispatchCounts = 7,
    kPhaseOpMismatch = 8,
    kPhaseOpSignature = 9,
    // Not a wait: a rank's host raised inside an operation or rejected its input (`post_fault.cuh`)
    kPhaseHostError = 10,
    // The emulated NIC of virtual nodes (transport/emulated.cuh) passed its deadline with work left
    kPhaseNic = 11,
    // Hybrid mode's forwarder (forward.cuh) waiting for what a source of another node sent it
    kPhaseForwardCounts = 12,
    kPhaseForwardArrival = 13,
    // An AGRS call (kernels/agrs.cuh) waiting for a peer's data
    kPhaseAgrsArrival = 14,
    // A pipeline send (kernels/pp.cuh) waiting for the receiver to free a slot, a receive for the message
    kPhasePpCredit = 15,
    kPhasePpArrival = 16,
};

// The status word: 0 while healthy; else the phase (bits 0-7), the rank whose wait expired + 1
// (bits 8-23), the rank it waited for + 1 (bits 24-39) and, when a peer wrote it, bit 40.
constexpr uint64_t kFaultPostedBit = 1ull << 40;

__device__ __forceinline__ uint64_t encode_fault(int phase, int rank, int peer) {
    return static_cast<uint64_t>(phase & 0xff) | static_cast<uint64_t>((rank + 1) & 0xffff) << 8 |
           static_cast<uint64_t>((peer + 1) & 0xffff) << 24;
}

struct FaultSink {
    int64_t* error_block;  // host-mapped, written once per failure
    char* window;          // this rank's window: status word, reported flag, rank, peers' windows
    // Which ranks are remote (scaleout.cuh: their failures come in words of our scale-out region,
    // one per source); none without a scale-out region (the tests on them then fold away)
    uint64_t remote_ranks = 0;

    __device__ __forceinline__ uint64_t* status() const { return reinterpret_cast<uint64_t*>(window + kStatusOffset); }

    __device__ __forceinline__ bool has_error() const {
        return *reinterpret_cast<const volatile uint64_t*>(status()) != 0;
    }

    // Whether the buffer has failed (here or on a peer); a peer's failure is copied into our error
    // block the first time a thread of ours sees it.
    __device__ __forceinline__ bool check() const {
        uint64_t value = *reinterpret_cast<const volatile uint64_t*>(status());
        if (value == 0) {
            if (remote_ranks == 0) return false;
            value = take_remote_fault();
            if (value == 0) return false;
        }
        record(value, -1, -1, -1);
        return true;
    }

    __device__ __forceinline__ void report_timeout(int phase, int rank, int peer, int channel, int observed,
                                                   int expected) const {
        const uint64_t value = encode_fault(phase, rank, peer);
        // The first failure wins; later ones (other CTAs giving up on the same peer) add nothing
        const auto previous = atomicCAS(reinterpret_cast<unsigned long long*>(status()), 0ull, value);
        if (previous != 0ull) {
            record(previous, -1, -1, -1);
            return;
        }
        record(value, channel, observed, expected);
        // Tell every peer, whose waits then stop too (a peer's own earlier failure stays)
        const int num_ranks = *reinterpret_cast<const int*>(window + kNumRanksOffset);
        const int self = *reinterpret_cast<const int*>(window + kRankOffset);
        void* const* peers = reinterpret_cast<void* const*>(window + kPeerWindowsOffset);
        for (int p = 0; p < num_ranks; ++p) {
            // Remote peers learn it from `forward_fault`
            if (p == self or (remote_ranks >> p) & 1) continue;
            atomicCAS_system(reinterpret_cast<unsigned long long*>(static_cast<char*>(peers[p]) + kStatusOffset), 0ull,
                             value | kFaultPostedBit);
        }
    }

private:
    // A failure a remote peer posted, made ours (the status word, so later checks are one load);
    // 0 when none has come
    __device__ __forceinline__ uint64_t take_remote_fault() const {
        const uint64_t* remote_faults = reinterpret_cast<const uint64_t*>(
            window + *reinterpret_cast<const int64_t*>(window + kScaleoutRegionOffset) + kRemoteFaultOffset);
        for (uint64_t pending = remote_ranks; pending != 0; pending &= pending - 1) {
            const int source = __ffsll(static_cast<long long>(pending)) - 1;
            const uint64_t posted = *reinterpret_cast<const volatile uint64_t*>(remote_faults + source);
            if (posted == 0) continue;
            const auto previous = atomicCAS(reinterpret_cast<unsigned long long*>(status()), 0ull,
                                            static_cast<unsigned long long>(posted | kFaultPostedBit));
            return previous != 0ull ? previous : posted | kFaultPostedBit;
        }
        return 0;
    }

    __device__ __forceinline__ void record(uint64_t value, int channel, int observed, int expected) const {
        if (atomicCAS(reinterpret_cast<int*>(window + kFaultReportedOffset), 0, 1) != 0) return;
        volatile int64_t* block = error_block;
        block[kErrPhase] = static_cast<int64_t>(value & 0xff);
        block[kErrRank] = static_cast<int64_t>((value >> 8) & 0xffff) - 1;
        block[kErrPeer] = static_cast<int64_t>((value >> 24) & 0xffff) - 1;
        block[kErrChannel] = channel;
        block[kErrObserved] = observed;
        block[kErrExpected] = expected;
        block[kErrReporter] = *reinterpret_cast<const int*>(window + kRankOffset);
        __threadfence_system();
        block[kErrStatus] = (value & kFaultPostedBit) ? kErrReportedByPeer : kErrTimedOutHere;
        __threadfence_system();
    }
};

__device__ __forceinline__ FaultSink make_fault_sink(void* local_window, int64_t* error_block) {
    return {error_block, static_cast<char*>(local_window)};
}

// The same, also watching the failures that remote peers post (scaleout.cuh)
template <bool kScaleout>
__device__ __forceinline__ FaultSink make_fault_sink(void* local_window, int64_t* error_block,
                                                     const Scaleout<kScaleout>& scaleout) {
    FaultSink sink = make_fault_sink(local_window, error_block);
    if constexpr (kScaleout)
        sink.remote_ranks = scaleout.remote_ranks(*reinterpret_cast<const int*>(sink.window + kNumRanksOffset));
    return sink;
}

// Every thread of an issuing CTA calls it at the end of a kernel with a transport (sends.cuh): a failure that
// began on this rank (not one a peer told us of) goes to every remote peer, once per buffer (its
// own word there, by a transport signal; peers of our scale-up domain had it by compare-and-swap).
// A host's error (`kPhaseHostError`) goes from `post_fault.cuh` only (`is_host_error`), after the
// message that says what it was.
template <typename Transport, bool kScaleout>
__device__ __forceinline__ void forward_fault(const Transport& transport, const FaultSink& fault,
                                              const Scaleout<kScaleout>& scaleout, bool is_host_error = false) {
    if constexpr (kScaleout) {
        if (threadIdx.x != 0) return;
        const uint64_t value = *reinterpret_cast<const volatile uint64_t*>(fault.status());
        if (value == 0 or (value & kFaultPostedBit) != 0) return;
        if (((value & 0xff) == kPhaseHostError) != is_host_error) return;
        if (atomicCAS(reinterpret_cast<int*>(fault.window + kFaultForwardedOffset), 0, 1) != 0) return;
        const int self = *reinterpret_cast<const int*>(fault.window + kRankOffset);
        for (uint64_t pending = fault.remote_ranks; pending != 0; pending &= pending - 1) {
            const int peer = __ffsll(static_cast<long long>(pending)) - 1;
            transport.signal_add(peer, scaleout.fault_offset(self), value);
        }
    }
}

// Every thread of the CTA calls it: whether the buffer has failed, the same answer on every thread
// (one read, so that a failure posted meanwhile cannot split the CTA).
__device__ __forceinline__ bool buffer_failed(const FaultSink& fault) {
    return __syncthreads_or(threadIdx.x == 0 and fault.check());
}

// The input error words: the first record wins until the host has read and cleared it.
__device__ __forceinline__ void report_input_error(int64_t* error_block, int64_t row, int64_t lane, int64_t value,
                                                   int64_t reason) {
    volatile int64_t* block = error_block;
    if (block[kErrInputStatus] != 0) return;
    block[kErrInputRow] = row;
    block[kErrInputLane] = lane;
    block[kErrInputValue] = value;
    block[kErrInputReason] = reason;
    __threadfence_system();
    block[kErrInputStatus] = 1;
    __threadfence_system();
}

}  // namespace deep_ep
