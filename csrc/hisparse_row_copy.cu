// SPDX-License-Identifier: Apache-2.0
// Hybrid HiSparse resolver row copy: a step's misses, host pool rows -> hot or staging rows.
//
// The semantics are those of the torch reference, vllm/v1/hisparse/resolver.py
// (copy_host_rows): for every entry i with copy[i], device row dst_rows[i] of the
// layer's KV cache holds host row src_rows[i] afterwards. The entries are the
// fixed-size per-entry arrays of a ResolutionPlan (one per selected position of
// the step, masked to its distinct misses), so the launch needs no count read
// back from the device. One warp copies one row from pinned host memory through
// its device mapping, in 16-byte words when rows and strides allow (all of a row's
// loads issued before its stores, csrc/hisparse_copy.h; row_copy_in_words); entries
// never share a destination (each miss has its own slot), so warps never race.
// Every decision is read from the read-only plan arrays; no thread waits on
// another. Rows are range-checked: an entry outside its table, or on rows of its
// block that belong to another layer (kv_block_rows), copies nothing and raises
// kErrorRowOutOfBounds in the step's error word (the reference raises at once; the worker reads the
// word once per step).
//
// This file has no torch dependency so it compiles with plain nvcc; the torch
// binding is csrc/hisparse_ops.cpp.

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_copy.h"
#include "hisparse_row_copy.h"

namespace hisparse {

namespace {

template <typename word_t>
__global__ void copy_host_rows_kernel(RowCopyArgs args) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= args.n || !args.copy[warp]) return;
  const RowCopyLayer& layer = args.layer;
  const int64_t src_row = args.src_rows[warp];
  const int64_t dst_row = args.dst_rows[warp];
  if (!row_copy_in_bounds(layer, dst_row, src_row)) {
    if (lane == 0) atomicOr(args.error, kErrorRowOutOfBounds);
    return;
  }
  const word_t* src =
      reinterpret_cast<const word_t*>(layer.host_rows + src_row * layer.host_row_stride);
  word_t* dst = reinterpret_cast<word_t*>(layer.kv_rows + dst_row * layer.kv_row_stride);
  copy_words(dst, src, layer.row_bytes / static_cast<int64_t>(sizeof(word_t)), lane, 32);
}

}  // namespace

cudaError_t launch_copy_host_rows(const RowCopyArgs& args, cudaStream_t stream) {
  if (args.n == 0) return cudaSuccess;
  const int threads = 32 * kRowCopyWarpsPerBlock;
  const dim3 grid(
      static_cast<unsigned>((args.n + kRowCopyWarpsPerBlock - 1) / kRowCopyWarpsPerBlock));
  if (row_copy_in_words(args.layer)) {
    copy_host_rows_kernel<uint4><<<grid, threads, 0, stream>>>(args);
  } else {
    copy_host_rows_kernel<uint8_t><<<grid, threads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace hisparse
