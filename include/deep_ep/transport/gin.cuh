#pragma once

// The transport verbs (docs/transport.md) over NCCL GIN, for peers outside our LSA team: `put_warp`
// is the warp's `ncclGin::put` from our window to the peer's (it returns before the data moves;
// puts are unordered), `get_warp` its `ncclGin::get` from the peer's window into ours, `signal_add` a strong 64-bit VA
// signal (a peer that observes it sees every earlier put of this context to that peer), `flush_warp` waits until every
// put of the warp has read its source (not: has landed) and every get of the warp has landed, with a deadline from
// NCCL 2.31, `read_signal` an acquire read of our own word. The interface of lsa.cuh. Compiled only (no machine here
// has an RDMA NIC), against NCCL 2.30.4 (DeepEP V2's floor) and newer.

#include <cstddef>
#include <cstdint>

#include <nccl_device.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 30, 4)
#error "deep_ep's GIN transport needs NCCL >= 2.30.4 (DeepEP V2's floor): install a newer nvidia-nccl-cu12 or -cu13"
#endif

namespace deep_ep::transport {

struct Gin {
    static constexpr bool kHasNic = false;    // no NIC of ours to run (emulated.cuh has one)
    static constexpr bool kHasRemote = true;  // the ranks of other nodes
    static constexpr bool kHybrid = false;    // hybrid.cuh
    static constexpr bool kHybridLaneSlots = false;

    struct Args {
        ncclDevComm comm;     // the device communicator of a communicator of our own (never torch's)
        ncclWindow_t window;  // our window, registered with NCCL_WIN_STRICT_ORDERING (VA signals need it)
        int context;          // the GIN context of this object (one per QP)
        int num_contexts;     // the contexts warps take in turn: the call's QPs, at most `ginContextCount`
    };
    // The kernel's argument, by reference (ncclGin keeps a reference to its communicator too); the
    // ncclGin of our context is made in each call, so that its registers are held only there
    const Args& args;
    int context;

    __device__ __forceinline__ Gin(const Args& args_, int context_) : args(args_), context(context_) {}
    __device__ __forceinline__ explicit Gin(const Args& args_) : Gin(args_, args_.context) {}

    // The transport a warp posts through: its QP (context), the warps taking the call's QPs in turn
    __device__ __forceinline__ Gin for_warp(int global_warp_idx) const {
        return Gin(args, global_warp_idx % args.num_contexts);
    }

    __device__ __forceinline__ void put_warp(int, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        const ncclGin gin(args.comm, context);
        gin.put(ncclTeamWorld(args.comm), peer, args.window, dst_offset, args.window, src_offset, num_bytes,
                ncclGin_None{}, ncclGin_None{}, ncclCoopWarp());
    }

    // A read of the peer's window into ours (`ncclGin::get`, an RDMA read on the context's QP): the
    // data is ours once `flush_warp` has returned true (the read's completion)
    __device__ __forceinline__ void get_warp(int, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        const ncclGin gin(args.comm, context);
        gin.get(ncclTeamWorld(args.comm), peer, args.window, src_offset, args.window, dst_offset, num_bytes,
                ncclCoopWarp());
    }

    __device__ __forceinline__ void signal_add(int peer, size_t word_offset, uint64_t value) const {
        const ncclGin gin(args.comm, context);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 5)
        gin.signal(ncclTeamWorld(args.comm), peer, ncclGin_StrongVASignalAdd{args.window, word_offset, value});
#else
        // 2.30.4 has one kind of VA signal, ordered after the context's earlier puts to the peer
        gin.signal(ncclTeamWorld(args.comm), peer, ncclGin_VASignalAdd{args.window, word_offset, value});
#endif
    }

    // False when the deadline passed (from 2.31; before it NCCL's flush has none)
    __device__ __forceinline__ bool flush_warp(uint64_t timeout_cycles) const {
        const ncclGin gin(args.comm, context);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 31, 0)
        return gin.flush(ncclCoopWarp(), cuda::memory_order_acquire, ncclGin_None{}, timeout_cycles) == ncclSuccess;
#else
        (void)timeout_cycles;
        gin.flush(ncclCoopWarp());
        return true;
#endif
    }

    __device__ __forceinline__ uint64_t read_signal(size_t word_offset) const {
        const ncclGin gin(args.comm, context);
        return gin.readSignal(args.window, word_offset, 64, cuda::memory_order_acquire);
    }

    // Nothing to tell: no NIC of ours drains a queue
    __device__ __forceinline__ void finish_posting() const {}

    // No NIC CTA to run: the NIC is real
    template <typename OnTimeout>
    __device__ __forceinline__ void run_nic(int, const OnTimeout&) const {}
};

// The host packs `Gin::Args` as bytes (deep_ep/backends/kernels/nccl/gin_links.py, `gin_args_layout`)
// from sizeof(ncclDevComm) alone: the window at the next multiple of 8, then the two ints, the whole
// a multiple of 8. The same formula, checked against the real struct: CI compiles this header against
// every NCCL release it supports, so host and device agree or the build fails.
namespace detail {
constexpr size_t kGinArgsWindowOffset = (sizeof(ncclDevComm) + 7) / 8 * 8;
}  // namespace detail
static_assert(alignof(ncclDevComm) <= 8 and sizeof(ncclWindow_t) == 8, "gin_links.py assumes an 8-byte layout");
static_assert(offsetof(Gin::Args, comm) == 0, "gin_links.py: `comm` first");
static_assert(offsetof(Gin::Args, window) == detail::kGinArgsWindowOffset, "gin_links.py: `window` offset");
static_assert(offsetof(Gin::Args, context) == detail::kGinArgsWindowOffset + 8, "gin_links.py: `context` offset");
static_assert(offsetof(Gin::Args, num_contexts) == detail::kGinArgsWindowOffset + 12,
              "gin_links.py: `num_contexts` offset");
static_assert(sizeof(Gin::Args) == detail::kGinArgsWindowOffset + 16, "gin_links.py: sizeof(Gin::Args)");

}  // namespace deep_ep::transport
