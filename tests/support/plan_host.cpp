// SPDX-License-Identifier: Apache-2.0
// The fused resolution plan's algorithm (csrc/hisparse_plan.h) built for the host: the
// same phases, run one after another on one thread, for the CPU tests to compare with
// the torch reference. Built by tests/support/plan_host.py with the C++ compiler.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "hisparse_plan.h"

extern "C" void hisparse_plan_host(hisparse::PlanArgs* args) {
  const hisparse::PlanArgs& a = *args;
  std::vector<int64_t> keys(a.max_entries), held(a.hot_pad), partial(hisparse::kPlanThreads + 1),
      scalars(4);
  std::vector<int32_t> lanes(a.max_entries), tokens(a.max_entries / a.topk + 1);
  const hisparse::PlanScratch scratch{keys.data(),    held.data(),  partial.data(),
                                      scalars.data(), lanes.data(), tokens.data()};
  for (int64_t m = 0; m < a.num_requests; ++m) hisparse::plan_request(a, m, scratch);
}

extern "C" int64_t hisparse_plan_args_size() { return sizeof(hisparse::PlanArgs); }
