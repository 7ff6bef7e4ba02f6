#pragma once

// The transport verbs (docs/transport.md) for peers whose windows this rank reaches by loads and
// stores (NVLink, or the virtual ranks of one GPU): `put_warp` is the warp's copy from our window
// into the peer's, `get_warp` from the peer's into ours, `signal_add` a system-scope release add to a 64-bit word of
// the peer's window, `flush_warp` nothing (a store has read its source when it retires), `read_signal` an acquire load
// of our own word. The interface of gin.cuh and emulated.cuh, so that one kernel templated on the
// transport serves all three. As the transport of the communication kernels it has no remote peers
// (`kHasRemote`): every peer is one of our scale-up domain, reached by the kernels' own stores, and
// every test of the scale-out path folds away. No NCCL headers: the peers' window bases come from
// the workspace.

#include <cstddef>
#include <cstdint>

#include <deep_ep/common/ptx.cuh>

namespace deep_ep::transport {

struct Lsa {
    static constexpr bool kHasNic = false;     // no NIC of ours to run (emulated.cuh has one)
    static constexpr bool kHasRemote = false;  // no peer outside the scale-up domain
    static constexpr bool kHybrid = false;     // hybrid.cuh
    static constexpr bool kHybridLaneSlots = false;

    struct Args {
        char* const* peer_windows;  // [num_ranks] every rank's window base, as this rank reaches it
        int rank;
    };
    Args args;

    __device__ __forceinline__ explicit Lsa(const Args& args_) : args(args_) {}

    // The transport a warp posts through (one context: the same object)
    __device__ __forceinline__ Lsa for_warp(int) const { return *this; }

    // `num_bytes` a multiple of 16; the caller orders the copy before its signal (`__syncwarp`,
    // then `signal_add` from one lane)
    __device__ __forceinline__ void put_warp(int lane_idx, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        copy(lane_idx, 32, peer, dst_offset, src_offset, num_bytes);
    }

    // The copy of `put_warp` by threads `first, first + stride, ...` (the emulated NIC uses a CTA)
    __device__ __forceinline__ void copy(int first, int stride, int peer, size_t dst_offset, size_t src_offset,
                                         size_t num_bytes) const {
        const int4* src = reinterpret_cast<const int4*>(args.peer_windows[args.rank] + src_offset);
        int4* dst = reinterpret_cast<int4*>(args.peer_windows[peer] + dst_offset);
        for (size_t v = first; v < num_bytes / 16; v += stride) st_na_v4(dst + v, ld_window_v4(src + v));
    }

    // `num_bytes` a multiple of 16: the warp's copy from the peer's window into ours; complete when
    // the warp's loads retire (`flush_warp` has nothing to wait for)
    __device__ __forceinline__ void get_warp(int lane_idx, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        copy_from(lane_idx, 32, peer, dst_offset, src_offset, num_bytes);
    }

    // The copy of `get_warp` by threads `first, first + stride, ...` (the emulated NIC uses a CTA)
    __device__ __forceinline__ void copy_from(int first, int stride, int peer, size_t dst_offset, size_t src_offset,
                                              size_t num_bytes) const {
        const int4* src = reinterpret_cast<const int4*>(args.peer_windows[peer] + src_offset);
        int4* dst = reinterpret_cast<int4*>(args.peer_windows[args.rank] + dst_offset);
        for (size_t v = first; v < num_bytes / 16; v += stride) st_na_v4(dst + v, ld_window_v4(src + v));
    }

    // Strong: a peer that observes the add sees every store the warp made before the `__syncwarp`
    // that precedes this call (the fence makes the other lanes' stores cumulative with the release)
    __device__ __forceinline__ void signal_add(int peer, size_t word_offset, uint64_t value) const {
        fence_acq_rel_sys();
        red_add_release_sys_u64(reinterpret_cast<uint64_t*>(args.peer_windows[peer] + word_offset), value);
    }

    __device__ __forceinline__ bool flush_warp(uint64_t) const { return true; }

    __device__ __forceinline__ uint64_t read_signal(size_t word_offset) const {
        return ld_acquire_sys_u64(reinterpret_cast<const uint64_t*>(args.peer_windows[args.rank] + word_offset));
    }

    // Nothing to tell: no NIC of ours drains a queue
    __device__ __forceinline__ void finish_posting() const {}

    // No NIC CTA to run
    template <typename OnTimeout>
    __device__ __forceinline__ void run_nic(int, const OnTimeout&) const {}
};

}  // namespace deep_ep::transport
