#pragma once

// Test-only: kernels that do nothing, to time the host side of a launch (with and without the
// argument list of a typical communication kernel).

#include <cstdint>

#include "opaque.cuh"

namespace jit_test {

template <int kTag>
__global__ void empty_impl() {}

template <int kNumBytes>
__global__ void empty_args_impl(Blob<kNumBytes> comm, uint64_t window, const int* src, int num_tokens, uint64_t num_bytes) {}

}  // namespace jit_test
