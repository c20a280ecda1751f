// SPDX-License-Identifier: Apache-2.0
// Launcher interface of the HiSparse resolver's row copy (hisparse_row_copy.cu).
// Plain CUDA types only, so the kernel builds without torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_errors.h"

namespace hisparse {

constexpr int kRowCopyWarpsPerBlock = 8;

// The layer a row copy writes: its KV cache rows on the device and its host pool rows.
struct RowCopyLayer {
  char* kv_rows;          // the layer's KV cache rows on the device
  int64_t kv_row_stride;  // bytes between consecutive rows of kv_rows
  int64_t kv_num_rows;    // rows of kv_rows: a destination outside [0, kv_num_rows) is an error
  // Block b's rows are b * kv_block_stride_rows + [0, kv_block_rows): where layers share a
  // block-outermost allocation, the rows between them are other layers' pages, and a
  // destination there is an error too.
  int64_t kv_block_stride_rows;
  int64_t kv_block_rows;
  const char* host_rows;    // the layer's host pool rows, mapped into the device address space
  int64_t host_row_stride;  // bytes between consecutive host rows
  int64_t host_num_rows;    // rows of host_rows: a source outside [0, host_num_rows) is an error
  int64_t row_bytes;
};

// Whether copies move 16-byte words: row bytes, both strides and both base addresses are
// multiples of 16. Otherwise they copy byte by byte, many times slower (the binding counts
// such launches and warns once).
inline bool row_copy_in_words(const RowCopyLayer& layer) {
  return layer.row_bytes % 16 == 0 && layer.kv_row_stride % 16 == 0 &&
         layer.host_row_stride % 16 == 0 && reinterpret_cast<uintptr_t>(layer.kv_rows) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(layer.host_rows) % 16 == 0;
}

#if defined(__CUDACC__)
// Whether host row src_row may be copied into device row dst_row of the layer (its own
// rows of a block, within both tables).
__device__ __forceinline__ bool row_copy_in_bounds(const RowCopyLayer& layer, int64_t dst_row,
                                                   int64_t src_row) {
  return src_row >= 0 && src_row < layer.host_num_rows && dst_row >= 0 &&
         dst_row < layer.kv_num_rows && dst_row % layer.kv_block_stride_rows < layer.kv_block_rows;
}
#endif

struct RowCopyArgs {
  RowCopyLayer layer;
  const int64_t* dst_rows;  // [n]: row of kv_rows each entry writes
  const int64_t* src_rows;  // [n]: row of host_rows each entry reads
  const bool* copy;         // [n]: which entries copy (a step's distinct misses)
  int64_t n;
  unsigned long long* error;  // the step's error word: kErrorRowOutOfBounds is OR-ed in
};

// Copies, for every i < n with copy[i], host row src_rows[i] into device row dst_rows[i];
// one warp per entry, ordered on `stream`. An entry with a row out of bounds (of its
// table, or of the layer's own rows within a block) copies nothing and sets
// kErrorRowOutOfBounds in *error.
cudaError_t launch_copy_host_rows(const RowCopyArgs& args, cudaStream_t stream);

}  // namespace hisparse
