// CUDA kernels of the multi-tensor ops: raw pointers + cudaStream_t only (no torch
// headers: the CPU wheel of torch lacks its CUDA headers and CI compiles this file with
// plain nvcc). The glue (csrc/glue/cuda_glue.cpp) provides the device segment table
// and calls `megadlm::cuda::run` on torch's current stream.
//
// Multi-tensor-apply over the *global* element range: the concatenation of all
// tensors is cut into chunks of kChunk elements, split evenly over one resident wave of
// blocks (occupancy x SMs, from cudaOccupancyMaxActiveBlocksPerMultiprocessor); each
// block finds its first segment by binary search in the device table, then walks the
// segments its range covers. So one launch covers any number of tensors, and tiny
// tensors share blocks instead of each costing a block.
// Kernels are templates on the (source, destination) dtype pair: a list whose tensors
// share one pair (every DDP bucket) runs a kernel with no dtype branches at all; a mixed
// list dispatches once per segment. Inside a segment, 8 elements per thread move with
// 16-byte loads/stores, several loads in flight per thread, once source and destination
// are 16-byte aligned (a short scalar head gets there).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "megadlm/kernels.h"
#include "launch.cuh"
#include "multi_tensor_kernels.cuh"

namespace megadlm {
namespace cuda {
namespace {

constexpr int kMaxReduceBlocks = 1024;  // fp32 partials of l2_norm in the workspace

const char* op_name(OpKind op) {
  switch (op) {
    case kCopy: return "copy (flatten/unflatten)";
    case kAccumulate: return "accumulate_into";
    case kScale: return "scale_";
    case kSumSquares: return "l2_norm";
    case kNonFinite: return "has_nonfinite";
    case kCopyStreaming: return "streaming copy";
  }
  return "unknown op";
}

// The one element kernel per (op, src type, dst type). `partials` (reductions): one
// float per block; `flag`: set to 1 when a non-finite element is found (zeroed first).
template <int OP, class S, class D>
__global__ void __launch_bounds__(kThreads)
    megadlm_multi_tensor_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t total,
                                float scale, float* __restrict__ partials, int* flag) {
  Acc acc;
  block_range<OP, S, D>(segs, nseg, total, scale, flag, acc);
  if constexpr (OP == kNonFinite) {
    if (__syncthreads_or(acc.bad) && threadIdx.x == 0) *flag = 1;
  } else if constexpr (OP == kSumSquares) {
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

template <int OP, class S, class D>
int grid_of(int64_t total) {
  const auto occ =
      occupancy(reinterpret_cast<const void*>(&megadlm_multi_tensor_kernel<OP, S, D>), kThreads);
  const int64_t cap = OP == kSumSquares ? kMaxReduceBlocks : int64_t(1) << 30;
  return grid_size((total + kChunk - 1) / kChunk, occ.second, occ.first, cap);
}

struct Launch {
  const Segment* segs;
  int64_t nseg, total;
  float scale;
  float* partials;
  int* flag;
  cudaStream_t stream;
  int grid = 0;  // out: blocks launched
};

template <int OP, class S, class D>
void launch(Launch& l) {
  l.grid = grid_of<OP, S, D>(l.total);
  megadlm_multi_tensor_kernel<OP, S, D>
      <<<l.grid, kThreads, 0, l.stream>>>(l.segs, l.nseg, l.total, l.scale, l.partials, l.flag);
}

// The element kernel of `op` for the list's dtype pair.
template <int OP>
void launch_op(int32_t pair, Launch& l) {
  with_kernel_types<OP>(pair, [&](auto s, auto d) { launch<OP, decltype(s), decltype(d)>(l); });
}

}  // namespace

int64_t workspace_bytes(OpKind op) {
  return op == kSumSquares ? int64_t(kMaxReduceBlocks) * int64_t(sizeof(float)) : 0;
}

int grid_for(OpKind op, int32_t pair, int64_t total) {
  int g = 0;
  auto pick = [&](auto tag) {
    constexpr int OP = decltype(tag)::value;
    with_kernel_types<OP>(
        pair, [&](auto s, auto d) { g = grid_of<OP, decltype(s), decltype(d)>(total); });
  };
  switch (op) {
    case kCopy: pick(std::integral_constant<int, kCopy>{}); break;
    case kAccumulate: pick(std::integral_constant<int, kAccumulate>{}); break;
    case kScale: pick(std::integral_constant<int, kScale>{}); break;
    case kSumSquares: pick(std::integral_constant<int, kSumSquares>{}); break;
    case kNonFinite: pick(std::integral_constant<int, kNonFinite>{}); break;
    default:
      throw std::invalid_argument(std::string("megadlm_ext CUDA: no GPU kernel for op ") +
                                  op_name(op));
  }
  return g;
}

void run(OpKind op, int32_t pair, const Segment* d_segs, int64_t nseg, int64_t total, float scale,
         void* d_workspace, void* d_out, void* stream_ptr) {
  check_pending(op_name(op));
  Launch l{d_segs,
           nseg,
           total,
           scale,
           static_cast<float*>(d_workspace),
           static_cast<int*>(d_out),
           static_cast<cudaStream_t>(stream_ptr)};
  switch (op) {
    case kCopy: launch_op<kCopy>(pair, l); break;
    case kScale: launch_op<kScale>(pair, l); break;
    case kAccumulate: launch_op<kAccumulate>(pair, l); break;
    case kNonFinite:
      check(cudaMemsetAsync(l.flag, 0, sizeof(int), l.stream),
            "cudaMemsetAsync before has_nonfinite");
      if (total) launch_op<kNonFinite>(pair, l);
      break;
    case kSumSquares:
      l.flag = nullptr;
      if (total) launch_op<kSumSquares>(pair, l);
      megadlm_norm_finish_kernel<<<1, kThreads, 0, l.stream>>>(l.partials, l.grid,
                                                               static_cast<float*>(d_out));
      break;
    default:  // kCopyStreaming (CPU-only) or a corrupt code: never silently do nothing
      throw std::invalid_argument(std::string("megadlm_ext CUDA: no GPU kernel for op ") +
                                  op_name(op) + " (code " + std::to_string(int(op)) + ")");
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("megadlm_ext CUDA ") + op_name(op) +
                             " kernel launch failed (" + std::to_string(l.grid) + " blocks x " +
                             std::to_string(kThreads) + " threads, " + std::to_string(nseg) +
                             " tensors, " + std::to_string(total) +
                             " elements): " + cudaGetErrorString(e));
}

}  // namespace cuda
}  // namespace megadlm
