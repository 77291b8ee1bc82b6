// CUDA kernels of the multi-tensor ops: raw pointers + cudaStream_t only (no torch
// headers: the CPU wheel of torch lacks its CUDA headers and CI compiles this file with
// plain nvcc). The glue (csrc/glue/cuda_glue.cpp) uploads the segment table and calls
// `megadlm::cuda::run` on torch's current stream.
//
// Multi-tensor-apply over the *global* element range: the concatenation of all
// tensors is cut into chunks of kChunk elements; a fixed grid strides over the chunks;
// a block finds the first segment of its chunk by binary search in the device table,
// then walks the segments the chunk covers. So one launch covers any number of
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

namespace megadlm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = int64_t(kThreads) * kVec * 4;  // elements per block step
constexpr int kMaxReduceBlocks = 1024;                     // partials in the workspace

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

// Per-thread state of the reductions.
struct Acc {
  float sum = 0.f;
  bool bad = false;
};

template <int OP>
__device__ __forceinline__ void apply_scalar(const Segment& s, int64_t i, float scale, Acc& acc) {
  const float x = load_as_float(s.src, s.src_dtype, i);
  if (OP == kSumSquares) {
    acc.sum = fmaf(x, x, acc.sum);
  } else if (OP == kNonFinite) {
    acc.bad |= !isfinite(x);
  } else if (OP == kAccumulate) {
    // mul then add, two roundings: bitwise the CPU kernels and the reference route
    store_from_float(s.dst, s.dst_dtype, i, __fadd_rn(load_as_float(s.dst, s.dst_dtype, i), __fmul_rn(x, scale)));
  } else {
    store_from_float(s.dst, s.dst_dtype, i, __fmul_rn(x, scale));
  }
}

template <int OP>
__device__ __forceinline__ void apply_vec(const Segment& s, int64_t i, float scale, Acc& acc) {
  if (OP == kCopy && s.src_dtype == s.dst_dtype && scale == 1.0f) {  // raw 16-byte moves
    const int es = dtype_size(s.src_dtype);
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(s.src) + i * es);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(s.dst) + i * es);
    dst[0] = src[0];
    if (es == 4) dst[1] = src[1];
    return;
  }
  float v[kVec];
  load8(s.src, s.src_dtype, i, v);
  if (OP == kSumSquares) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc.sum = fmaf(v[k], v[k], acc.sum);
    return;
  }
  if (OP == kNonFinite) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc.bad |= !isfinite(v[k]);
    return;
  }
  if (OP == kAccumulate) {
    float d[kVec];
    load8(s.dst, s.dst_dtype, i, d);
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = __fadd_rn(d[k], __fmul_rn(v[k], scale));
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v[k] = __fmul_rn(v[k], scale);
  }
  store8(s.dst, s.dst_dtype, i, v);
}

// Elements [a, b) of segment s, by the whole block.
template <int OP>
__device__ void process(const Segment& s, int64_t a, int64_t b, float scale, Acc& acc) {
  const int es = dtype_size(s.src_dtype), ed = dtype_size(s.dst_dtype);
  const bool reads_only = OP == kSumSquares || OP == kNonFinite;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(s.src) + uintptr_t(a * es);
  const uintptr_t da = reinterpret_cast<uintptr_t>(s.dst) + uintptr_t(a * ed);
  int head = -1;  // elements before both pointers are 16-byte aligned; -1: never
  for (int h = 0; h < kVec; ++h)
    if (((sa + uintptr_t(h * es)) & 15u) == 0 && (reads_only || ((da + uintptr_t(h * ed)) & 15u) == 0)) {
      head = h;
      break;
    }
  int64_t vec_begin = b, nvec = 0;
  if (head >= 0 && a + head < b) {
    vec_begin = a + head;
    nvec = (b - vec_begin) / kVec;
  }
  const int64_t vec_end = vec_begin + nvec * kVec;
  for (int64_t i = a + threadIdx.x; i < (nvec ? vec_begin : b); i += blockDim.x) apply_scalar<OP>(s, i, scale, acc);
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) apply_vec<OP>(s, vec_begin + v * kVec, scale, acc);
  if (nvec)
    for (int64_t i = vec_end + threadIdx.x; i < b; i += blockDim.x) apply_scalar<OP>(s, i, scale, acc);
}

// The one element kernel per op. `partials` (reductions): one float per block;
// `flag`: set to 1 when a non-finite element is found (zeroed before the launch).
template <int OP>
__global__ void __launch_bounds__(kThreads)
megadlm_multi_tensor_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t total, float scale,
                            float* __restrict__ partials, int* flag) {
  Acc acc;
  for (int64_t begin = int64_t(blockIdx.x) * kChunk; begin < total; begin += int64_t(gridDim.x) * kChunk) {
    if (OP == kNonFinite && *reinterpret_cast<volatile int*>(flag)) break;  // block-uniform read
    const int64_t end = begin + kChunk < total ? begin + kChunk : total;
    for (int64_t i = find_segment(segs, nseg, begin); i < nseg && segs[i].start < end; ++i) {
      const Segment s = segs[i];
      const int64_t s1 = segment_end(segs, nseg, i, total);
      const int64_t lo = begin > s.start ? begin : s.start, hi = end < s1 ? end : s1;
      process<OP>(s, lo - s.start, hi - s.start, scale, acc);
    }
  }
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
