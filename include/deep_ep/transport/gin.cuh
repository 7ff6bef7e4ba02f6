#pragma once

// The transport verbs (docs/transport.md) over NCCL GIN, for peers outside our LSA team: `put_warp`
// is the warp's `ncclGin::put` from our window to the peer's (it returns before the data moves;
// puts are unordered), `signal_add` a strong 64-bit VA signal (a peer that observes it sees every
// earlier put of this context to that peer), `flush_warp` waits until every put of the warp has
// read its source (not: has landed), with a deadline from NCCL 2.31, `read_signal` an acquire read
// of our own word. The interface of lsa.cuh. Compiled only (no machine here has an RDMA NIC),
// against NCCL 2.30.4 (DeepEP V2's floor) and newer.

#include <cstddef>
#include <cstdint>

#include <nccl_device.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 30, 4)
#error "deep_ep's GIN transport needs NCCL >= 2.30.4 (DeepEP V2's floor): install a newer nvidia-nccl-cu12 or -cu13"
#endif

namespace deep_ep::transport {

struct Gin {
    static constexpr bool kHasNic = false;  // no NIC of ours to run (emulated.cuh has one)

    struct Args {
        ncclDevComm comm;     // the device communicator of a communicator of our own (never torch's)
        ncclWindow_t window;  // our window, registered with NCCL_WIN_STRICT_ORDERING (VA signals need it)
        int context;          // the GIN context (one per QP: `ginContextCount` is the buffer's QP count)
    };
    ncclGin gin;
    ncclTeam team;  // the world team: peers by their rank in the group
    ncclWindow_t window;

    __device__ __forceinline__ explicit Gin(const Args& args)
        : gin(args.comm, args.context), team(ncclTeamWorld(args.comm)), window(args.window) {}

    __device__ __forceinline__ void put_warp(int, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        gin.put(team, peer, window, dst_offset, window, src_offset, num_bytes, ncclGin_None{}, ncclGin_None{},
                ncclCoopWarp());
    }

    __device__ __forceinline__ void signal_add(int peer, size_t word_offset, uint64_t value) const {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 5)
        gin.signal(team, peer, ncclGin_StrongVASignalAdd{window, word_offset, value});
#else
        // 2.30.4 has one kind of VA signal, ordered after the context's earlier puts to the peer
        gin.signal(team, peer, ncclGin_VASignalAdd{window, word_offset, value});
#endif
    }

    // False when the deadline passed (from 2.31; before it NCCL's flush has none)
    __device__ __forceinline__ bool flush_warp(uint64_t timeout_cycles) const {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 31, 0)
        return gin.flush(ncclCoopWarp(), cuda::memory_order_acquire, ncclGin_None{}, timeout_cycles) == ncclSuccess;
#else
        (void)timeout_cycles;
        gin.flush(ncclCoopWarp());
        return true;
#endif
    }

    __device__ __forceinline__ uint64_t read_signal(size_t word_offset) const {
        return gin.readSignal(window, word_offset, 64, cuda::memory_order_acquire);
    }

    // Nothing to tell: no NIC of ours drains a queue
    __device__ __forceinline__ void finish_posting() const {}
};

}  // namespace deep_ep::transport
