#pragma once

// The transport verbs (docs/transport.md) through an emulated NIC, for virtual nodes on one GPU:
// what GIN guarantees and nothing more, so that a kernel that leans on more fails here instead of
// on a cluster. Two modes:
// - eager (`Emulated<false>`): the calling warp copies at once and the signal is a release add, as
//   over LSA (fast; it catches only what LSA would);
// - strict (`Emulated<true>`): a put is posted to a queue that the NIC (the last CTA of the grid,
//   `run_nic`) executes late (no sooner than `delay_ns` after it took the put in) and in shuffled
//   order, reading the source only then (a source reused before `flush_warp` shows up as wrong
//   bytes); a signal is applied only after the earlier puts of its context to its peer; nothing is
//   ordered across contexts.
// The queues are device memory private to the rank (not its window): descriptors of four 64-bit
// words, written by the poster and published by a release of the first word.

#include <cstddef>
#include <cstdint>

#include <deep_ep/common/ptx.cuh>
#include <deep_ep/transport/lsa.cuh>

namespace deep_ep::transport {

// A descriptor's first word: its kind (bits 0-7) and peer (bits 8-31); zero until posted
enum EmulatedKind : uint64_t { kNicEmpty = 0, kNicPut = 1, kNicSignal = 2 };

// `EmulatedNicArgs::words`: per context the descriptors reserved, then per context the first slot
// whose put may not have run yet (all earlier puts have read their source), then the number of
// issuing CTAs done posting, then the NIC's status (0 running or done, -1 past its deadline, -2 a
// full queue)
constexpr int kNicContexts = 2;
constexpr int kNicWordTails = 0, kNicWordExecutedBelow = kNicContexts, kNicWordDone = 2 * kNicContexts,
              kNicWordStatus = 2 * kNicContexts + 1, kNicWords = 2 * kNicContexts + 2;

template <bool kStrict>
struct Emulated {
    static constexpr bool kHasNic = kStrict;

    struct Args {
        char* const* peer_windows;  // [num_ranks] every rank's window base (virtual ranks: one GPU's memory)
        uint64_t* queue;            // [kNicContexts][capacity][4] descriptors (strict)
        int* words;                 // [kNicWords] (strict)
        int capacity;               // descriptors per context
        int rank;
        int context;  // the context this object posts on, in [0, kNicContexts)
        uint32_t seed;
        uint64_t delay_ns;    // strict: a put waits at least this long in the NIC
        uint64_t timeout_ns;  // the NIC's deadline, and every flush's
    };
    Args args;
    Lsa direct;  // the stores of eager mode and of the NIC, the reads of the signal words
    // Lane 0: the slot of the warp's last put on its context (-1: none yet)
    mutable int last_put_slot = -1;

    __device__ __forceinline__ explicit Emulated(const Args& args_)
        : args(args_), direct(Lsa::Args{args_.peer_windows, args_.rank}) {}

    // The same NIC and queues, posting on `context`
    __device__ __forceinline__ Emulated on_context(int context) const {
        Args other = args;
        other.context = context;
        return Emulated(other);
    }

    __device__ __forceinline__ void put_warp(int lane_idx, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        if constexpr (kStrict) {
            if (lane_idx == 0) {
                const int slot = post(kNicPut | static_cast<uint64_t>(peer) << 8, dst_offset, src_offset, num_bytes);
                if (slot >= 0) last_put_slot = slot;
            }
        } else {
            direct.put_warp(lane_idx, peer, dst_offset, src_offset, num_bytes);
        }
    }

    // Strict: posted behind the context's earlier puts to `peer`, which the NIC runs first
    __device__ __forceinline__ void signal_add(int peer, size_t word_offset, uint64_t value) const {
        if constexpr (kStrict) {
            post(kNicSignal | static_cast<uint64_t>(peer) << 8, word_offset, value, 0);
        } else {
            direct.signal_add(peer, word_offset, value);
        }
    }

    // Every put this warp posted has read its source (strict: the NIC has run it); false when the
    // deadline passed
    __device__ __forceinline__ bool flush_warp(uint64_t timeout_ns) const {
        if constexpr (not kStrict) return true;
        const int lane_idx = threadIdx.x % 32;
        const int slot = __shfl_sync(0xffffffff, last_put_slot, 0);
        bool ok = true;
        if (lane_idx == 0 and slot >= 0) {
            const int* executed_below = args.words + kNicWordExecutedBelow + args.context;
            const uint64_t deadline = global_timer_ns() + timeout_ns;
            while (ld_acquire_sys(executed_below) <= slot) {
                if (global_timer_ns() > deadline) {
                    ok = false;
                    break;
                }
                __nanosleep(200);
            }
        }
        return __shfl_sync(0xffffffff, ok, 0);
    }

    __device__ __forceinline__ uint64_t read_signal(size_t word_offset) const {
        return direct.read_signal(word_offset);
    }

    // Every thread of every issuing CTA calls it after its last post: the NIC stops once every
    // issuing CTA has and its queues are drained
    __device__ __forceinline__ void finish_posting() const {
        if constexpr (kStrict) {
            __syncthreads();
            if (threadIdx.x == 0) {
                fence_acq_rel_sys();
                atomicAdd(args.words + kNicWordDone, 1);
            }
        }
    }

    // The NIC: every thread of the grid's last CTA calls it; `num_issuers` CTAs post
    __device__ void run_nic(int num_issuers) const;

private:
    __device__ __forceinline__ uint64_t* descriptor(int context, int slot) const {
        return args.queue + (static_cast<size_t>(context) * args.capacity + slot) * 4;
    }

