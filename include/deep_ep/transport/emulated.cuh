#pragma once

// The transport verbs (docs/transport.md) through an emulated NIC, for virtual nodes on one GPU:
// what GIN guarantees and nothing more, so that a kernel that leans on more fails here instead of
// on a cluster. Two modes:
// - eager (`Emulated<false>`): the calling warp copies at once and the signal is a release add, as
//   over LSA (fast; it catches only what LSA would);
// - strict (`Emulated<true>`): puts and signals are posted to a queue per context, which the NIC
//   (the last CTA of the grid, `run_nic`) drains: it runs a put late (no sooner than `delay_ns` after
//   it took the put in) and in shuffled order, reading the source only then (a source reused before
//   `flush_warp` shows up as wrong bytes); it applies a signal only after the earlier puts of its
//   context to its peer; it orders nothing across contexts.
// A context's queue is a ring of `capacity` descriptors of four 64-bit words, in device memory private
// to the rank (not its window): a poster takes the next slot with an atomic add, waits until the ring
// entry is free for that slot, fills it and publishes its head; the NIC takes descriptors in slot
// order and frees each entry for the slot one lap later. A kernel may post any number of them; the
// ring only bounds how many are in flight.
// `Args::mistake` breaks the protocol on purpose from inside the transport, for the tests that show
// the strict NIC catches what a kernel could get wrong: a flush that does not wait, a signal that does
// not wait for its puts (applied at once), a signal posted on another context than its puts.

#include <climits>
#include <cstddef>
#include <cstdint>

#include <deep_ep/common/ptx.cuh>
#include <deep_ep/transport/lsa.cuh>

namespace deep_ep::transport {

// A descriptor's head: its kind (bits 0-7), its peer (bits 8-31), and its slot (bits 32-63). A free
// entry holds only the slot that may take it next, with kind `kNicEmpty`.
// A get is a put the other way (the peer's window into ours), run and flushed as puts are.
enum EmulatedKind : uint64_t { kNicEmpty = 0, kNicPut = 1, kNicSignal = 2, kNicGet = 3 };

__device__ __forceinline__ bool nic_moves_data(uint64_t head) {
    return (head & 0xff) == kNicPut or (head & 0xff) == kNicGet;
}

// `Emulated::Args::mistake`
enum NicMistake : int { kNicCorrect = 0, kNicNoFlush = 1, kNicSignalFirst = 2, kNicSplitContexts = 3 };

// `Emulated::Args::words`: per context the slots taken, then per context the first slot whose put may
// not have run yet (all earlier puts have read their source), then the number of issuing CTAs done
// posting, then the NIC's status (0 running or done, -1 past its deadline, -2 a post found no free
// entry in time)
constexpr int kNicContexts = 2;
constexpr int kNicWordTails = 0, kNicWordExecutedBelow = kNicContexts, kNicWordDone = 2 * kNicContexts,
              kNicWordStatus = 2 * kNicContexts + 1, kNicWords = 2 * kNicContexts + 2;
// `Emulated::Args::traffic`
constexpr int kNicTrafficBytes = 0, kNicTrafficPuts = 1, kNicTrafficSignals = 2, kNicTrafficWords = 3;

template <bool kStrict>
struct Emulated {
    static constexpr bool kHasNic = kStrict;
    static constexpr bool kHasRemote = true;  // the ranks of other virtual nodes
    static constexpr bool kHybrid = false;    // hybrid.cuh
    static constexpr bool kHybridLaneSlots = false;

    struct Args {
        char* const* peer_windows;  // [num_ranks] every rank's window base: the NIC reaches them all
        uint64_t* queue;            // [kNicContexts][capacity][4] descriptors (strict)
        int* words;                 // [kNicWords] (strict)
        int capacity;               // descriptors per context (strict)
        int rank;
        int context;  // the context this object posts on, in [0, kNicContexts)
        int mistake;  // `NicMistake`: kNicCorrect but in the tests that break the protocol
        uint32_t seed;
        uint64_t delay_ns;    // strict: a put waits at least this long in the NIC
        uint64_t timeout_ns;  // the NIC's deadline, and every flush's and post's
        // [kNicTrafficWords]: what this rank handed to the NIC (bytes put, puts, signals), for the
        // benchmark's bytes per token across nodes; never reset by a kernel
        unsigned long long* traffic;
    };
    // The kernel's argument, by reference (its words stay in the constant bank, not in registers)
    const Args& args;
    int context;  // the context this object posts on
    // Lane 0: the slot of the warp's last put or get on its context (-1: none yet)
    mutable int last_put_slot = -1;

