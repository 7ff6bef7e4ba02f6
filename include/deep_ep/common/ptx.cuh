#pragma once

// Thin wrappers over the PTX the kernels need: scoped loads/stores, fences, timers.
// Everything is `__forceinline__` and has no state.

#include <cstdint>

namespace deep_ep {

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ int ld_acquire_sys(const int* ptr) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ int ld_relaxed_sys(const int* ptr) {
    int v;
    asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

// The same, for the 64-bit signal words that remote peers write (scaleout.cuh)
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
    return ld_acquire_sys_u64(ptr);
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(int* ptr, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int* ptr, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ int atomic_add_release_sys(int* ptr, int v) {
    int old;
    asm volatile("atom.release.sys.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

// Peers add to the same semaphores over NVLink at system scope; our own updates must use the same
// scope, or the two read-modify-writes are not atomic with respect to each other.
// The last-arriver pattern in one instruction: the add releases what this CTA did before it (ordered
// before the calling thread by a CTA barrier) and acquires what every CTA that added before it did,
// so the CTA that finds itself last may reset shared words or publish for all. One `fence.acq_rel`
// in SASS, where `__threadfence()` before the add (and again in the last one) is `fence.sc` each.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* ptr, int v) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

__device__ __forceinline__ int atomic_add_relaxed_sys(int* ptr, int v) {
    int old;
    asm volatile("atom.relaxed.sys.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

// Fire-and-forget add (no value comes back, so the thread does not wait for the round trip).
__device__ __forceinline__ void red_add_relaxed_sys(int* ptr, int v) {
    asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// Programmatic dependent launch: a kernel launched with the PDL attribute may start while its
// predecessor runs; it must wait before touching anything the predecessor writes.
__device__ __forceinline__ void griddep_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void griddep_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;");
}

// 16-byte global accesses: the widest a thread can issue, so a warp moves 512 bytes per instruction.
// `ld_nc_v4` (the non-coherent path) only for data that no one writes while the kernel runs (inputs);
// `ld_window_v4` for window data that peers write during the kernel: a weak load, ordered after the
// reader's acquire by the memory model, that does not allocate in L1 either.
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

__device__ __forceinline__ int4 ld_window_v4(const int4* ptr) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
    return v;
}

__device__ __forceinline__ void st_na_v4(int4* ptr, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

}  // namespace deep_ep
