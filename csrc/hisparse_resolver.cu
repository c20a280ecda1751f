// SPDX-License-Identifier: Apache-2.0
// Hybrid HiSparse top-K resolver: selected token positions -> physical KV rows.
//
// The semantics are those of the torch reference, vllm/v1/hisparse/resolver.py
// (resolve_topk_slots); this kernel must produce the same rows and leave the
// same hot state on every input. One thread block serves one request row:
//   pass 1 (all threads): entries on resident pages resolve in place through
//           the page table; -1 stays -1; the rest are marked unresolved;
//   pass 2 (in entry order): each unresolved entry is a hot hit (refresh the
//           slot's stamp) or a miss (take the least recently used slot not
//           selected in this step, lowest slot among ties, and copy one row
//           from pinned host memory into it, all threads copying columns).
// Pass 2 is sequential per request because each miss changes the LRU state
// the next entry sees; requests run in parallel.
//
// This file has no torch dependency so it compiles with plain nvcc; the torch
// binding is csrc/hisparse_ops.cpp.

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_resolver.h"

namespace hisparse {

namespace {

constexpr int64_t kUnresolved = -2;

template <typename scalar_t>
__global__ void resolve_topk_slots_kernel(ResolverArgs args, scalar_t* kv_rows,
                                          const scalar_t* host_rows) {
  const int64_t r = blockIdx.x;
  const int64_t entries = args.num_tokens * args.topk;
  const int64_t* page_row = args.page_table + r * args.num_pages;
  const int64_t* host_page_row = args.host_page_table + r * args.num_pages;
  const int64_t* hot_rows = args.hot_rows + r * args.hot_slots;
  int64_t* hot_positions = args.hot_positions + r * args.hot_slots;
  int64_t* hot_stamps = args.hot_stamps + r * args.hot_slots;

  for (int64_t idx = threadIdx.x; idx < entries; idx += blockDim.x) {
    if (args.req_ids[idx / args.topk] != r) continue;
    const int64_t p = args.positions[idx];
    if (p < 0) {
      args.out[idx] = -1;
      continue;
    }
    const int64_t block = page_row[p / args.block_size];
    args.out[idx] = block >= 0 ? block * args.block_stride_rows + p % args.block_size
                               : kUnresolved;
  }
  __syncthreads();

  __shared__ int64_t slot;
  __shared__ bool copy_row;
  for (int64_t idx = 0; idx < entries; ++idx) {
    // Every thread reads the same values, so these branches are uniform.
    if (args.req_ids[idx / args.topk] != r || args.out[idx] != kUnresolved) continue;
    const int64_t p = args.positions[idx];
    const int64_t host_page = host_page_row[p / args.block_size];
    if (threadIdx.x == 0) {
      slot = -1;
      for (int64_t h = 0; h < args.hot_slots && slot < 0; ++h) {
        if (hot_positions[h] == p) slot = h;
      }
      copy_row = slot < 0;
      if (copy_row) {
        for (int64_t h = 0; h < args.hot_slots; ++h) {
          if (hot_stamps[h] != args.step && (slot < 0 || hot_stamps[h] < hot_stamps[slot])) {
            slot = h;
          }
        }
        if (slot < 0 || host_page < 0) {
          const unsigned long long code =
              slot < 0 ? kErrorHotBufferTooSmall : kErrorNotInHostPool;
          atomicCAS(reinterpret_cast<unsigned long long*>(args.error), 0ull, code);
          slot = -1;
        } else {
          hot_positions[slot] = p;
        }
      }
      if (slot >= 0) {
        hot_stamps[slot] = args.step;
        args.out[idx] = hot_rows[slot];
      }
    }
    __syncthreads();
    if (slot < 0) return;  // error recorded; the binding raises
    if (copy_row) {
      const scalar_t* src =
          host_rows + (host_page * args.block_size + p % args.block_size) * args.width;
      scalar_t* dst = kv_rows + hot_rows[slot] * args.width;
      for (int64_t c = threadIdx.x; c < args.width; c += blockDim.x) dst[c] = src[c];
    }
    __syncthreads();
  }
}

template <typename scalar_t>
cudaError_t launch_typed(const ResolverArgs& args, void* kv_rows, const void* host_rows,
                         cudaStream_t stream) {
  if (args.num_requests == 0) return cudaSuccess;
  resolve_topk_slots_kernel<scalar_t><<<args.num_requests, kThreadsPerRequest, 0, stream>>>(
      args, static_cast<scalar_t*>(kv_rows), static_cast<const scalar_t*>(host_rows));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_resolve_topk_slots(const ResolverArgs& args, void* kv_rows,
                                      const void* host_rows, int element_bytes,
                                      cudaStream_t stream) {
  // Rows are copied, never converted, so only the element width matters.
  switch (element_bytes) {
    case 1:
      return launch_typed<uint8_t>(args, kv_rows, host_rows, stream);
    case 2:
      return launch_typed<uint16_t>(args, kv_rows, host_rows, stream);
    case 4:
      return launch_typed<uint32_t>(args, kv_rows, host_rows, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace hisparse
