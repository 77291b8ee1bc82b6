// Device code of the multi-tensor kernels (see multi_tensor.cu for the design):
// element functors templated on the (source, destination) types, the per-segment
// block loop and the per-block range walk, plus the even split of chunks over blocks.
// A header so that a host emulation (tests/ext/cuda_emu.cpp) can run exactly this
// code on CPU threads-as-loops where no GPU exists. Include after megadlm/multi_tensor.h.
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

// Chunks [*c0, *c1) of block b when `chunks` chunks are split over `grid` blocks as
// evenly as possible: every block gets q or q + 1 (never a ceil-division tail of idle
// blocks).
MEGADLM_HD void block_chunks(int64_t chunks, int64_t grid, int64_t b, int64_t* c0, int64_t* c1) {
  const int64_t q = chunks / grid, r = chunks % grid;
  *c0 = b * q + (b < r ? b : r);
  *c1 = *c0 + q + (b < r ? 1 : 0);
}

// Blocks of a launch: one resident wave (occupancy x SMs), never more blocks than
// chunks, at least one, at most `cap`.
inline int grid_size(int64_t chunks, int blocks_per_sm, int sms, int64_t cap) {
  int64_t g = int64_t(blocks_per_sm > 0 ? blocks_per_sm : 1) * int64_t(sms > 0 ? sms : 1);
  if (g > cap) g = cap;
  if (g > chunks) g = chunks;
  return int(g < 1 ? 1 : g);
}

// Calls f(S{}, D{}) with the kernel types `run` launches for `op` and a list whose
// uniform_pair() is `pair` (the host emulation selects kernels through this too).
template <int OP, class F>
inline void with_kernel_types(int32_t pair, F&& f) {
  if constexpr (OP == kCopy || OP == kAccumulate)
    with_pair(pair, f);
  else
    with_src(pair, [&](auto s) { f(s, s); });
}

template <int OP, class S, class D>
__device__ __forceinline__ void apply_scalar(const Segment& s, int64_t i, float scale, Acc& acc) {
  const float x = get<S>(s.src, i);
  if constexpr (OP == kSumSquares) {
    acc.sum = fmaf(x, x, acc.sum);
  } else if constexpr (OP == kNonFinite) {
    acc.bad |= !isfinite(x);
  } else if constexpr (OP == kAccumulate) {
    // mul then add, two roundings: bitwise the CPU kernels and the reference route
    put<D>(s.dst, i, __fadd_rn(get<D>(s.dst, i), __fmul_rn(x, scale)));
  } else {
    put<D>(s.dst, i, __fmul_rn(x, scale));
  }
}

// U vectors of 8 elements at vec_begin + (v + u * stride) * kVec: all U loads are issued
// before the first store, so each thread keeps U (x2 for fp32) 16-byte loads in flight.
template <int OP, class S, class D, int U>
__device__ __forceinline__ void apply_vecs(const Segment& s, int64_t first, int64_t stride,
                                           float scale, Acc& acc) {
  float v[U][kVec];
#pragma unroll
  for (int u = 0; u < U; ++u) load8<S>(s.src, first + u * stride, v[u]);
  if constexpr (OP == kSumSquares || OP == kNonFinite) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if constexpr (OP == kSumSquares)
          acc.sum = fmaf(v[u][k], v[u][k], acc.sum);
        else
          acc.bad |= !isfinite(v[u][k]);
      }
  } else {
    if constexpr (OP == kAccumulate) {
      float d[U][kVec];
#pragma unroll
      for (int u = 0; u < U; ++u) load8<D>(s.dst, first + u * stride, d[u]);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[u][k] = __fadd_rn(d[u][k], __fmul_rn(v[u][k], scale));
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[u][k] = __fmul_rn(v[u][k], scale);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) store8<D>(s.dst, first + u * stride, v[u]);
  }
}

// Same-type unscaled copy: raw 16-byte moves, U vectors in flight per thread.
template <class S, int U>
__device__ __forceinline__ void copy_raw(const Segment& s, int64_t first, int64_t stride) {
  constexpr int es = sizeof(typename S::T), kWords = es * kVec / 16;  // uint4 per vector: 2 or 1
  uint4 r[U][kWords];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint4* src =
        reinterpret_cast<const uint4*>(static_cast<const char*>(s.src) + (first + u * stride) * es);
#pragma unroll
    for (int w = 0; w < kWords; ++w) r[u][w] = src[w];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    uint4* dst = reinterpret_cast<uint4*>(static_cast<char*>(s.dst) + (first + u * stride) * es);
#pragma unroll
    for (int w = 0; w < kWords; ++w) dst[w] = r[u][w];
  }
}

