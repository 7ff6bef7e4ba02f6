#pragma once

// Transport self-test: every rank puts `num_bytes` of its window (at `src_offset`) into each peer's
// window (at `dst_offset + rank * num_bytes`), signals that peer (the 64-bit word at `signal_offset +
// rank * 8`), flushes, then waits until every peer's word reached `round`, with a deadline. A warp
// per peer; `status[p]` becomes 1 once peer p's signal arrived, -1 on a deadline or a failed flush.
// The host then checks the bytes. One body for every transport (`Transport`: transport/lsa.cuh,
// and transport/gin.cuh with DEEP_EP_WITH_GIN).

#include <cstdint>

#include <deep_ep/common/ptx.cuh>
#include <deep_ep/transport/lsa.cuh>
#if DEEP_EP_WITH_GIN
#include <deep_ep/transport/gin.cuh>
#endif

namespace deep_ep {

struct TransportPingArgs {
    uint64_t src_offset;
    uint64_t dst_offset;
    uint64_t num_bytes;  // a multiple of 16
    uint64_t signal_offset;
    uint64_t round;  // the value every peer's word reaches in this round
    uint64_t timeout_ns;
    int rank;
    int num_ranks;
    int* status;  // [num_ranks]
};

template <typename Transport, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    transport_ping_impl(typename Transport::Args transport_args, TransportPingArgs args) {
    const Transport transport(transport_args);
    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    constexpr int kNumWarps = kNumThreads / 32;
    for (int peer = warp_idx; peer < args.num_ranks; peer += kNumWarps) {
        if (peer == args.rank) continue;
        transport.put_warp(lane_idx, peer, args.dst_offset + args.rank * args.num_bytes, args.src_offset,
                           args.num_bytes);
        __syncwarp();
        if (lane_idx == 0) transport.signal_add(peer, args.signal_offset + args.rank * 8, 1);
        // The source may be reused only after the flush; a timeout cycle is about a nanosecond
        const bool flushed = transport.flush_warp(args.timeout_ns);
        if (lane_idx == 0 and not flushed) args.status[peer] = -1;
    }
    for (int peer = warp_idx; peer < args.num_ranks; peer += kNumWarps) {
        if (peer == args.rank or lane_idx != 0 or args.status[peer] < 0) continue;
        const uint64_t deadline = global_timer_ns() + args.timeout_ns;
        int arrived = 0;
        while (arrived == 0) {
            if (transport.read_signal(args.signal_offset + peer * 8) >= args.round)
                arrived = 1;
            else if (global_timer_ns() > deadline)
                arrived = -1;
        }
        args.status[peer] = arrived;
    }
}

}  // namespace deep_ep
