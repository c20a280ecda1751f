// SPDX-License-Identifier: Apache-2.0
// Launcher interface of the HiSparse fused resolution plan (hisparse_plan.cu).
// Plain CUDA types only, so the kernel builds without torch.
#pragma once

#include <cuda_runtime.h>

#include "hisparse_plan.h"

namespace hisparse {

// One block per request row of the hot state, ordered on `stream`. The caller zeroes
// the outputs and sizes max_entries and hot_pad (powers of two, within the limits).
cudaError_t launch_plan(const PlanArgs& args, cudaStream_t stream);

}  // namespace hisparse
