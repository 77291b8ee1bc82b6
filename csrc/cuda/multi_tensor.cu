// CUDA kernels of the multi-tensor ops: raw pointers + cudaStream_t only (no torch
// headers: the CPU wheel of torch lacks its CUDA headers and CI compiles this file with
// plain nvcc). The glue (csrc/glue/cuda_glue.cpp) uploads the segment table and calls
// `megadlm::cuda::run` on torch's current stream.
//
// Multi-tensor-apply over the *global* element range: the concatenation of all
// tensors is cut into chunks of kChunk elements and each block of a fixed grid takes a
// contiguous run of chunks; it finds its first segment by binary search in the device
// table, then walks the segments its range covers. So one launch covers any number of
// tensors, and tiny tensors share blocks instead of each costing a block.
// Inside a segment, 8 elements per thread move with 16-byte loads/stores once both
// the source and the destination are 16-byte aligned (a short scalar head gets there);
// otherwise every element goes through the scalar path (still coalesced).
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>

#include "megadlm/kernels.h"
#include "multi_tensor_kernels.cuh"

namespace megadlm {
namespace cuda {
namespace {

constexpr int kMaxReduceBlocks = 1024;  // fp32 partials of l2_norm in the workspace

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("megadlm_ext CUDA ") + what + " failed: " + cudaGetErrorString(e));
}

int sm_count() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  static std::mutex m;
  static int cached[64] = {0};
  std::lock_guard<std::mutex> lock(m);
  if (dev < 64 && cached[dev]) return cached[dev];
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  if (dev < 64) cached[dev] = n;
  return n;
}

// The one element kernel per op. `partials` (reductions): one float per block;
// `flag`: set to 1 when a non-finite element is found (zeroed before the launch).
template <int OP>
__global__ void __launch_bounds__(kThreads)
megadlm_multi_tensor_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t total, float scale,
                            float* __restrict__ partials, int* flag) {
  Acc acc;
  block_range<OP>(segs, nseg, total, scale, flag, acc);
  if (OP == kNonFinite) {
    if (__syncthreads_or(acc.bad) && threadIdx.x == 0) *flag = 1;
  } else if (OP == kSumSquares) {
    __shared__ float warp_sums[kThreads / 32];
    float v = acc.sum;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      float t = 0.f;
      for (int w = 0; w < kThreads / 32; ++w) t += warp_sums[w];
      partials[blockIdx.x] = t;
    }
  }
}

// Sum the block partials in double, in a fixed order (deterministic), write sqrt.
__global__ void megadlm_norm_finish_kernel(const float* partials, int n, float* out) {
  __shared__ double sums[kThreads];
  double t = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) t += double(partials[i]);
  sums[threadIdx.x] = t;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sums[threadIdx.x] += sums[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = float(sqrt(sums[0]));
}

template <int OP>
void launch(const Segment* d_segs, int64_t nseg, int64_t total, float scale, float* partials, int* flag,
            int grid, cudaStream_t stream) {
  megadlm_multi_tensor_kernel<OP><<<grid, kThreads, 0, stream>>>(d_segs, nseg, total, scale, partials, flag);
}

}  // namespace

int64_t workspace_bytes(OpKind op) {
  return op == kSumSquares ? int64_t(kMaxReduceBlocks) * int64_t(sizeof(float)) : 0;
}

void run(OpKind op, const Segment* d_segs, int64_t nseg, int64_t total, float scale, void* d_workspace,
         void* d_out, void* stream_ptr) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  const int64_t cap = op == kSumSquares ? std::min<int64_t>(kMaxReduceBlocks, int64_t(sm_count()) * 4)
                                        : int64_t(sm_count()) * 8;
  const int grid = int(std::max<int64_t>(1, std::min(chunks, cap)));
  float* partials = static_cast<float*>(d_workspace);
  int* flag = static_cast<int*>(d_out);
  switch (op) {
    case kCopy: launch<kCopy>(d_segs, nseg, total, scale, nullptr, nullptr, grid, stream); break;
    case kScale: launch<kScale>(d_segs, nseg, total, scale, nullptr, nullptr, grid, stream); break;
    case kAccumulate: launch<kAccumulate>(d_segs, nseg, total, scale, nullptr, nullptr, grid, stream); break;
    case kNonFinite:
      check(cudaMemsetAsync(flag, 0, sizeof(int), stream), "cudaMemsetAsync");
      if (total) launch<kNonFinite>(d_segs, nseg, total, scale, nullptr, flag, grid, stream);
      break;
    case kSumSquares:
      if (total) launch<kSumSquares>(d_segs, nseg, total, scale, partials, nullptr, grid, stream);
      megadlm_norm_finish_kernel<<<1, kThreads, 0, stream>>>(partials, total ? grid : 0, static_cast<float*>(d_out));
      break;
  }
  check(cudaGetLastError(), "kernel launch");
}

}  // namespace cuda
}  // namespace megadlm
