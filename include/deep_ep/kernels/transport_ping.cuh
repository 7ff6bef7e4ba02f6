#pragma once

// Transport self-test: every rank puts `num_bytes` of its window (at `src_offset`) into each peer's
// window (at `dst_offset + rank * num_bytes`) and signals that peer (the 64-bit word at `signal_offset
// + rank * 8`), flushes, and reuses its source at once (overwrites it, as a kernel reusing a staging
// buffer would). Meanwhile other warps wait until every peer's word reached `round`, with a deadline,
// and at once copy what that peer sent to `snapshot_offset + peer * num_bytes`: what a consumer reads
// right after the signal, which the host checks. `status[p]` becomes 1 once peer p's signal arrived,
// -1 on a deadline or a failed flush. One body for every transport (`Transport`: transport/lsa.cuh,
// transport/emulated.cuh, and transport/gin.cuh with DEEP_EP_WITH_GIN); with an emulated NIC
// (`Transport::kHasNic`) the grid's last CTA is the NIC, and its `mistake` argument
// (transport/emulated.cuh) breaks the protocol on purpose, so that tests can show it catches that.

#include <cstdint>

#include <deep_ep/common/ptx.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

struct TransportPingArgs {
    uint64_t src_offset;
    uint64_t dst_offset;
    uint64_t num_bytes;  // a multiple of 16
    uint64_t signal_offset;
    uint64_t snapshot_offset;
    uint64_t round;  // the value every peer's word reaches in this round
    uint64_t timeout_ns;
    char* own_window;  // this rank's window base (the source is reused through it)
    int rank;
    int num_ranks;
    int* status;  // [num_ranks]
};

template <typename Transport, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1)
    transport_ping_impl(typename Transport::Args transport_args, TransportPingArgs args) {
    // Half the warps send (put, signal, flush, then reuse the source at once, as a kernel reusing a
    // staging buffer would); the other half read what the peers sent right after each signal. Side by
    // side, so that a signal ahead of its data and a source reused before its put ran both show
    constexpr int kNumWarps = kNumThreads / 32, kNumSenders = kNumWarps / 2;
    static_assert(kNumSenders >= 1 and kNumWarps - kNumSenders >= 1, "senders and readers");
    const Transport nic(transport_args);
    if constexpr (Transport::kHasNic) {
        if (blockIdx.x == gridDim.x - 1) {
            nic.run_nic(gridDim.x - 1, [](int) {});
            return;
        }
    }
    __shared__ int flush_failed;
    if (threadIdx.x == 0) flush_failed = 0;
    __syncthreads();
    const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
    const Transport transport = nic.for_warp(blockIdx.x * kNumWarps + warp_idx);
    if (warp_idx < kNumSenders) {
        for (int peer = warp_idx; peer < args.num_ranks; peer += kNumSenders) {
            if (peer == args.rank) continue;
            transport.put_warp(lane_idx, peer, args.dst_offset + args.rank * args.num_bytes, args.src_offset,
                               args.num_bytes);
            if (lane_idx == 0) transport.signal_add(peer, args.signal_offset + args.rank * 8, 1);
        }
        // One flush covers every put of the warp (a timeout cycle is about a nanosecond); once every
        // sender's returned, the source changes
        if (not transport.flush_warp(args.timeout_ns) and lane_idx == 0) flush_failed = 1;
        asm volatile("bar.sync 1, %0;" ::"r"(kNumSenders * 32) : "memory");
        int4* src = reinterpret_cast<int4*>(args.own_window + args.src_offset);
        for (size_t v = threadIdx.x; v < args.num_bytes / 16; v += kNumSenders * 32) {
            const int4 value = src[v];
            src[v] = make_int4(~value.x, ~value.y, ~value.z, ~value.w);
        }
    } else {
        for (int peer = warp_idx - kNumSenders; peer < args.num_ranks; peer += kNumWarps - kNumSenders) {
            if (peer == args.rank) continue;
            int arrived = 0;
            if (lane_idx == 0) {
                const uint64_t deadline = global_timer_ns() + args.timeout_ns;
                while (arrived == 0) {
                    if (transport.read_signal(args.signal_offset + peer * 8) >= args.round)
                        arrived = 1;
                    else if (global_timer_ns() > deadline)
                        arrived = -1;
                }
                args.status[peer] = arrived;
            }
            // What the peer sent, read right after its signal (lane 0's acquire, shared by the warp)
            if (__shfl_sync(0xffffffff, arrived, 0) == 1) {
                const size_t offset = peer * args.num_bytes;
                const int4* block = reinterpret_cast<const int4*>(args.own_window + args.dst_offset + offset);
                int4* snapshot = reinterpret_cast<int4*>(args.own_window + args.snapshot_offset + offset);
                for (size_t v = lane_idx; v < args.num_bytes / 16; v += 32) snapshot[v] = ld_window_v4(block + v);
            }
        }
    }
    __syncthreads();
    for (int peer = threadIdx.x; flush_failed and peer < args.num_ranks; peer += kNumThreads)
        if (peer != args.rank) args.status[peer] = -1;
    // After the flush: the NIC stops (and starts its queues over) once every issuing CTA is here
    transport.finish_posting();
}

}  // namespace deep_ep
