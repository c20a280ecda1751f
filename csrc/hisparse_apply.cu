// SPDX-License-Identifier: Apache-2.0
// Hybrid HiSparse resolver, fused replay of one layer: the semantics of the torch
// reference, vllm/v1/hisparse/resolver.py (apply_resolution), in one launch instead of
// a gather, the row copy, a second gather, a cast and a select:
// - resolved[e] = slot_rows[entry_request[e], entry_slot[e]] where on_host[e], else rows[e];
// - for every e with load[e]: row copy_rows[load_request[e], load_slot[e]] of kv_rows holds
//   host row load_host_row[e] afterwards.
// One thread per entry resolves; then each warp takes the loads among its 32 entries
// from a ballot and copies them one by one, all 32 lanes on each row (csrc/hisparse_copy.h:
// a batch of loads before its stores). Misses never share a destination (each has its own
// slot), so warps never race. Every index is range-checked: a slot outside [M, W), a
// destination outside the layer's own rows, or a host row outside the pool copies nothing
// and raises kErrorRowOutOfBounds in the step's error word.
//
// This file has no torch dependency so it compiles with plain nvcc; the torch binding is
// csrc/hisparse_ops.cpp.

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_apply.h"
#include "hisparse_copy.h"

namespace hisparse {

namespace {

__device__ __forceinline__ bool slot_in_bounds(const ApplyArgs& a, int64_t request, int64_t slot) {
  return request >= 0 && slot >= 0 && slot < a.slot_width &&
         request * a.slot_width + slot < a.num_slot_rows;
}

template <typename row_t, typename word_t>
__global__ void apply_resolution_kernel(ApplyArgs a) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x % 32;
  bool loads = false;
  if (e < a.n) {
    row_t row = static_cast<const row_t*>(a.rows)[e];
    if (a.on_host[e]) {
      const int64_t request = a.entry_request[e], slot = a.entry_slot[e];
      if (slot_in_bounds(a, request, slot)) {
        row = static_cast<row_t>(a.slot_rows[request * a.slot_width + slot]);
      } else {
        atomicOr(a.error, kErrorRowOutOfBounds);
        row = 0;
      }
    }
    static_cast<row_t*>(a.resolved)[e] = row;
    loads = a.load[e];
  }
  // Every lane reaches the ballot, those past n too.
  unsigned pending = __ballot_sync(0xffffffffu, loads);
  const int64_t warp_first = e - lane;
  while (pending) {
    const int source = __ffs(pending) - 1;
    pending &= pending - 1;
    const int64_t entry = warp_first + source;
    const int64_t request = a.load_request[entry], slot = a.load_slot[entry];
    const int64_t src_row = a.load_host_row[entry];
    const int64_t dst_row =
        slot_in_bounds(a, request, slot) ? a.copy_rows[request * a.slot_width + slot] : -1;
    const RowCopyLayer& layer = a.layer;
    if (!row_copy_in_bounds(layer, dst_row, src_row)) {
      if (lane == 0) atomicOr(a.error, kErrorRowOutOfBounds);
      continue;
    }
    const word_t* src =
        reinterpret_cast<const word_t*>(layer.host_rows + src_row * layer.host_row_stride);
    word_t* dst = reinterpret_cast<word_t*>(layer.kv_rows + dst_row * layer.kv_row_stride);
    copy_words(dst, src, layer.row_bytes / static_cast<int64_t>(sizeof(word_t)), lane, 32);
  }
}

template <typename row_t>
cudaError_t launch_for_rows(const ApplyArgs& args, cudaStream_t stream) {
  const dim3 grid(
      static_cast<unsigned>((args.n + kApplyThreadsPerBlock - 1) / kApplyThreadsPerBlock));
  if (row_copy_in_words(args.layer)) {
    apply_resolution_kernel<row_t, uint4><<<grid, kApplyThreadsPerBlock, 0, stream>>>(args);
  } else {
    apply_resolution_kernel<row_t, uint8_t><<<grid, kApplyThreadsPerBlock, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_apply_resolution(const ApplyArgs& args, cudaStream_t stream) {
  if (args.n == 0) return cudaSuccess;
  return args.rows_int64 ? launch_for_rows<int64_t>(args, stream)
                         : launch_for_rows<int32_t>(args, stream);
}

}  // namespace hisparse