    // One thread: reserve a slot on our context, fill it, publish it; returns the slot (-1: full)
    __device__ __forceinline__ int post(uint64_t head, uint64_t a, uint64_t b, uint64_t c) const {
        const int slot = atomicAdd(args.words + kNicWordTails + args.context, 1);
        if (slot >= args.capacity) {
            atomicCAS(args.words + kNicWordStatus, 0, -2);
            return -1;
        }
        uint64_t* d = descriptor(args.context, slot);
        d[1] = a;
        d[2] = b;
        d[3] = c;
        fence_acq_rel_sys();
        st_relaxed_sys_u64(d, head);
        return slot;
    }
};

template <bool kStrict>
__device__ void Emulated<kStrict>::run_nic(int num_issuers) const {
    if constexpr (kStrict) {
        constexpr int kMaxPending = 64;
        constexpr int kExit = -2, kIdle = -1;
        __shared__ uint64_t pending[kMaxPending][4];
        __shared__ int pending_slot[kMaxPending], pending_context[kMaxPending];
        __shared__ uint64_t pending_since[kMaxPending];
        __shared__ int num_pending, heads[kNicContexts], action;
        if (threadIdx.x == 0) {
            num_pending = 0;
            for (int c = 0; c < kNicContexts; ++c) heads[c] = 0;
        }
        __syncthreads();
        // Thread 0: drop pending descriptor `i` (the last one takes its place; order is in the slots)
        auto remove = [&](int i) {
            const int last = --num_pending;
            for (int w = 0; w < 4; ++w) pending[i][w] = pending[last][w];
            pending_slot[i] = pending_slot[last];
            pending_context[i] = pending_context[last];
            pending_since[i] = pending_since[last];
        };
        uint32_t random = args.seed * 2654435761u + static_cast<uint32_t>(args.rank) * 40503u + 1u;
        const uint64_t deadline = global_timer_ns() + args.timeout_ns;
        while (true) {
            if (threadIdx.x == 0) {
                const uint64_t now = global_timer_ns();
                // Take in what was posted, in slot order per context
                for (int c = 0; c < kNicContexts; ++c) {
                    while (num_pending < kMaxPending and heads[c] < args.capacity) {
                        const uint64_t* d = descriptor(c, heads[c]);
                        const uint64_t head = ld_acquire_sys_u64(d);
                        if (head == kNicEmpty) break;
                        const int i = num_pending++;
                        pending[i][0] = head;
                        for (int w = 1; w < 4; ++w) pending[i][w] = d[w];
                        pending_slot[i] = heads[c]++;
                        pending_context[i] = c;
                        pending_since[i] = now;
                    }
                }
                // A signal goes once no earlier put of its context to its peer waits; the puts' stores
                // (every thread, before the barrier at the end of the last round) come first
                for (int i = 0; i < num_pending;) {
                    bool ready = (pending[i][0] & 0xff) == kNicSignal;
                    for (int j = 0; ready and j < num_pending; ++j)
                        ready = not((pending[j][0] & 0xff) == kNicPut and pending_context[j] == pending_context[i] and
                                    pending[j][0] >> 8 == pending[i][0] >> 8 and pending_slot[j] < pending_slot[i]);
                    if (not ready) {
                        ++i;
                        continue;
                    }
                    const int peer = static_cast<int>(pending[i][0] >> 8);
                    direct.signal_add(peer, pending[i][1], pending[i][2]);
                    remove(i);
                }
                // Which puts have read their source: all before the first that has not run yet
                for (int c = 0; c < kNicContexts; ++c) {
                    int below = heads[c];
                    for (int j = 0; j < num_pending; ++j)
                        if ((pending[j][0] & 0xff) == kNicPut and pending_context[j] == c)
                            below = min(below, pending_slot[j]);
                    st_release_sys(args.words + kNicWordExecutedBelow + c, below);
                }
                // Run one put that has waited long enough, picked at random among those
                int num_ready = 0;
                for (int j = 0; j < num_pending; ++j)
                    num_ready += (pending[j][0] & 0xff) == kNicPut and now - pending_since[j] >= args.delay_ns;
                action = kIdle;
                if (num_ready > 0) {
                    random = random * 1664525u + 1013904223u;
                    int pick = static_cast<int>((random >> 8) % static_cast<uint32_t>(num_ready));
                    for (int j = 0; j < num_pending and action == kIdle; ++j)
                        if ((pending[j][0] & 0xff) == kNicPut and now - pending_since[j] >= args.delay_ns and
                            pick-- == 0)
                            action = j;
                }
                if (action == kIdle) {
                    bool drained = num_pending == 0 and ld_acquire_sys(args.words + kNicWordDone) >= num_issuers;
                    for (int c = 0; drained and c < kNicContexts; ++c)
                        drained = heads[c] >= min(ld_acquire_sys(args.words + kNicWordTails + c), args.capacity);
                    if (drained) action = kExit;
                    if (not drained and now > deadline) {
                        atomicCAS(args.words + kNicWordStatus, 0, -1);
                        action = kExit;
                    }
                }
            }
            __syncthreads();
            const int picked = action;
            if (picked == kExit) break;
            if (picked >= 0) {
                direct.copy(threadIdx.x, blockDim.x, static_cast<int>(pending[picked][0] >> 8), pending[picked][1],
                            pending[picked][2], pending[picked][3]);
            }
            __syncthreads();
            if (threadIdx.x == 0 and picked >= 0) remove(picked);
            if (picked == kIdle) __nanosleep(500);
        }
    }
}

}  // namespace deep_ep::transport
