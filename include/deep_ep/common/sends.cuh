#pragma once

// The start and the end of every kernel that sends through a transport (include/deep_ep/transport/):
// with an emulated NIC, the grid's last CTA is the NIC and does nothing else; at the end, every
// issuing CTA flushes its warps' puts, forwards a failure of its own to the remote peers and tells
// the NIC it is done. Over LSA alone both are nothing (the tests fold away).

#include <cstdint>

#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/ptx.cuh>
#include <deep_ep/common/scaleout.cuh>

namespace deep_ep {

// Every thread of every CTA calls it first: true on the emulated NIC's CTA, which has then run the
// NIC to its end (its deadline passing fails the buffer) and is done. A kernel whose dependents may
// launch early (programmatic dependent launch) lets them, as its other CTAs do.
template <typename Transport>
__device__ __forceinline__ bool run_nic_cta(const Transport& nic, const FaultSink& fault, int rank,
                                            bool launches_dependents) {
    if constexpr (Transport::kHasNic) {
        if (blockIdx.x == num_issuing_ctas<Transport>()) {
            if (launches_dependents) griddep_launch_dependents();
            nic.run_nic(num_issuing_ctas<Transport>(),
                        [&](int num_pending) { fault.report_timeout(kPhaseNic, rank, rank, -1, num_pending, 0); });
            return true;
        }
    }
    return false;
}

// Every thread of every issuing CTA of a kernel with a transport, at its end: every put of the warp
// has read its source (so the staging ring and the staged counts may change in the next kernel), a
// failure that began here goes to the remote peers, and an emulated NIC may stop once every issuing
// CTA is here. Over LSA alone, nothing.
template <typename Transport, bool kScaleout>
__device__ __forceinline__ void finish_sends(const Transport& transport, const Scaleout<kScaleout>& scaleout,
                                             const FaultSink& fault, int rank, uint64_t timeout_ns) {
    if constexpr (kScaleout) {
        if (not transport.flush_warp(timeout_ns) and threadIdx.x % 32 == 0)
            fault.report_timeout(kPhaseNic, rank, rank, blockIdx.x, 0, 0);
        forward_fault(transport, fault, scaleout);
    }
    transport.finish_posting();
}

// A kernel's whole run with a transport: its scale-out view and fault sink, the NIC's CTA, the body
// on every issuing CTA with the warp's transport (`body(transport, scaleout, fault)`), and the end of
// the sends. `args` is the kernel's argument struct (its `window_base`, `rank`, `error_block` and
// `timeout_ns`). Every thread of every CTA calls it.
template <typename Transport, int kNumThreads, typename Args, typename Body>
__device__ __forceinline__ void run_with_transport(const Args& args, const typename Transport::Args& transport_args,
                                                   bool launches_dependents, const Body& body) {
    const Transport nic(transport_args);
    const Scaleout<Transport::kHasRemote> scaleout = load_scaleout<Transport::kHasRemote>(args.window_base, args.rank);
    const FaultSink fault = make_fault_sink(args.window_base, args.error_block, scaleout);
    if (run_nic_cta(nic, fault, args.rank, launches_dependents)) return;
    const Transport transport = nic.for_warp(blockIdx.x * (kNumThreads / 32) + threadIdx.x / 32);
    body(transport, scaleout, fault);
    finish_sends(transport, scaleout, fault, args.rank, args.timeout_ns);
}

}  // namespace deep_ep
