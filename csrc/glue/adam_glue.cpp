// Torch-facing CUDA glue of the fused AdamW step (CUDA builds only): the AdamTensor table
// through the content-keyed device-table cache of cuda_glue.cpp, then the launch of
// csrc/cuda/adam.cu on torch's current stream. An optimizer passes the same table every
// step (same parameters, same state tensors), so after the first step nothing is staged
// or uploaded; a table seen under CUDA-graph capture is kept for the graph's lifetime, as
// the cache does for every table.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "adam_glue.h"
#include "glue.h"

namespace megadlm {
namespace glue {

void cuda_adamw(c10::Device device, const std::vector<AdamTensor>& table, int64_t total,
                const AdamDTypes& dtypes, const AdamScalars& s) {
  if (total == 0) return;
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  // The cache keys on bytes and stores Segment-sized rows: an AdamTensor is two of them.
  thread_local std::vector<Segment> rows;
  rows.resize(table.size() * (sizeof(AdamTensor) / sizeof(Segment)));
  std::memcpy(static_cast<void*>(rows.data()), table.data(), table.size() * sizeof(AdamTensor));
  // Held until the launch is queued (stream order then protects the bytes).
  const at::Tensor keep = cached_device_table(device, rows);
  cuda::adam_run(static_cast<const AdamTensor*>(keep.data_ptr()), int64_t(table.size()), total,
                 dtypes, s, stream.stream());
}

}  // namespace glue
}  // namespace megadlm
