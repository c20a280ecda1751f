// SPDX-License-Identifier: Apache-2.0
// Launcher interface of the HiSparse batched page copy (hisparse_page_copy.cu).
// Plain CUDA types only, so the kernel builds without torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_errors.h"

namespace hisparse {

constexpr int kThreadsPerPageCopy = 256;

struct PageCopyArgs {
  // Per sparse-MLA layer: the device address of its KV cache block 0 and the bytes
  // between consecutive blocks (a block-outermost layout strides past other groups).
  const int64_t* layer_base;          // [num_layers], device addresses
  const int64_t* layer_block_stride;  // [num_layers], bytes
  const int64_t* layer_num_blocks;    // [num_layers]: a block outside [0, n) is an error
  // The host pool, [layer, host page, page_bytes], mapped into the device address space.
  char* host_pool;
  int64_t host_layer_stride;  // bytes
  int64_t host_page_stride;   // bytes
  int64_t num_host_pages;     // a host page outside [0, num_host_pages) is an error
  const int64_t* block_ids;   // [num_pages, num_layers]: device block of page n in layer l
  const int64_t* host_pages;  // [num_pages]
  int64_t num_pages;
  int64_t num_layers;
  int64_t page_bytes;  // one layer's page: block_size rows of the latent width
  bool to_host;        // device -> host (a post-forward copy) or host -> device (a restore)
  // Every layer_base and layer_block_stride is a multiple of 16 (checked on the host,
  // where they are known; the launcher checks the rest).
  bool device_aligned16;
  unsigned long long* error;  // the step's error word: kErrorPageOutOfBounds is OR-ed in
};

// Whether the launch copies in 16-byte words (every page start and the page size are
// multiples of 16: the usual case, 64 rows of a 576- or 656-byte latent); otherwise it
// copies byte by byte, many times slower (the binding counts such launches and warns once).
inline bool page_copy_in_words(const PageCopyArgs& args) {
  return args.device_aligned16 && args.page_bytes % 16 == 0 && args.host_layer_stride % 16 == 0 &&
         args.host_page_stride % 16 == 0 && reinterpret_cast<uintptr_t>(args.host_pool) % 16 == 0;
}

// One launch for every page and every layer, ordered on `stream`. Pages never repeat
// (the caller refuses duplicate host pages and duplicate blocks of a layer up front),
// so no two thread blocks write the same bytes. A (page, layer) whose block or host
// page is out of bounds copies nothing and sets kErrorPageOutOfBounds in *error.
cudaError_t launch_copy_pages(const PageCopyArgs& args, cudaStream_t stream);

}  // namespace hisparse
