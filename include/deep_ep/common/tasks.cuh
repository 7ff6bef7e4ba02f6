#pragma once

// How the communication kernels hand out their tasks: in order, to whichever warp asks next.
// NVLink does not share the link fairly among the SMs that write to it: with tasks dealt
// round-robin, some CTAs of a dispatch or combine finished long before the last one, which then
// sent the tail with a fraction of the link (bench/NOTES.md). Here every warp starts with the task of its global
// index (a decode batch with at most one task per warp never touches the counter); later tasks
// come from a counter in this rank's workspace, claimed when the warp starts its current task so
// that the atomic's round trip hides behind the copies. Tasks still go out in order, so the slots
// at every destination fill in order over time. The last CTA out returns the counter to zero for
// the next launch (stream order keeps two launches of one buffer apart).
// The epilogues take their rows the same way, in the order they land: a warp whose row is late
// holds up only that row, not the rows that round-robin dealing would have given it after.

#include <deep_ep/common/ptx.cuh>

namespace deep_ep {

class TaskQueue {
public:
    // `words`: this queue's two workspace words (tasks claimed past the first round, CTAs done);
    // `num_ctas`: the CTAs that take tasks, the first of the grid (the grid, less an emulated NIC's CTA)
    __device__ __forceinline__ TaskQueue(int* words, int num_tasks, int num_warps_per_cta, unsigned num_ctas)
        : words_(words),
          num_ctas_(num_ctas),
          num_warps_(num_ctas * num_warps_per_cta),
          is_dynamic_(num_tasks > num_warps_) {}

    __device__ __forceinline__ int first() const { return blockIdx.x + threadIdx.x / 32 * num_ctas_; }

    // The warp's task after `task`, claimed now (in lane 0) and learned by every lane with `next`
    __device__ __forceinline__ int claim(int task) const {
        if (not is_dynamic_) return task + num_warps_;
        return threadIdx.x % 32 == 0 ? num_warps_ + atomicAdd(words_, 1) : 0;
    }
    __device__ __forceinline__ int next(int claimed) const {
        return is_dynamic_ ? __shfl_sync(0xffffffff, claimed, 0) : claimed;
    }

    // Every thread of every CTA calls it once, after its last claim; a kernel that already picks
    // a last CTA out (the epilogues, credits.cuh) has that CTA call `reset` instead
    __device__ __forceinline__ void finish() const {
        if (not is_dynamic_) return;
        __syncthreads();
        // A warp's claims have returned before it leaves its loop, so the last CTA in sees them all;
        // the acquire-release add orders every CTA's claims before the last one's reset
        if (threadIdx.x == 0 and atomic_add_acq_rel_gpu(words_ + 1, 1) == static_cast<int>(num_ctas_) - 1)
            reset(words_);
    }

    __device__ __forceinline__ static void reset(int* words) {
        words[0] = 0;
        words[1] = 0;
    }

private:
    int* words_;
    unsigned num_ctas_;
    int num_warps_;
    bool is_dynamic_;
};

}  // namespace deep_ep
