#pragma once

// Engram's fetch (deep_ep/backends/kernels/engram.py): rows of a table sharded over the ranks'
// windows, read by global entry index. Rank `r`'s window holds entries `[r * num_entries, (r + 1) *
// num_entries)` at the same offset on every rank, each at a 32-byte aligned stride; the host checked
// every index. A warp copies one row at a time: from an owner of our scale-up domain with loads
// from its window (LSA); from a remote owner (a peer without a window base in our workspace) with
// the transport's get into the warp's own staging entry of our window, then, once the warp's flush
// says it landed, from there (GIN's RDMA read; the emulated NIC's late, shuffled copy on virtual
// nodes). Over LSA alone every owner is of our domain and the get folds away.

#include <cstdint>

#include <deep_ep/common/fault.cuh>
#include <deep_ep/common/layout.cuh>
#include <deep_ep/common/sends.cuh>
#include <deep_ep/transport/transports.cuh>

namespace deep_ep {

struct EngramFetchArgs {
    char* window_base;  // this rank's window: the peers' window bases in its workspace
    int64_t* error_block;
    uint64_t timeout_ns;
    const void* indices;     // [num_rows] of `Index`, global entry indices
    char* out;               // [num_rows][row_bytes]
    int64_t table_offset;    // the table, the same offset in every rank's window
    int64_t staging_offset;  // remote owners: one entry per warp of the grid, in our window
    int64_t num_rows;
    int64_t num_entries;  // entries per rank
    int64_t row_bytes;
    int64_t entry_stride;  // bytes between two entries of the table (32-byte aligned)
    int rank;
};

// A row of `row_bytes` from `src` to `dst`, by the warp; through L2: a peer's table or our staging
// entry is written by other kernels or the NIC, never cached in this SM's L1 from before
__device__ __forceinline__ void engram_copy_row(const char* src, char* dst, int64_t row_bytes, int lane_idx) {
    if (row_bytes % 16 == 0) {
        for (int64_t v = lane_idx; v < row_bytes / 16; v += 32)
            reinterpret_cast<int4*>(dst)[v] = __ldcg(reinterpret_cast<const int4*>(src) + v);
    } else {
        for (int64_t b = lane_idx; b < row_bytes; b += 32) dst[b] = __ldcg(src + b);
    }
}

template <typename Index, int kNumThreads, typename Transport>
__global__ void __launch_bounds__(kNumThreads, 1)
    engram_fetch_impl(EngramFetchArgs args, typename Transport::Args transport_args) {
    constexpr int kWarps = kNumThreads / 32;
    run_with_transport<Transport, kNumThreads>(
        args, transport_args, false, [&](const Transport& transport, const auto&, const FaultSink& fault) {
            void* const* peer_windows = reinterpret_cast<void* const*>(args.window_base + kPeerWindowsOffset);
            const Index* indices = static_cast<const Index*>(args.indices);
            const int lane_idx = static_cast<int>(threadIdx.x % 32);
            const int64_t warp_idx = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
            for (int64_t row = warp_idx; row < args.num_rows;
                 row += static_cast<int64_t>(num_issuing_ctas<Transport>()) * kWarps) {
                const int64_t entry = static_cast<int64_t>(indices[row]);
                const int owner = static_cast<int>(entry / args.num_entries);
                const int64_t entry_offset = args.table_offset + (entry % args.num_entries) * args.entry_stride;
                const char* owner_window = static_cast<const char*>(peer_windows[owner]);
                char* dst = args.out + row * args.row_bytes;
                if (not Transport::kHasRemote or owner_window != nullptr) {
                    engram_copy_row(owner_window + entry_offset, dst, args.row_bytes, lane_idx);
                    continue;
                }
                const int64_t staging = args.staging_offset + warp_idx * args.entry_stride;
                transport.get_warp(lane_idx, owner, staging, entry_offset, args.entry_stride);
                if (not transport.flush_warp(args.timeout_ns)) {
                    if (lane_idx == 0) fault.report_timeout(kPhaseNic, args.rank, owner, -1, 0, 0);
                    return;
                }
                engram_copy_row(args.window_base + staging, dst, args.row_bytes, lane_idx);
                // The next get into the staging entry lands after every lane has read this one
                __syncwarp();
            }
        });
}

}  // namespace deep_ep
