#pragma once

// Test-only: a header that does not compile (missing semicolon and an undeclared name).

namespace jit_test {

template <int kValue>
__global__ void broken_impl(int* out) {
    out[threadIdx.x] = kValue + undeclared_name_in_broken_impl
}

}  // namespace jit_test
