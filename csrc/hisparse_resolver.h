// SPDX-License-Identifier: Apache-2.0
// Launcher interface of the HiSparse top-K resolver kernel (hisparse_resolver.cu).
// Plain CUDA types only, so the kernel builds without torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace hisparse {

constexpr int kThreadsPerRequest = 128;
// Values of *ResolverArgs::error after a launch (0 = success).
constexpr unsigned long long kErrorHotBufferTooSmall = 1;
constexpr unsigned long long kErrorNotInHostPool = 2;

struct ResolverArgs {
  const int64_t* positions;        // [num_tokens, topk], -1 padded
  const int64_t* req_ids;          // [num_tokens]
  const int64_t* page_table;       // [num_requests, num_pages], -1 = not resident
  const int64_t* host_page_table;  // [num_requests, num_pages], -1 = no host copy
  const int64_t* hot_rows;         // [num_requests, hot_slots]
  int64_t* hot_positions;          // [num_requests, hot_slots], -1 = empty
  int64_t* hot_stamps;             // [num_requests, hot_slots], -1 = never used
  int64_t* out;                    // [num_tokens, topk]
  int64_t* error;                  // [1], zero before the launch
  int64_t num_tokens;
  int64_t topk;
  int64_t num_requests;
  int64_t num_pages;
  int64_t hot_slots;
  int64_t width;  // elements per row
  int64_t block_size;
  int64_t block_stride_rows;
  int64_t step;
};

// kv_rows: device rows [*, width]; host_rows: pinned host rows [*, width] mapped
// into the device address space. element_bytes: 1, 2 or 4.
cudaError_t launch_resolve_topk_slots(const ResolverArgs& args, void* kv_rows,
                                      const void* host_rows, int element_bytes,
                                      cudaStream_t stream);

}  // namespace hisparse