    __device__ __forceinline__ Emulated(const Args& args_, int context_) : args(args_), context(context_) {}
    __device__ __forceinline__ explicit Emulated(const Args& args_) : Emulated(args_, args_.context) {}

    // The stores of eager mode and of the NIC, the reads of the signal words
    __device__ __forceinline__ Lsa direct() const { return Lsa(Lsa::Args{args.peer_windows, args.rank}); }

    // The transport a warp posts through: contexts dealt to warps in turn, as QPs are over GIN
    __device__ __forceinline__ Emulated for_warp(int global_warp_idx) const {
        return Emulated(args, global_warp_idx % kNicContexts);
    }

    // Every lane of the warp calls it; `num_bytes` a multiple of 16. What the lanes stored before is
    // what the put reads (eager: now; strict: when the NIC runs it)
    __device__ __forceinline__ void put_warp(int lane_idx, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        __syncwarp();
        if (lane_idx == 0) {
            atomicAdd(args.traffic + kNicTrafficBytes, static_cast<unsigned long long>(num_bytes));
            atomicAdd(args.traffic + kNicTrafficPuts, 1ull);
        }
        if constexpr (kStrict) {
            if (lane_idx == 0) {
                const int slot = post(context, kNicPut, peer, dst_offset, src_offset, num_bytes);
                if (slot >= 0) last_put_slot = slot;
            }
        } else {
            direct().put_warp(lane_idx, peer, dst_offset, src_offset, num_bytes);
        }
        __syncwarp();
    }

    // Every lane of the warp calls it; `num_bytes` a multiple of 16. The bytes are in our window once
    // `flush_warp` returned true (eager: at once; strict: when the NIC has run it, late and shuffled)
    __device__ __forceinline__ void get_warp(int lane_idx, int peer, size_t dst_offset, size_t src_offset,
                                             size_t num_bytes) const {
        __syncwarp();
        if (lane_idx == 0) atomicAdd(args.traffic + kNicTrafficBytes, static_cast<unsigned long long>(num_bytes));
        if constexpr (kStrict) {
            if (lane_idx == 0) {
                const int slot = post(context, kNicGet, peer, dst_offset, src_offset, num_bytes);
                if (slot >= 0) last_put_slot = slot;
            }
        } else {
            direct().get_warp(lane_idx, peer, dst_offset, src_offset, num_bytes);
        }
        __syncwarp();
    }

    // One thread. Strict: posted behind the context's earlier puts to `peer`, which the NIC runs first
    __device__ __forceinline__ void signal_add(int peer, size_t word_offset, uint64_t value) const {
        atomicAdd(args.traffic + kNicTrafficSignals, 1ull);
        if constexpr (kStrict) {
            if (args.mistake == kNicSignalFirst) {
                direct().signal_add(peer, word_offset, value);
                return;
            }
            post(args.mistake == kNicSplitContexts ? (context + 1) % kNicContexts : context, kNicSignal, peer,
                 word_offset, value, 0);
        } else {
            direct().signal_add(peer, word_offset, value);
        }
    }

