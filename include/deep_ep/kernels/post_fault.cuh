#pragma once

// A rank's host tells every peer that it stopped the buffer: its input was rejected, or it raised
// inside an operation. Peers may already wait in kernels for this rank's records or credits; the
// fault makes those waits return at once instead of at their deadline, and every host raises,
// naming this rank and, from the message, what it did wrong. One warp: the message into every
// rank's slot of this rank (ours too; a remote peer's by a put of ours), then the fault as a wait
// that expired would post it (a remote peer's by a transport signal after the put). With an
// emulated NIC, the NIC's CTA comes after the warp's.

#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

template <int kNumThreads, typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    post_fault_impl(char* window, int64_t* error_block, const int4* message, uint64_t timeout_ns,
                    typename Transport::Args transport_args) {
    static_assert(kPeerMessageBytes % 16 == 0 and kNumThreads * 16 >= kPeerMessageBytes, "one int4 per thread");
    const Transport nic(transport_args);
    const int rank = *reinterpret_cast<const int*>(window + kRankOffset);
    const int num_ranks = *reinterpret_cast<const int*>(window + kNumRanksOffset);
    const Scaleout<Transport::kHasRemote> scaleout = load_scaleout<Transport::kHasRemote>(window, rank);
    const FaultSink fault = make_fault_sink(window, error_block, scaleout);
    if (run_nic_cta(nic, fault, rank, false)) return;
    const Transport transport = nic.for_warp(0);
    void* const* windows = reinterpret_cast<void* const*>(window + kPeerWindowsOffset);
    const int64_t message_offset = kPeerMessageOffset + int64_t(rank) * kPeerMessageBytes;
    const int word = threadIdx.x;
    if (word < kPeerMessageBytes / 16) {
        const int4 value = message[word];  // host-mapped: read once
        for (int peer = 0; peer < num_ranks; ++peer) {
            if (scaleout.is_remote(peer)) continue;
            char* slot = static_cast<char*>(windows[peer]) + message_offset;
            reinterpret_cast<int4*>(slot)[word] = value;
        }
    }
    // The message is visible on every rank before the fault that tells them to read it
    __threadfence_system();
    __syncthreads();
    if constexpr (Transport::kHasRemote) {
        // Our own copy of the message to each remote peer, on the context of the signal that follows
        for (int peer = 0; peer < num_ranks; ++peer)
            if (scaleout.is_remote(peer))
                transport.put_warp(threadIdx.x % 32, peer, message_offset, message_offset, kPeerMessageBytes);
    }
    if (threadIdx.x == 0) fault.report_timeout(kPhaseHostError, rank, rank, -1, 0, 0);
    __syncthreads();
    forward_fault(transport, fault, scaleout, true);
    finish_sends(transport, scaleout, fault, rank, timeout_ns);
}

}  // namespace deep_ep
