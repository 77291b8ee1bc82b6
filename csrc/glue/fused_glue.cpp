// Torch-facing CUDA launch of the fused transformer ops (see fused_glue.h): the raw-pointer
// launchers of csrc/cuda/fused.cu on torch's current stream of the tensors' device. The
// RMSNorm backward's [P, H] fp32 partials come from torch's caching allocator on that stream
// (freed when this returns; stream order keeps them alive for the kernels).
#include "fused_glue.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace megadlm {
namespace glue {
namespace {

void* current_stream(c10::Device device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

}  // namespace

void cuda_rope(const fused::RopeParams& p, c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  fused::cuda::rope(p, current_stream(device));
}

void cuda_swiglu(const fused::SwigluParams& p, bool forward, c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  if (forward)
    fused::cuda::swiglu_fwd(p, current_stream(device));
  else
    fused::cuda::swiglu_bwd(p, current_stream(device));
}

void cuda_add_rmsnorm_fwd(const fused::AddNormFwdParams& p, c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  fused::cuda::add_rmsnorm_fwd(p, current_stream(device));
}

void cuda_add_rmsnorm_bwd(fused::AddNormBwdParams p, c10::Device device) {
  c10::cuda::CUDAGuard guard(device);
  // torch caches the device properties: no driver query per call
  const int sms = at::cuda::getDeviceProperties(device.index())->multiProcessorCount;
  const int64_t blocks = fused::cuda::add_rmsnorm_bwd_blocks(p.M, p.H, sms);
  const at::Tensor partial =
      at::empty({blocks * p.H}, at::TensorOptions().dtype(at::kFloat).device(device));
  p.partial = partial.data_ptr<float>();
  fused::cuda::add_rmsnorm_bwd(p, sms, current_stream(device));
}

}  // namespace glue
}  // namespace megadlm