    // Every lane of the warp: every put this warp posted has read its source and every get has
    // landed (strict: the NIC has run them); false when the deadline passed
    __device__ __forceinline__ bool flush_warp(uint64_t timeout_ns) const {
        if constexpr (not kStrict) return true;
        if (args.mistake == kNicNoFlush) return true;
        const int lane_idx = threadIdx.x % 32;
        const int slot = __shfl_sync(0xffffffff, last_put_slot, 0);
        bool ok = true;
        if (lane_idx == 0 and slot >= 0) {
            const int* executed_below = args.words + kNicWordExecutedBelow + context;
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
        return direct().read_signal(word_offset);
    }

    // Every thread of every issuing CTA calls it after its last post and its last flush: the NIC
    // stops once every issuing CTA has and its queues are drained, and then starts them over (a
    // flush after it would wait for a NIC that is gone)
    __device__ __forceinline__ void finish_posting() const {
        if constexpr (kStrict) {
            __syncthreads();
            if (threadIdx.x == 0) {
                fence_acq_rel_sys();
                atomicAdd(args.words + kNicWordDone, 1);
            }
        }
    }

    // The NIC: every thread of the grid's last CTA calls it; `num_issuers` CTAs post. When its
    // deadline passes with work left, thread 0 calls `on_timeout(num_pending)` (a kernel fails the
    // buffer) and the NIC stops
    template <typename OnTimeout>
    __device__ void run_nic(int num_issuers, const OnTimeout& on_timeout) const;

private:
    __device__ __forceinline__ uint64_t* descriptor(int context, int slot) const {
        return args.queue + (static_cast<size_t>(context) * args.capacity + slot % args.capacity) * 4;
    }

    // One thread: take the next slot of `context`, wait until its entry is free, fill and publish it;
    // returns the slot (-1: no free entry in time, the NIC's status says so)
    __device__ __forceinline__ int post(int context, uint64_t kind, int peer, uint64_t a, uint64_t b,
                                        uint64_t c) const {
        const int slot = atomicAdd(args.words + kNicWordTails + context, 1);
        uint64_t* d = descriptor(context, slot);
        const uint64_t slot_bits = static_cast<uint64_t>(static_cast<uint32_t>(slot)) << 32;
        if (ld_acquire_sys_u64(d) != slot_bits) {
            const uint64_t deadline = global_timer_ns() + args.timeout_ns;
            while (ld_acquire_sys_u64(d) != slot_bits) {
                if (global_timer_ns() > deadline) {
                    atomicCAS(args.words + kNicWordStatus, 0, -2);
                    return -1;
                }
                __nanosleep(100);
            }
        }
        d[1] = a;
        d[2] = b;
        d[3] = c;
        fence_acq_rel_sys();
        st_relaxed_sys_u64(d, slot_bits | static_cast<uint64_t>(peer) << 8 | kind);
        return slot;
    }
};

template <bool kStrict>
template <typename OnTimeout>
__device__ void Emulated<kStrict>::run_nic(int num_issuers, const OnTimeout& on_timeout) const {
    if constexpr (kStrict) {
        constexpr int kMaxPending = 64, kMaxPeers = 64;
        // Puts run side by side, each by a quarter of the CTA
        constexpr int kNumLanes = 4;
        constexpr int kIdle = -1, kExit = -2;
        __shared__ uint64_t pending[kMaxPending][4];
        __shared__ int pending_slot[kMaxPending], pending_context[kMaxPending];
        __shared__ uint64_t pending_since[kMaxPending];
        __shared__ int first_put[kNicContexts][kMaxPeers];
        __shared__ int num_pending, heads[kNicContexts], action[kNumLanes], num_taken;
        if (threadIdx.x == 0) {
            num_pending = 0;
            for (int c = 0; c < kNicContexts; ++c) heads[c] = 0;
        }
        __syncthreads();
        const int warp_idx = threadIdx.x / 32, lane_idx = threadIdx.x % 32;
        uint32_t random = args.seed * 2654435761u + static_cast<uint32_t>(args.rank) * 40503u + 1u;
        const uint64_t deadline = global_timer_ns() + args.timeout_ns;
        bool timed_out = false;
        while (true) {
            // Take in what was posted, in slot order per context: lane i looks at the i-th next slot,
            // and the lanes before the first one not posted yet take theirs
            if (warp_idx == 0) {
                for (int c = 0; c < kNicContexts; ++c) {
                    const int room = kMaxPending - num_pending;
                    const int slot = heads[c] + lane_idx;
                    const uint64_t* d = descriptor(c, slot);
                    const uint64_t head = lane_idx < room ? ld_acquire_sys_u64(d) : 0;
                    const bool is_posted =
                        (head & 0xff) != kNicEmpty and head >> 32 == static_cast<uint32_t>(slot) and lane_idx < room;
                    const uint32_t not_posted = __ballot_sync(0xffffffff, not is_posted);
                    const int num_new = not_posted == 0 ? 32 : __ffs(not_posted) - 1;
                    if (lane_idx < num_new) {
                        const int i = num_pending + lane_idx;
                        pending[i][0] = head;
                        for (int w = 1; w < 4; ++w) pending[i][w] = d[w];
                        pending_slot[i] = slot;
                        pending_context[i] = c;
                        pending_since[i] = global_timer_ns();
                        // The entry is the next lap's (after the reads above)
                        fence_acq_rel_sys();
                        st_relaxed_sys_u64(const_cast<uint64_t*>(d),
                                           static_cast<uint64_t>(static_cast<uint32_t>(slot + args.capacity)) << 32);
                    }
                    __syncwarp();
                    if (lane_idx == 0) {
                        heads[c] += num_new;
                        num_pending += num_new;
                    }
                    __syncwarp();
                }
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                const uint64_t now = global_timer_ns();
                // The first pending put of every (context, peer): a signal goes once none is before it
                for (int c = 0; c < kNicContexts; ++c)
                    for (int p = 0; p < kMaxPeers; ++p) first_put[c][p] = INT_MAX;
                for (int j = 0; j < num_pending; ++j) {
                    if (not nic_moves_data(pending[j][0])) continue;
                    int& first = first_put[pending_context[j]][(pending[j][0] >> 8) & 0xffffff];
                    first = min(first, pending_slot[j]);
                }
                // Apply the ready signals (the puts they follow were copied by every thread before the
                // barrier at the end of an earlier round) and keep the rest, in place
                int kept = 0;
                for (int j = 0; j < num_pending; ++j) {
                    const int peer = static_cast<int>((pending[j][0] >> 8) & 0xffffff);
                    if ((pending[j][0] & 0xff) == kNicSignal and
                        pending_slot[j] < first_put[pending_context[j]][peer]) {
                        direct().signal_add(peer, pending[j][1], pending[j][2]);
                        continue;
                    }
                    if (kept != j) {
                        for (int w = 0; w < 4; ++w) pending[kept][w] = pending[j][w];
                        pending_slot[kept] = pending_slot[j];
                        pending_context[kept] = pending_context[j];
                        pending_since[kept] = pending_since[j];
                    }
                    ++kept;
                }
                num_pending = kept;
                // Which puts have read their source: all before the first that has not run yet
                for (int c = 0; c < kNicContexts; ++c) {
                    int below = heads[c];
                    for (int p = 0; p < kMaxPeers; ++p) below = min(below, first_put[c][p]);
                    st_release_sys(args.words + kNicWordExecutedBelow + c, below);
                }
                // Run up to `kNumLanes` puts that have waited long enough, from a random place on
                int num_ready = 0;
                for (int j = 0; j < num_pending; ++j)
                    num_ready += nic_moves_data(pending[j][0]) and now - pending_since[j] >= args.delay_ns;
                for (int k = 0; k < kNumLanes; ++k) action[k] = kIdle;
                num_taken = 0;
                if (num_ready > 0) {
                    random = random * 1664525u + 1013904223u;
                    const int start = static_cast<int>((random >> 8) % static_cast<uint32_t>(num_pending));
                    for (int step = 0; step < num_pending and num_taken < kNumLanes; ++step) {
                        const int j = (start + step) % num_pending;
                        if (nic_moves_data(pending[j][0]) and now - pending_since[j] >= args.delay_ns)
                            action[num_taken++] = j;
                    }
                } else {
                    bool drained = num_pending == 0 and ld_acquire_sys(args.words + kNicWordDone) >= num_issuers;
                    for (int c = 0; drained and c < kNicContexts; ++c)
                        drained = heads[c] >= ld_acquire_sys(args.words + kNicWordTails + c);
                    if (drained) action[0] = kExit;
                    if (not drained and now > deadline) {
                        timed_out = true;
                        action[0] = kExit;
                    }
                }
            }
            __syncthreads();
            const int first_action = action[0];
            if (first_action == kExit) break;
            const int lane = threadIdx.x / (blockDim.x / kNumLanes);
            const int picked = action[lane];
            if (picked >= 0) {
                const int first = threadIdx.x % (blockDim.x / kNumLanes), stride = blockDim.x / kNumLanes;
                const int peer = static_cast<int>((pending[picked][0] >> 8) & 0xffffff);
                if ((pending[picked][0] & 0xff) == kNicGet)
                    direct().copy_from(first, stride, peer, pending[picked][1], pending[picked][2], pending[picked][3]);
                else
                    direct().copy(first, stride, peer, pending[picked][1], pending[picked][2], pending[picked][3]);
            }
            __syncthreads();
            if (threadIdx.x == 0 and num_taken > 0) {
                // Drop the puts that ran (highest index first, so the others keep theirs)
                for (int k = num_taken - 1; k >= 0; --k) {
                    int top = k;
                    for (int m = 0; m < k; ++m)
                        if (action[m] > action[top]) top = m;
                    const int j = action[top];
                    action[top] = action[k];
                    const int last = --num_pending;
                    for (int w = 0; w < 4; ++w) pending[j][w] = pending[last][w];
                    pending_slot[j] = pending_slot[last];
                    pending_context[j] = pending_context[last];
                    pending_since[j] = pending_since[last];
                }
            }
            if (first_action == kIdle) __nanosleep(500);
            __syncthreads();
        }
        if (timed_out) {
            if (threadIdx.x == 0) {
                atomicCAS(args.words + kNicWordStatus, 0, -1);
                on_timeout(num_pending);
            }
            return;
        }
        // Drained: the queues start from slot 0 again at the next launch (stream order keeps launches apart)
        for (int e = threadIdx.x; e < kNicContexts * args.capacity; e += blockDim.x)
            args.queue[static_cast<size_t>(e) * 4] = static_cast<uint64_t>(e % args.capacity) << 32;
        if (threadIdx.x < kNicContexts) {
            args.words[kNicWordTails + threadIdx.x] = 0;
            args.words[kNicWordExecutedBelow + threadIdx.x] = 0;
        }
        if (threadIdx.x == 0) args.words[kNicWordDone] = 0;
    }
}

}  // namespace deep_ep::transport
