#pragma once

// Test-only: a struct passed by value (like ncclDevComm) followed by scalars; the kernel copies
// every byte of it out, so the test can compare them with what it sent.

#include <cstdint>

namespace jit_test {

template <int kNumBytes>
struct alignas(8) Blob {
    unsigned char bytes[kNumBytes];
};

template <int kNumBytes>
__global__ void opaque_impl(Blob<kNumBytes> blob, uint64_t tail, unsigned char* out, uint64_t* tail_out) {
    for (int i = threadIdx.x; i < kNumBytes; i += blockDim.x)
        out[i] = blob.bytes[i];
    if (threadIdx.x == 0)
        *tail_out = tail;
}

}  // namespace jit_test
