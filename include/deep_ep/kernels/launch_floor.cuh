#pragma once

// A kernel that does no work: the host bench launches it to measure what the driver charges for a
// launch on this machine (deep_ep.bench.host_floor), the floor under every launch of a dispatch or
// combine. The parameter keeps the launch's argument path the same as a real kernel's.

#include <cstdint>

namespace deep_ep {

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) launch_floor_impl(int64_t unused) {
    (void)unused;
}

}  // namespace deep_ep
