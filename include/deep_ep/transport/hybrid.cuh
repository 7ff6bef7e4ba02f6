#pragma once

// Hybrid mode (docs/hybrid.md): a transport with remote peers, used so that a token crosses it at
// most once per destination node, to the rank of that node with our local index (its forwarder),
// which passes it on by stores. The verbs are the base transport's; `kHybrid` is what tells the
// kernels to take the hybrid paths, at compile time, so that the direct-mode kernels of the same
// transport stay as they are. `kLaneSlots`: the combine's slots per (source node, token, top-k lane)
// rather than per (holder rank, slot), for fewer lanes than ranks per node (combine_forward.cuh).

namespace deep_ep::transport {

template <typename Base, bool kLaneSlots = false>
struct Hybrid : Base {
    static_assert(Base::kHasRemote, "hybrid mode needs a transport with remote peers");
    static constexpr bool kHybrid = true;
    static constexpr bool kHybridLaneSlots = kLaneSlots;
    using Args = typename Base::Args;

    __device__ __forceinline__ explicit Hybrid(const Args& args_) : Base(args_) {}
    __device__ __forceinline__ explicit Hybrid(const Base& base) : Base(base) {}

    __device__ __forceinline__ Hybrid for_warp(int global_warp_idx) const {
        return Hybrid(Base::for_warp(global_warp_idx));
    }
};

}  // namespace deep_ep::transport
