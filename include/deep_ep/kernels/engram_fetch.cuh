#pragma once

// Engram's fetch inside one NVLink domain (deep_ep/backends/kernels/engram.py): rows of a table
// sharded over the ranks' windows, read by global entry index with loads from the owner's window
// (LSA). Rank `r`'s window holds entries `[r * num_entries, (r + 1) * num_entries)` at the same
// offset on every rank, each at a 32-byte aligned stride; the host checked every index. A warp
// copies one row at a time: its owner, then 16-byte vectors where the row is made of them.

#include <cstdint>

#include <deep_ep/common/layout.cuh>

namespace deep_ep {

struct EngramFetchArgs {
    char* window;          // this rank's window: the peers' window bases in its workspace
    const void* indices;   // [num_rows] of `Index`, global entry indices
    char* out;             // [num_rows][row_bytes]
    int64_t table_offset;  // the table, the same offset in every rank's window
    int64_t num_rows;
    int64_t num_entries;  // entries per rank
    int64_t row_bytes;
    int64_t entry_stride;  // bytes between two entries of the table (32-byte aligned)
};

template <typename Index, int kNumThreads>
__global__ void __launch_bounds__(kNumThreads, 1) engram_fetch_impl(EngramFetchArgs args) {
    constexpr int kWarps = kNumThreads / 32;
    void* const* peer_windows = reinterpret_cast<void* const*>(args.window + kPeerWindowsOffset);
    const Index* indices = static_cast<const Index*>(args.indices);
    const int lane = static_cast<int>(threadIdx.x % 32);
    const bool vectors = args.row_bytes % 16 == 0;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < args.num_rows;
         row += static_cast<int64_t>(gridDim.x) * kWarps) {
        const int64_t entry = static_cast<int64_t>(indices[row]);
        const int owner = static_cast<int>(entry / args.num_entries);
        const char* src = static_cast<const char*>(peer_windows[owner]) + args.table_offset +
                          (entry % args.num_entries) * args.entry_stride;
        char* dst = args.out + row * args.row_bytes;
        if (vectors) {
            // The owner's host wrote the table before the barrier that ended `engram_write`; read
            // through L2, which another kernel of this rank may not have read yet (L1 is per kernel)
            for (int64_t v = lane; v < args.row_bytes / 16; v += 32)
                reinterpret_cast<int4*>(dst)[v] = __ldcg(reinterpret_cast<const int4*>(src) + v);
        } else {
            for (int64_t b = lane; b < args.row_bytes; b += 32) dst[b] = __ldcg(src + b);
        }
    }
}

}  // namespace deep_ep