// Elements [a, b) of segment s (types S -> D), by the whole block.
template <int OP, class S, class D>
__device__ void process(const Segment& s, int64_t a, int64_t b, float scale, Acc& acc) {
  constexpr int es = sizeof(typename S::T), ed = sizeof(typename D::T);
  constexpr bool reads_only = OP == kSumSquares || OP == kNonFinite;
  constexpr int U = OP == kAccumulate ? 2 : 4;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(s.src) + uintptr_t(a * es);
  const uintptr_t da = reinterpret_cast<uintptr_t>(s.dst) + uintptr_t(a * ed);
  int head = -1;  // elements before both pointers are 16-byte aligned; -1: never
  for (int h = 0; h < kVec; ++h)
    if (((sa + uintptr_t(h * es)) & 15u) == 0 &&
        (reads_only || ((da + uintptr_t(h * ed)) & 15u) == 0)) {
      head = h;
      break;
    }
  int64_t vec_begin = b, nvec = 0;
  if (head >= 0 && a + head < b) {
    vec_begin = a + head;
    nvec = (b - vec_begin) / kVec;
  }
  const int64_t vec_end = vec_begin + nvec * kVec;
  const int64_t t = threadIdx.x, bd = blockDim.x;
  for (int64_t i = a + t; i < (nvec ? vec_begin : b); i += bd)
    apply_scalar<OP, S, D>(s, i, scale, acc);
  // Vector v covers elements vec_begin + v * kVec ...; thread t takes v = t, t + bd, ...
  // U at a time while a full group fits, then one at a time.
  int64_t v = t;
  const bool raw = OP == kCopy && S::kCode == D::kCode && scale == 1.0f;
  for (; v + (U - 1) * bd < nvec; v += U * bd) {
    if (raw)
      copy_raw<S, U>(s, vec_begin + v * kVec, bd * kVec);
    else
      apply_vecs<OP, S, D, U>(s, vec_begin + v * kVec, bd * kVec, scale, acc);
  }
  for (; v < nvec; v += bd) {
    if (raw)
      copy_raw<S, 1>(s, vec_begin + v * kVec, bd * kVec);
    else
      apply_vecs<OP, S, D, 1>(s, vec_begin + v * kVec, bd * kVec, scale, acc);
  }
  if (nvec)
    for (int64_t i = vec_end + t; i < b; i += bd) apply_scalar<OP, S, D>(s, i, scale, acc);
}

// Segment s, elements [a, b): typed call, or (MixedT) one dtype dispatch per segment.
template <int OP, class S, class D>
__device__ __forceinline__ void process_any(const Segment& s, int64_t a, int64_t b, float scale,
                                            Acc& acc) {
  if constexpr (S::kCode == kMixedPair) {
    if constexpr (OP == kCopy || OP == kAccumulate) {
      dev_with_pair(s.src_dtype, s.dst_dtype, [&](auto st, auto dt) {
        process<OP, decltype(st), decltype(dt)>(s, a, b, scale, acc);
      });
    } else {
      dev_with_type(s.src_dtype,
                    [&](auto st) { process<OP, decltype(st), decltype(st)>(s, a, b, scale, acc); });
    }
  } else {
    process<OP, S, D>(s, a, b, scale, acc);
  }
}

// The segment walk of block blockIdx.x: the block takes its even share of chunks of the
// global range (one binary search per block, then the segments in order) and calls
// f(segment, a, b) for the segment-local element range [a, b) of each segment it covers;
// f returns false to stop the walk. Any table row with an int64_t `start` (Segment, or the
// fused AdamW step's AdamTensor, adam_kernels.cuh).
template <class Seg, class F>
__device__ __forceinline__ void walk_block_range(const Seg* __restrict__ segs, int64_t nseg,
                                                 int64_t total, F&& f) {
  int64_t c0, c1;
  block_chunks((total + kChunk - 1) / kChunk, gridDim.x, blockIdx.x, &c0, &c1);
  const int64_t begin = c0 * kChunk;
  const int64_t end = c1 * kChunk < total ? c1 * kChunk : total;
  if (begin >= end) return;
  for (int64_t i = find_segment(segs, nseg, begin); i < nseg && segs[i].start < end; ++i) {
    const Seg s = segs[i];
    const int64_t s1 = segment_end(segs, nseg, i, total);
    const int64_t lo = begin > s.start ? begin : s.start, hi = end < s1 ? end : s1;
    if (!f(s, lo - s.start, hi - s.start)) return;
  }
}

// One thread's share of the work of block blockIdx.x (within a segment the block's
// threads split the elements).
template <int OP, class S, class D>
__device__ void block_range(const Segment* __restrict__ segs, int64_t nseg, int64_t total,
                            float scale, const int* flag, Acc& acc) {
  walk_block_range(segs, nseg, total, [&](const Segment& s, int64_t a, int64_t b) {
    if (OP == kNonFinite && *reinterpret_cast<const volatile int*>(flag))
      return false;  // found elsewhere
    process_any<OP, S, D>(s, a, b, scale, acc);
    return true;
  });
}

}  // namespace cuda
}  // namespace megadlm
