// Torch-facing CUDA glue of the fused AdamW step (CUDA builds only, adam_glue.cpp).
#pragma once

#include "../torch_headers.h"

#include <vector>

#include "megadlm/adam.h"

namespace megadlm {
namespace glue {

// Run the step over `table` (host rows, checked by the bindings) on `device`'s current
// stream: the table comes from the device-table cache (uploaded once per distinct table),
// then one kernel launch. No host sync.
void cuda_adamw(c10::Device device, const std::vector<AdamTensor>& table, int64_t total,
                const AdamDTypes& dtypes, const AdamScalars& s);

}  // namespace glue
}  // namespace megadlm
