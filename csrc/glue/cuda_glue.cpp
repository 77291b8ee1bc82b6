// Torch-facing CUDA glue of the element ops (CUDA builds only): uploads the segment
// table through a pinned staging buffer (torch's caching host allocator keeps it alive
// until the copy ran) and launches on torch's current stream of the tensors' device.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

#include "glue.h"

namespace megadlm {
namespace glue {

at::Tensor cuda_run(OpKind op, c10::Device device, const std::vector<Segment>& segs, int64_t total,
                    float scale) {
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto on_dev = at::TensorOptions().device(device);
  at::Tensor out;
  if (op == kSumSquares) out = at::empty({}, on_dev.dtype(at::kFloat));
  if (op == kNonFinite) out = at::empty({}, on_dev.dtype(at::kInt));
  if (total == 0 && !out.defined()) return out;

  at::Tensor table;
  if (!segs.empty()) {
    const int64_t nbytes = int64_t(segs.size() * sizeof(Segment));
    at::Tensor host = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), segs.data(), size_t(nbytes));
    table = host.to(on_dev, /*non_blocking=*/true);  // ordered on `stream` before the kernel
  }
  at::Tensor workspace;
  if (const int64_t wb = cuda::workspace_bytes(op)) workspace = at::empty({wb}, on_dev.dtype(at::kByte));
  cuda::run(op, table.defined() ? static_cast<const Segment*>(table.data_ptr()) : nullptr,
            int64_t(segs.size()), total, scale, workspace.defined() ? workspace.data_ptr() : nullptr,
            out.defined() ? out.data_ptr() : nullptr, stream);
  return out;
}

}  // namespace glue
}  // namespace megadlm
