// Device code of the multi-tensor kernels (see multi_tensor.cu for the design):
// element functors, the per-segment block loop and the per-block range walk. A header
// so that a host emulation (tests/ext/cuda_emu.cpp) can run exactly this code on CPU
// threads-as-loops where no GPU exists. Include after megadlm/multi_tensor.h.
#pragma once

namespace megadlm {
namespace cuda {

constexpr int kThreads = 256;
constexpr int64_t kChunk = int64_t(kThreads) * kVec * 4;  // elements per chunk

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
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) apply_vec<OP>(s, vec_begin + v * kVec, scale, acc);
  if (nvec)
    for (int64_t i = vec_end + threadIdx.x; i < b; i += blockDim.x) apply_scalar<OP>(s, i, scale, acc);
}

// One thread's share of the work of block blockIdx.x: the block takes a contiguous run
// of chunks of the global range (one binary search per block, then the segments in
// order); within a segment the block's threads split the elements.
template <int OP>
__device__ void block_range(const Segment* __restrict__ segs, int64_t nseg, int64_t total, float scale,
                            const int* flag, Acc& acc) {
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  const int64_t per_block = (chunks + gridDim.x - 1) / gridDim.x;
  const int64_t begin = int64_t(blockIdx.x) * per_block * kChunk;
  const int64_t end = begin + per_block * kChunk < total ? begin + per_block * kChunk : total;
  if (begin >= end) return;
  for (int64_t i = find_segment(segs, nseg, begin); i < nseg && segs[i].start < end; ++i) {
    if (OP == kNonFinite && *reinterpret_cast<const volatile int*>(flag)) return;  // found elsewhere
    const Segment s = segs[i];
    const int64_t s1 = segment_end(segs, nseg, i, total);
    const int64_t lo = begin > s.start ? begin : s.start, hi = end < s1 ? end : s1;
    process<OP>(s, lo - s.start, hi - s.start, scale, acc);
  }
}

}  // namespace cuda
}  // namespace megadlm
