// SPDX-License-Identifier: Apache-2.0
// Launcher interface of the HiSparse resolver's row copy (hisparse_row_copy.cu).
// Plain CUDA types only, so the kernel builds without torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace hisparse {

constexpr int kRowCopyWarpsPerBlock = 8;

struct RowCopyArgs {
  char* kv_rows;             // the layer's KV cache rows on the device
  int64_t kv_row_stride;     // bytes between consecutive rows of kv_rows
  const char* host_rows;     // the layer's host pool rows, mapped into the device address space
  int64_t host_row_stride;   // bytes between consecutive host rows
  const int64_t* dst_rows;   // [n]: row of kv_rows each entry writes
  const int64_t* src_rows;   // [n]: row of host_rows each entry reads
  const bool* copy;          // [n]: which entries copy (a step's distinct misses)
  int64_t n;
  int64_t row_bytes;
};

// Copies, for every i < n with copy[i], host row src_rows[i] into device row dst_rows[i];
// one warp per entry, ordered on `stream`.
cudaError_t launch_copy_host_rows(const RowCopyArgs& args, cudaStream_t stream);

}  // namespace hisparse
