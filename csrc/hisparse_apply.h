// SPDX-License-Identifier: Apache-2.0
// Launcher interface of the HiSparse resolver's fused replay (hisparse_apply.cu): one
// layer's rows to read and its row copies, in one launch. Plain CUDA types only, so the
// kernel builds without torch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "hisparse_errors.h"
#include "hisparse_row_copy.h"

namespace hisparse {

constexpr int kApplyThreadsPerBlock = 256;

struct ApplyArgs {
  // Per entry of the step's selection [T, K], flattened (n = T * K):
  const void* rows;              // the backend's own rows (int32 or int64, rows_int64)
  void* resolved;                // out: the rows attention reads, rows' dtype
  const bool* on_host;           // the entry is a position on a HOST page
  const int64_t* entry_request;  // its request row m
  const int64_t* entry_slot;     // its slot, hot (< H) or staging (>= H)
  // Per distinct miss, at its plan entry (the same n entries, masked by `load`):
  const bool* load;
  const int64_t* load_request;
  const int64_t* load_slot;
  const int64_t* load_host_row;  // row of host_rows to copy
  int64_t n;
  bool rows_int64;
  // [M, W] slots of the step's requests: in the rows' index space (slot_rows) and as rows
  // of kv_rows (copy_rows); W = hot plus staging slots.
  const int64_t* slot_rows;
  const int64_t* copy_rows;
  int64_t num_slot_rows;      // M * W: a slot outside it is an error
  int64_t slot_width;         // W
  RowCopyLayer layer;         // where the misses are copied, as the row copy's
  unsigned long long* error;  // the step's error word: kErrorRowOutOfBounds is OR-ed in
};

// One thread per entry writes its resolved row; each warp then copies the rows of the
// misses among its 32 entries, one after another, the whole warp on each row (a ballot
// of `load`, so entries that copy nothing cost no warp). Ordered on `stream`. A slot,
// destination or host row out of bounds copies nothing, resolves to row 0, and sets
// kErrorRowOutOfBounds in *error.
cudaError_t launch_apply_resolution(const ApplyArgs& args, cudaStream_t stream);

}  // namespace hisparse
