// Device code of the fused AdamW step (see adam.cu): the 8-element vector path, the
// per-tensor alignment head and the block's walk over the AdamTensor table. A header so
// that the host emulation (tests/ext/adam_emu.cpp) runs exactly this code on CPU
// threads-as-loops. The walk, the chunking and the 16-byte load/store helpers are the
// multi-tensor kernels' own (multi_tensor_kernels.cuh, megadlm/multi_tensor.h).
#pragma once

#include "megadlm/adam.h"
#include "multi_tensor_kernels.cuh"

namespace megadlm {
namespace cuda {

// Whether element i of a tensor of `es`-byte elements at `base` starts a 16-byte line.
MEGADLM_HD bool aligned16(const void* base, int64_t i, int es) {
  return ((reinterpret_cast<uintptr_t>(base) + uintptr_t(i * es)) & 15u) == 0;
}

// Whether every stream of tensor t is 16-byte aligned at element i (vector path allowed).
template <class G, class M, class V, class P>
MEGADLM_HD bool adam_aligned(const AdamTensor& t, int64_t i) {
  bool ok = aligned16(t.param, i, 4) && aligned16(t.grad, i, sizeof(typename G::T)) &&
            aligned16(t.exp_avg, i, sizeof(typename M::T)) &&
            aligned16(t.exp_avg_sq, i, sizeof(typename V::T));
  if constexpr (P::kCode != kNoModelParam) ok = ok && aligned16(t.model_param, i, 2);
  return ok;
}

// Elements from segment-local index a to skip before every stream of t is 16-byte aligned
// (0..7), or -1 when their relative alignment never lines up.
template <class G, class M, class V, class P>
MEGADLM_HD int adam_head(const AdamTensor& t, int64_t a) {
  for (int h = 0; h < kVec; ++h)
    if (adam_aligned<G, M, V, P>(t, a + h)) return h;
  return -1;
}

// Elements i .. i + 7 of tensor t, every stream 16-byte aligned there: all loads (2 x 16
// bytes per fp32 stream, 1 per 16-bit stream) are issued before the math, the math is
// adam_update per element, then the stores.
template <class G, class M, class V, class P>
__device__ __forceinline__ void adam_vec(const AdamTensor& t, int64_t i, const AdamScalars& s) {
  float p[kVec], g[kVec], m[kVec], v[kVec];
  load8<F32T>(t.param, i, p);
  load8<G>(t.grad, i, g);
  load8<M>(t.exp_avg, i, m);
  load8<V>(t.exp_avg_sq, i, v);
#pragma unroll
  for (int k = 0; k < kVec; ++k) adam_update(p[k], g[k], m[k], v[k], s);
  store8<F32T>(t.param, i, p);
  store8<M>(t.exp_avg, i, m);
  store8<V>(t.exp_avg_sq, i, v);
  if constexpr (P::kCode != kNoModelParam) store8<P>(t.model_param, i, p);
}

// Elements [a, b) of tensor t, by the whole block: a scalar head up to the first element
// where every stream is 16-byte aligned, 8-element vectors (thread k takes vectors k,
// k + blockDim, ...: each warp reads contiguous lines), a scalar tail. Streams whose
// relative alignment never lines up take the scalar path throughout.
template <class G, class M, class V, class P>
__device__ void adam_process(const AdamTensor& t, int64_t a, int64_t b, const AdamScalars& s) {
  const int head = adam_head<G, M, V, P>(t, a);
  int64_t vec_begin = b, nvec = 0;
  if (head >= 0 && a + head < b) {
    vec_begin = a + head;
    nvec = (b - vec_begin) / kVec;
  }
  const int64_t tid = threadIdx.x, bd = blockDim.x;
  for (int64_t i = a + tid; i < (nvec ? vec_begin : b); i += bd) adam_element<G, M, V, P>(t, i, s);
  for (int64_t k = tid; k < nvec; k += bd) adam_vec<G, M, V, P>(t, vec_begin + k * kVec, s);
  if (nvec)
    for (int64_t i = vec_begin + nvec * kVec + tid; i < b; i += bd)
      adam_element<G, M, V, P>(t, i, s);
}

// One thread's share of block blockIdx.x's work: the block's even share of the chunks of
// the global range, walked over the tensors it covers.
template <class G, class M, class V, class P>
__device__ void adam_block_range(const AdamTensor* __restrict__ table, int64_t n, int64_t total,
                                 const AdamScalars& s) {
  walk_block_range(table, n, total, [&](const AdamTensor& t, int64_t a, int64_t b) {
    adam_process<G, M, V, P>(t, a, b, s);
    return true;
  });
}

}  // namespace cuda
}  // namespace megadlm
