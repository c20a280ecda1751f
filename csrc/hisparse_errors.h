// SPDX-License-Identifier: Apache-2.0
// Error bits the HiSparse kernels raise in a step's device error word. The same values are
// ERROR_* in vllm/v1/hisparse/resolver.py (tests/unit/test_resolver.py keeps them equal);
// the worker reads the word once per step, after the step's work. A bit the plan also raised
// in a request's own word (kErrorStagingOverflow) fails that request alone; any other bit
// stops the engine.
#pragma once

namespace hisparse {

// A request selected more distinct host rows than its hot buffer and leased staging hold.
constexpr unsigned long long kErrorStagingOverflow = 1ull;

// A row copy entry whose destination or source row is outside its table: skipped.
constexpr unsigned long long kErrorRowOutOfBounds = 4ull;
// A page copy whose device block or host page is outside its table: skipped.
constexpr unsigned long long kErrorPageOutOfBounds = 8ull;
// A token's request row outside the hot state, or a request's table row outside the
// host page table (or more tokens than the plan was sized for): read as resident.
constexpr unsigned long long kErrorRequestOutOfBounds = 16ull;

}  // namespace hisparse
