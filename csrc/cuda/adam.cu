// CUDA kernel of the fused AdamW step (megadlm_ext.adamw_step): raw pointers and a
// cudaStream_t only, like multi_tensor.cu. The glue (csrc/glue/adam_glue.cpp) provides the
// AdamTensor table in device memory (through the content-keyed device-table cache, so a
// step over the same parameters uploads nothing after the first) and calls adam_run on
// torch's current stream.
//
// One launch for every tensor of the list: the concatenation of the tensors is cut into
// chunks of kChunk elements, split evenly over one resident wave of blocks; each block
// walks the tensors its chunks cover (walk_block_range, shared with the multi-tensor
// kernels). Kernels are templates on the storage dtypes (grad, exp_avg, exp_avg_sq, model
// param): no dtype branch inside. Per element the step moves 16 + 12 bytes (fp32 param,
// grad and moments; fewer with 16-bit grads or moments, 2 more with the model-param copy)
// with 16-byte vector loads and stores once every stream is aligned, and computes in fp32
// registers with IEEE operations that are never contracted (adam_update): bitwise the CPU
// kernel.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "adam_kernels.cuh"
#include "launch.cuh"

namespace megadlm {
namespace cuda {
namespace {

template <class G, class M, class V, class P>
__global__ void __launch_bounds__(kThreads)
    megadlm_adamw_kernel(const AdamTensor* __restrict__ table, int64_t n, int64_t total,
                         AdamScalars s) {
  adam_block_range<G, M, V, P>(table, n, total, s);
}

}  // namespace

void adam_run(const AdamTensor* d_table, int64_t n, int64_t total, const AdamDTypes& dtypes,
              const AdamScalars& s, void* stream_ptr) {
  if (total == 0) return;
  check_pending("adamw_step");
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  int grid = 0;
  with_adam_types(dtypes, [&](auto g, auto m, auto v, auto p) {
    auto* kernel = &megadlm_adamw_kernel<decltype(g), decltype(m), decltype(v), decltype(p)>;
    const auto occ = occupancy(reinterpret_cast<const void*>(kernel), kThreads);
    grid = grid_size((total + kChunk - 1) / kChunk, occ.second, occ.first, int64_t(1) << 30);
    kernel<<<grid, kThreads, 0, stream>>>(d_table, n, total, s);
  });
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error("megadlm_ext CUDA adamw_step kernel launch failed (" +
                             std::to_string(grid) + " blocks x " + std::to_string(kThreads) +
                             " threads, " + std::to_string(n) + " tensors, " +
                             std::to_string(total) + " elements): " + cudaGetErrorString(e));
}

}  // namespace cuda
}  // namespace megadlm
