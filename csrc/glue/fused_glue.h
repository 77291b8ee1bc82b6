// Torch-facing CUDA launch of the fused transformer ops (CUDA builds only): torch's current
// stream of the tensors' device, the device's SM count, and the weight-gradient partials of
// the RMSNorm backward (the only allocation besides the outputs, which the bindings make).
#pragma once

#include <c10/core/Device.h>

#include "megadlm/fused.h"

namespace megadlm {
namespace glue {

void cuda_rope(const fused::RopeParams& p, c10::Device device);
void cuda_swiglu(const fused::SwigluParams& p, bool forward, c10::Device device);
void cuda_add_rmsnorm_fwd(const fused::AddNormFwdParams& p, c10::Device device);
// Fills p.partial with a [blocks, H] fp32 scratch tensor on the current stream.
void cuda_add_rmsnorm_bwd(fused::AddNormBwdParams p, c10::Device device);

}  // namespace glue
}  // namespace megadlm
