#pragma once

// The flags of a pipeline-parallel send or receive inside one NVLink domain
// (deep_ep/backends/kernels/pp.py). The data moves with the copy engines, queued by the host on the
// same stream between two of these one-warp kernels: a sender's message lands straight in a slot
// the receiver's window keeps for it, and the receiver copies it out from there.
//
// The PP region of every rank's window (the same offset on every rank) starts with, per rank `p`,
// `arrived[p]` (the number of messages `p` has put into our slots), `freed[p]` (the number of our
// messages `p` has copied out of its slots) and the byte size of each of `p`'s slots; the slots
// follow. Message `m` (from 1) of a pair takes slot `(m - 1) % num_slots` (the host's count: `m`
// here is that count as an int32, which may wrap, compared as a difference).
//
// - kSendWait: before the copy into the peer's slot: wait, with the deadline, until the peer has
//   freed the slot (`freed[peer]` reached `m - num_slots`): the back-pressure of a full ring.
// - kSendSignal: after the copy: the size of the slot, then a release store of `m` into the peer's
//   `arrived[rank]` (the copy is complete in stream order; one system fence makes it visible first).
// - kRecvWait: before the copy out: wait, with the deadline, until `arrived[peer]` reached `m`;
//   a size other than the receiver's is an input error (the host raises it at the buffer's next call).
// - kRecvFree: after the copy out: a release store of `m` into the peer's `freed[rank]`.

#include <cstdint>

#include <deep_ep/common/arrivals.cuh>
#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/ptx.cuh>

namespace deep_ep {

enum PpStep : int { kPpSendWait = 0, kPpSendSignal = 1, kPpRecvWait = 2, kPpRecvFree = 3 };

struct PpArgs {
    char* window;  // this rank's window
    int64_t* error_block;
    uint64_t timeout_ns;
    int64_t region_offset;  // the PP region, the same offset in every rank's window
    int64_t num_bytes;      // the message's bytes (send), or the receiving tensor's (receive)
    int sequence;           // the message's number in this pair, from 1 (wraps)
    int num_slots;          // slots per pair
    int slot;               // the message's slot: (number - 1) % num_slots
    int rank;
    int peer;
};

struct PpRegion {
    char* base;
    int num_slots;
    __device__ __forceinline__ int* arrived(int source) const { return reinterpret_cast<int*>(base) + source; }
    __device__ __forceinline__ int* freed(int receiver) const {
        return reinterpret_cast<int*>(base) + kMaxRanks + receiver;
    }
    __device__ __forceinline__ int64_t* slot_bytes(int source, int slot) const {
        return reinterpret_cast<int64_t*>(base + 2 * kMaxRanks * sizeof(int)) + source * num_slots + slot;
    }
};

template <int kStep>
__global__ void __launch_bounds__(32, 1) pp_impl(PpArgs args) {
    if (threadIdx.x != 0) return;
    const FaultSink fault = make_fault_sink(args.window, args.error_block);
    if (fault.check()) return;
    void* const* peer_windows = reinterpret_cast<void* const*>(args.window + kPeerWindowsOffset);
    const PpRegion own{args.window + args.region_offset, args.num_slots};
    const PpRegion peer{static_cast<char*>(peer_windows[args.peer]) + args.region_offset, args.num_slots};
    if constexpr (kStep == kPpSendWait) {
        wait_counter(own.freed(args.peer), static_cast<int>(static_cast<unsigned>(args.sequence) - args.num_slots),
                     fault, kPhasePpCredit, args.rank, args.peer, -1, args.timeout_ns);
    } else if constexpr (kStep == kPpSendSignal) {
        fence_acq_rel_sys();
        *reinterpret_cast<volatile int64_t*>(peer.slot_bytes(args.rank, args.slot)) = args.num_bytes;
        st_release_sys(peer.arrived(args.rank), args.sequence);
    } else if constexpr (kStep == kPpRecvWait) {
        if (not wait_counter(own.arrived(args.peer), args.sequence, fault, kPhasePpArrival, args.rank, args.peer, -1,
                             args.timeout_ns))
            return;
        const int64_t sent = *reinterpret_cast<volatile int64_t*>(own.slot_bytes(args.peer, args.slot));
        if (sent != args.num_bytes) report_input_error(args.error_block, args.peer, args.num_bytes, sent, kInputPpSize);
    } else {
        st_release_sys(peer.freed(args.rank), args.sequence);
    }
}

}  // namespace deep_ep
