// SPDX-License-Identifier: Apache-2.0
// Error bits the HiSparse kernels raise in a step's device error word. The same values are
// ERROR_* in vllm/v1/hisparse/resolver.py (tests/unit/test_kernel_contract.py keeps them equal);
// the worker reads the word once per step, after the step's work, and raises for any bit.
#pragma once

namespace hisparse {

// A row copy entry whose destination or source row is outside its table: skipped.
constexpr unsigned long long kErrorRowOutOfBounds = 4ull;
// A page copy whose device block or host page is outside its table: skipped.
constexpr unsigned long long kErrorPageOutOfBounds = 8ull;

}  // namespace hisparse
