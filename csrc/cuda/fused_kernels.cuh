// Device code of the fused transformer ops (see fused.cu for the launch design): what one
// thread does in one row of a block-per-row kernel, for a vector width V = kVec (16-byte
// loads and stores: 8 elements, two loads for fp32) or V = 1 (scalar, any stride). A header
// so that a host emulation (tests/ext/fused_emu.cpp) runs exactly this code with blocks and
// threads as loops where no GPU exists; the block reductions between the phases of the
// norm kernels are the only CUDA-only parts (fused.cu). Include after megadlm/fused.h.
//
// Thread ownership: in every row a thread handles the vectors j = threadIdx.x, + blockDim.x,
// ...; the phases of a norm row touch the same elements from the same thread, so a thread
// re-reads what it wrote itself (no barrier needed) and owns the same weight-gradient columns
// in every row (no atomics).
#pragma once

namespace megadlm {
namespace cuda {
namespace fused_dev {

using fused::AddNormBwdParams;
using fused::AddNormFwdParams;
using fused::RopeParams;
using fused::SwigluParams;

// ---- launch plans (host code, shared by fused.cu and the emulation) ------------------------
constexpr int kMaxThreads = 256;
constexpr int64_t kMaxGrid = int64_t(1) << 16;  // rows beyond it are grid-strided
constexpr int kThreadsPerSm = 2048;             // resident threads per SM on sm_80 / sm_90

// Threads of a block whose row holds `vectors` thread-steps: a whole number of warps, at most
// kMaxThreads (more vectors loop).
inline int row_threads(int64_t vectors) {
  const int64_t t = (vectors + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > kMaxThreads ? kMaxThreads : t));
}

inline int64_t rows_grid(int64_t rows) {
  return rows < kMaxGrid ? rows : kMaxGrid;
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// 16-byte vectors need 8 consecutive pairs per step: unit stride along D, and every row start
// and the second half 16-byte aligned (x, the contiguous output, fp32 cos/sin).
inline bool rope_vectorizable(const RopeParams& p) {
  const int64_t es = dtype_size(p.dtype);
  bool vec = (p.D / 2) % kVec == 0 && p.xs[3] == 1 && p.cs[2] == 1 && p.ss[2] == 1 &&
             aligned16(p.x) && aligned16(p.out) && aligned16(p.cos) && aligned16(p.sin);
  for (int d = 0; d < 3; ++d) vec = vec && (p.xs[d] * es) % 16 == 0;
  for (int d = 0; d < 2; ++d) vec = vec && (p.cs[d] * 4) % 16 == 0 && (p.ss[d] * 4) % 16 == 0;
  return vec;
}

inline bool swiglu_vectorizable(const SwigluParams& p, bool forward) {
  return p.F % kVec == 0 && aligned16(p.in) && aligned16(p.out) && (forward || aligned16(p.grad));
}

// The norm kernels: the hidden size a whole number of vectors, every tensor 16-byte aligned.
inline bool norm_vectorizable(int64_t H, const void* const* ptrs, int n) {
  bool vec = H % kVec == 0;
  for (int i = 0; i < n; ++i) vec = vec && aligned16(ptrs[i]);
  return vec;
}

// Blocks of the RMSNorm backward: one resident wave, enough blocks in flight to saturate
// memory, few enough that the [P, H] partials stay a few MB and the second kernel is cheap.
inline int64_t add_rmsnorm_bwd_blocks(int64_t M, int64_t H, int sms) {
  const int threads = row_threads(H % kVec == 0 ? H / kVec : H);
  const int64_t wave = int64_t(sms > 0 ? sms : 1) * (kThreadsPerSm / threads);
  const int64_t p = M < wave ? M : wave;
  return p < 1 ? 1 : p;
}

// V elements of type S from element offset `off`, `stride` apart (V == kVec: stride 1, the
// address 16-byte aligned).
template <class S, int V>
__device__ __forceinline__ void load_v(const void* base, int64_t off, int64_t stride,
                                       float (&v)[V]) {
  if constexpr (V == kVec) {
    load8<S>(base, off, v);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = get<S>(base, off + k * stride);
  }
}

template <class S, int V>
__device__ __forceinline__ void store_v(void* base, int64_t off, const float (&v)[V]) {
  if constexpr (V == kVec) {
    store8<S>(base, off, v);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) put<S>(base, off + k, v[k]);
  }
}

// ---- rotary embedding: a block row is one position (b, s), every head and pair ------------
template <class S, int V>
__device__ void rope_position(const RopeParams& p, int64_t bs) {
  const int64_t b = bs / p.S, s = bs - b * p.S, half = p.D / 2;
  // 32-bit within a position (H * D / 2 < 2^31, checked by the bindings): cheap divisions.
  const int32_t per_head = int32_t(half / V), items = int32_t(p.H) * per_head;
  const int64_t x_row = b * p.xs[0] + s * p.xs[1], xd = p.xs[3];
  const int64_t c_row = b * p.cs[0] + s * p.cs[1], s_row = b * p.ss[0] + s * p.ss[1];
  for (int32_t t = int32_t(threadIdx.x); t < items; t += int32_t(blockDim.x)) {
    const int32_t h = t / per_head;
    const int64_t i = int64_t(t - h * per_head) * V;
    const int64_t xo = x_row + h * p.xs[2];
    float x1[V], x2[V], c1[V], c2[V], s1[V], s2[V], o1[V], o2[V];
    load_v<S, V>(p.x, xo + i * xd, xd, x1);
    load_v<S, V>(p.x, xo + (i + half) * xd, xd, x2);
    load_v<F32T, V>(p.cos, c_row + i * p.cs[2], p.cs[2], c1);
    load_v<F32T, V>(p.cos, c_row + (i + half) * p.cs[2], p.cs[2], c2);
    load_v<F32T, V>(p.sin, s_row + i * p.ss[2], p.ss[2], s1);
    load_v<F32T, V>(p.sin, s_row + (i + half) * p.ss[2], p.ss[2], s2);
#pragma unroll
    for (int k = 0; k < V; ++k)
      fused::rope_pair(x1[k], x2[k], c1[k], c2[k], s1[k], s2[k], p.backward != 0, &o1[k], &o2[k]);
    const int64_t oo = (bs * p.H + h) * p.D;
    store_v<S, V>(p.out, oo + i, o1);
    store_v<S, V>(p.out, oo + half + i, o2);
  }
}

template <class S, int V>
__device__ void rope_block(const RopeParams& p) {
  for (int64_t bs = blockIdx.x; bs < p.B * p.S; bs += gridDim.x) rope_position<S, V>(p, bs);
}

// ---- SwiGLU: a block row is one token's [gate | up] ------------------------------------------
template <class S, int V>
__device__ void swiglu_fwd_row(const SwigluParams& p, int64_t m) {
  const int64_t in = m * 2 * p.F, out = m * p.F;
  for (int64_t j = threadIdx.x * int64_t(V); j < p.F; j += int64_t(blockDim.x) * V) {
    float g[V], u[V], o[V];
    load_v<S, V>(p.in, in + j, 1, g);
    load_v<S, V>(p.in, in + p.F + j, 1, u);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = fused::swiglu_value(g[k], u[k]);
    store_v<S, V>(p.out, out + j, o);
  }
}

template <class S, int V>
__device__ void swiglu_bwd_row(const SwigluParams& p, int64_t m) {
  const int64_t in = m * 2 * p.F, go = m * p.F;
  for (int64_t j = threadIdx.x * int64_t(V); j < p.F; j += int64_t(blockDim.x) * V) {
    float g[V], u[V], d[V], dg[V], du[V];
    load_v<S, V>(p.in, in + j, 1, g);
    load_v<S, V>(p.in, in + p.F + j, 1, u);
    load_v<S, V>(p.grad, go + j, 1, d);
#pragma unroll
    for (int k = 0; k < V; ++k) fused::swiglu_grads(g[k], u[k], d[k], &dg[k], &du[k]);
    store_v<S, V>(p.out, in + j, dg);
    store_v<S, V>(p.out, in + p.F + j, du);
  }
}

template <class S, int V, bool kForward>
__device__ void swiglu_block(const SwigluParams& p) {
  for (int64_t m = blockIdx.x; m < p.M; m += gridDim.x) {
    if constexpr (kForward)
      swiglu_fwd_row<S, V>(p, m);
    else
      swiglu_bwd_row<S, V>(p, m);
  }
}

// ---- residual add + RMSNorm, forward -------------------------------------------------------
// Phase 1 of row m: sum = round(x + h), stored; returns this thread's sum of squares (of the
// stored, rounded values: what the unfused norm reads).
template <class S, int V>
__device__ float add_norm_fwd_sum(const AddNormFwdParams& p, int64_t m) {
  const int64_t row = m * p.H;
  float acc = 0.f;
  for (int64_t j = threadIdx.x * int64_t(V); j < p.H; j += int64_t(blockDim.x) * V) {
    float x[V], h[V];
    load_v<S, V>(p.x, row + j, 1, x);
    load_v<S, V>(p.h, row + j, 1, h);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      x[k] = fused::round_to<S>(x[k] + h[k]);
      acc += x[k] * x[k];
    }
    store_v<S, V>(p.sum, row + j, x);
  }
  return acc;
}

// Phase 2 of row m with the row's total sum of squares: y = sum * rstd * w (this thread's own
// elements of `sum`, written in phase 1).
template <class S, int V>
__device__ void add_norm_fwd_out(const AddNormFwdParams& p, int64_t m, float sum_sq) {
  const float r = fused::rms_rstd(sum_sq, p.H, p.eps);
  if (threadIdx.x == 0) p.rstd[m] = r;
  const int64_t row = m * p.H;
  for (int64_t j = threadIdx.x * int64_t(V); j < p.H; j += int64_t(blockDim.x) * V) {
    float s[V], w[V];
    load_v<S, V>(p.sum, row + j, 1, s);
    load_v<S, V>(p.w, j, 1, w);
#pragma unroll
    for (int k = 0; k < V; ++k) s[k] = s[k] * r * w[k];
    store_v<S, V>(p.y, row + j, s);
  }
}

// ---- residual add + RMSNorm, backward ------------------------------------------------------
// Phase 1 of row m: this thread's part of sum_j (grad_y * w)_j * n_j, n = sum * rstd.
template <class S, int V>
__device__ float add_norm_bwd_dot(const AddNormBwdParams& p, int64_t m) {
  const int64_t row = m * p.H;
  const float r = p.rstd[m];
  float acc = 0.f;
  for (int64_t j = threadIdx.x * int64_t(V); j < p.H; j += int64_t(blockDim.x) * V) {
    float s[V], gy[V], w[V];
    load_v<S, V>(p.sum, row + j, 1, s);
    load_v<S, V>(p.grad_y, row + j, 1, gy);
    load_v<S, V>(p.w, j, 1, w);
#pragma unroll
    for (int k = 0; k < V; ++k) acc += gy[k] * w[k] * (s[k] * r);
  }
  return acc;
}

// Index of weight column j + k (j a multiple of V) in a block's fp32 accumulator: element k of
// every thread's vector is contiguous over the threads, so the accesses of a warp hit distinct
// shared-memory banks.
__device__ __forceinline__ int64_t dw_slot(int64_t j, int k, int V, int64_t H) {
  return V == 1 ? j : int64_t(k) * (H / V) + j / V;
}

template <int V>
__device__ void add_norm_dw_zero(float* dw, int64_t H) {
  for (int64_t j = threadIdx.x * int64_t(V); j < H; j += int64_t(blockDim.x) * V)
    for (int k = 0; k < V; ++k) dw[dw_slot(j, k, V, H)] = 0.f;
}

// Phase 2 of row m with the row's total dot: grad_x = grad_sum + r * (gn - n * dot / H); adds
// grad_y * n into this thread's columns of `dw`.
template <class S, int V>
__device__ void add_norm_bwd_out(const AddNormBwdParams& p, int64_t m, float dot, float* dw) {
  const int64_t row = m * p.H;
  const float r = p.rstd[m], mean_dot = dot / float(p.H);
  for (int64_t j = threadIdx.x * int64_t(V); j < p.H; j += int64_t(blockDim.x) * V) {
    float s[V], gy[V], gs[V], w[V], gx[V];
    load_v<S, V>(p.sum, row + j, 1, s);
    load_v<S, V>(p.grad_y, row + j, 1, gy);
    load_v<S, V>(p.grad_sum, row + j, 1, gs);
    load_v<S, V>(p.w, j, 1, w);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float n = s[k] * r;
      gx[k] = fused::rms_grad_input(gs[k], gy[k] * w[k], n, r, mean_dot);
      dw[dw_slot(j, k, V, p.H)] += gy[k] * n;
    }
    store_v<S, V>(p.grad_x, row + j, gx);
  }
}

// This block's accumulator into its row of the [P, H] partials.
template <int V>
__device__ void add_norm_dw_store(const AddNormBwdParams& p, const float* dw) {
  float* out = p.partial + int64_t(blockIdx.x) * p.H;
  for (int64_t j = threadIdx.x * int64_t(V); j < p.H; j += int64_t(blockDim.x) * V)
    for (int k = 0; k < V; ++k) out[j + k] = dw[dw_slot(j, k, V, p.H)];
}

// The second, small kernel: weight column c = the P block partials summed in block order
// (deterministic), rounded once into w's dtype.
template <class S>
__device__ void add_norm_dw_column(const AddNormBwdParams& p, int64_t blocks, int64_t c) {
  float t = 0.f;
  for (int64_t b = 0; b < blocks; ++b) t += p.partial[b * p.H + c];
  put<S>(p.grad_w, c, t);
}

}  // namespace fused_dev
}  // namespace cuda
}  // namespace megadlm
