// SPDX-License-Identifier: Apache-2.0
// Hybrid HiSparse batched page copy: pages of every sparse-MLA layer between the
// device KV cache and the pinned host pool, in one launch.
//
// The semantics are those of the torch reference, vllm/v1/hisparse/page_copy.py
// (copy_pages): for page n and layer l, the layer's block block_ids[n, l] and the
// host pool's slot [l, host_pages[n]] hold the same bytes afterwards, copied in
// the requested direction. One thread block copies one (page, layer) pair; the
// host pool is pinned memory read or written through its device mapping, so the
// copy is ordered on the launching stream like any kernel (no separate DMA
// queue to synchronise with the forward). Each thread moves 16-byte words when
// every page start allows it. Pages never repeat (refused up front), so thread
// blocks never write the same bytes; indices are range-checked in the kernel.
//
// This file has no torch dependency so it compiles with plain nvcc; the torch
// binding is csrc/hisparse_ops.cpp.

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_copy.h"
#include "hisparse_page_copy.h"

namespace hisparse {

namespace {

template <typename word_t>
__global__ void copy_pages_kernel(PageCopyArgs args) {
  const int64_t n = blockIdx.x / args.num_layers;
  const int64_t l = blockIdx.x % args.num_layers;
  const int64_t block = args.block_ids[n * args.num_layers + l];
  const int64_t host_page_index = args.host_pages[n];
  if (block < 0 || block >= args.layer_num_blocks[l] || host_page_index < 0 ||
      host_page_index >= args.num_host_pages) {
    if (threadIdx.x == 0) atomicOr(args.error, kErrorPageOutOfBounds);
    return;
  }
  char* device_page =
      reinterpret_cast<char*>(args.layer_base[l]) + block * args.layer_block_stride[l];
  char* host_page =
      args.host_pool + l * args.host_layer_stride + host_page_index * args.host_page_stride;
  const word_t* src = reinterpret_cast<const word_t*>(args.to_host ? device_page : host_page);
  word_t* dst = reinterpret_cast<word_t*>(args.to_host ? host_page : device_page);
  copy_words(dst, src, args.page_bytes / static_cast<int64_t>(sizeof(word_t)), threadIdx.x,
             blockDim.x);
}

}  // namespace

cudaError_t launch_copy_pages(const PageCopyArgs& args, cudaStream_t stream) {
  if (args.num_pages == 0 || args.num_layers == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args.num_pages * args.num_layers));
  if (page_copy_in_words(args)) {
    copy_pages_kernel<uint4><<<grid, kThreadsPerPageCopy, 0, stream>>>(args);
  } else {
    copy_pages_kernel<uint8_t><<<grid, kThreadsPerPageCopy, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace hisparse
