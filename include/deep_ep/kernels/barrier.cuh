#pragma once

// A barrier across every rank of the buffer that is not masked (rank_mask.cuh: a buffer without
// rank masking never sets the mask), with a deadline: one CTA, channel 0 (and with an emulated NIC,
// the NIC's CTA after it). Remote peers (scaleout.cuh) take part through the transport.

#include <deep_ep/common/comm.cuh>
#include <deep_ep/common/scaleout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

template <int kNumRanks, typename Transport>
__global__ void __launch_bounds__(128, 1) barrier_impl(char* window, int rank, int64_t* error_block,
                                                       uint64_t timeout_ns, typename Transport::Args transport_args) {
    const Transport nic(transport_args);
    const Scaleout<Transport::kHasRemote> scaleout = load_scaleout<Transport::kHasRemote>(window, rank);
    const FaultSink fault = make_fault_sink(window, error_block, scaleout);
    if (run_nic_cta(nic, fault, rank, false)) return;
    const Transport transport = nic.for_warp(threadIdx.x / 32);
    channel_barrier<kNumRanks>(window, rank, 0, kPhaseBarrier, fault, timeout_ns, load_rank_mask<true>(window, rank),
                               transport, scaleout);
    finish_sends(transport, scaleout, fault, rank, timeout_ns);
}

}  // namespace deep_ep
