// SPDX-License-Identifier: Apache-2.0
// Hybrid HiSparse fused resolution plan: one launch decides a step's resolution of one
// top-K selection, one thread block per request with HOST pages, in shared memory.
//
// The algorithm is hisparse_plan.h's (also built for the host by the tests, which hold
// it to the torch reference, plan_resolution in vllm/v1/hisparse/resolver.py). This file
// only launches it. Steps whose requests select more than kPlanMaxEntries entries, or
// hot buffers over kPlanMaxHotRows rows, use the torch operations instead.
//
// This file has no torch dependency so it compiles with plain nvcc; the torch binding is
// csrc/hisparse_ops.cpp.

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_plan.h"
#include "hisparse_plan_launch.h"

namespace hisparse {

namespace {

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs args) {
  extern __shared__ __align__(16) unsigned char shared[];
  int64_t* wide = reinterpret_cast<int64_t*>(shared);
  PlanScratch scratch{};
  scratch.keys = wide;
  scratch.held = scratch.keys + args.max_entries;
  scratch.partial = scratch.held + args.hot_pad;
  scratch.scalars = scratch.partial + kPlanThreads + 1;
  scratch.lanes = reinterpret_cast<int32_t*>(scratch.scalars + 4);
  scratch.tokens = scratch.lanes + args.max_entries;
  plan_request(args, blockIdx.x, scratch);
}

}  // namespace

cudaError_t launch_plan(const PlanArgs& args, cudaStream_t stream) {
  if (args.num_requests == 0) return cudaSuccess;
  const int64_t bytes = plan_scratch_bytes(args.max_entries, args.hot_pad, args.topk);
  cudaError_t status = cudaFuncSetAttribute(
      plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  plan_kernel<<<static_cast<unsigned>(args.num_requests), kPlanThreads, bytes, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace hisparse
