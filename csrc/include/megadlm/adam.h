// megadlm/adam.h -- the fused multi-tensor AdamW step (megadlm_ext.adamw_step): its table
// row, its scalars, the per-element math (host and device) and the launcher API.
// Torch-free like megadlm/multi_tensor.h, so the CPU kernel, the CUDA kernels and the host
// emulation of the device code (tests/ext/adam_emu.cpp) all compile exactly this math.
//
// One step of torch's AdamW (decoupled weight decay) per element, in fp32 registers:
//   p = p * (1 - lr*wd)
//   m = beta1*m + (1-beta1)*g            v = beta2*v + ((1-beta2)*g)*g
//   p = p - (lr/bc1 * m) / (sqrt(v) * (1/sqrt(bc2)) + eps)     bc_i = 1 - beta_i^step
// every operation rounded once to fp32 (no FMA contraction: the CPU kernel, the CUDA
// kernel and the reference route's torch expressions are bitwise equal; the bias correction
// of v is a multiplication by a reciprocal computed once, because torch's CUDA division by a
// scalar is one too, so the reference route would not match a division). The parameter is
// updated from the UNROUNDED new moments; the moments are stored rounded to their dtypes
// only after (TE's order, which PrecisionAwareAdamW documents).
#pragma once

#include <cmath>
#include <cstdint>

#include "megadlm/multi_tensor.h"

namespace megadlm {

// One tensor of the step: raw pointers to its five streams and its element range in the
// concatenation of the list (`start`, as Segment::start; empty tensors are dropped by the
// bindings). 64 bytes, trivially copyable: the CUDA glue uploads the table through the
// device-table cache, which stores tables as rows of sizeof(Segment) bytes.
struct AdamTensor {
  float* param;       // fp32 main param, read and written
  const void* grad;   // fp32 or bf16
  void* exp_avg;      // fp32, bf16 or fp16 (stored unscaled)
  void* exp_avg_sq;   // fp32, bf16 or fp16 (stored unscaled)
  void* model_param;  // bf16 / fp16 copy written from the new param, or nullptr
  int64_t start;      // global index of this tensor's first element
  int64_t numel;      // elements (informational: the walk uses the next row's start)
  int64_t reserved;   // zero: pads the row to two Segment rows
};
static_assert(sizeof(AdamTensor) == 2 * sizeof(Segment),
              "AdamTensor rows travel through the Segment-row device-table cache");

// The storage dtypes of one launch (one per list: the bindings refuse mixed lists).
constexpr int32_t kNoModelParam = -1;
struct AdamDTypes {
  int32_t grad;         // kF32 / kBF16
  int32_t exp_avg;      // kF32 / kBF16 / kF16
  int32_t exp_avg_sq;   // kF32 / kBF16 / kF16
  int32_t model_param;  // kBF16 / kF16, or kNoModelParam
};

// The fp32 scalars of one step, computed once per call on the host in double and rounded
// to fp32 (adam_scalars; the reference route computes the same doubles the same way).
struct AdamScalars {
  float decay;  // 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;       // lr / (1 - beta1^step)
  float inv_bias2_sqrt;  // 1 / sqrt(1 - beta2^step)
  float eps;
};

inline AdamScalars adam_scalars(double lr, double beta1, double beta2, double eps,
                                double weight_decay, int64_t step) {
  const double bc1 = 1.0 - std::pow(beta1, double(step));
  const double bc2 = 1.0 - std::pow(beta2, double(step));
  AdamScalars s;
  s.decay = float(1.0 - lr * weight_decay);
  s.beta1 = float(beta1);
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.step_size = float(lr / bc1);
  s.inv_bias2_sqrt = float(1.0 / std::sqrt(bc2));
  s.eps = float(eps);
  return s;
}

// Correctly rounded fp32 operations that the compiler may not fuse: the device intrinsics
// on the GPU; plain operators on the host, whose files turn FMA contraction off.
MEGADLM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MEGADLM_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MEGADLM_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
MEGADLM_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MEGADLM_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// The step of one element (see the top of this file); p, m, v in and out, all fp32.
MEGADLM_HD void adam_update(float& p, float g, float& m, float& v, const AdamScalars& s) {
  p = mul_rn(p, s.decay);
  m = add_rn(mul_rn(m, s.beta1), mul_rn(g, s.one_minus_beta1));
  v = add_rn(mul_rn(v, s.beta2), mul_rn(mul_rn(g, s.one_minus_beta2), g));
  const float denom = add_rn(mul_rn(sqrt_rn(v), s.inv_bias2_sqrt), s.eps);
  p = sub_rn(p, div_rn(mul_rn(m, s.step_size), denom));
}

// "No model-param copy" as a template parameter of the typed kernels.
struct NoModelT {
  using T = uint16_t;
  static constexpr int32_t kCode = kNoModelParam;
};

// Element i of tensor t, one element at a time (the CPU kernel; the CUDA kernel's scalar
// heads and tails). G, M, V, P: the storage types of the grad, the moments and the model
// param (NoModelT: none).
template <class G, class M, class V, class P>
MEGADLM_HD void adam_element(const AdamTensor& t, int64_t i, const AdamScalars& s) {
  float p = t.param[i], m = get<M>(t.exp_avg, i), v = get<V>(t.exp_avg_sq, i);
  adam_update(p, get<G>(t.grad, i), m, v, s);
  t.param[i] = p;
  put<M>(t.exp_avg, i, m);  // rounded only now: the update used the unrounded moments
  put<V>(t.exp_avg_sq, i, v);
  if constexpr (P::kCode != kNoModelParam) put<P>(t.model_param, i, p);
}

// f(G{}, M{}, V{}, P{}) for the dtypes of a launch (host: the launchers and the emulation
// pick the typed kernel through this, once per call). Only the combinations the bindings
// accept are instantiated: grads fp32 / bf16, moments any, model params bf16 / fp16 / none.
template <class F>
inline void with_adam_types(const AdamDTypes& d, F&& f) {
  auto with_model = [&](auto g, auto m, auto v) {
    if (d.model_param == kBF16)
      f(g, m, v, BF16T{});
    else if (d.model_param == kF16)
      f(g, m, v, F16T{});
    else
      f(g, m, v, NoModelT{});
  };
  auto with_moments = [&](auto g) {
    with_type(d.exp_avg,
              [&](auto m) { with_type(d.exp_avg_sq, [&](auto v) { with_model(g, m, v); }); });
  };
  if (d.grad == kBF16)
    with_moments(BF16T{});
  else
    with_moments(F32T{});
}

namespace cpu {
// The step over all `total` elements of the table on the calling thread's OpenMP team
// (blocks of the global range spread over threads, as cpu::run does).
void adam_run(const AdamTensor* table, int64_t n, int64_t total, const AdamDTypes& dtypes,
              const AdamScalars& s);
}  // namespace cpu

namespace cuda {
// One launch of the typed step kernel on `stream` (a cudaStream_t); `d_table` is the
// table in device memory. Throws std::runtime_error on a launch failure (and, before
// launching, on an error left pending by earlier work, so it is not blamed on the step).
void adam_run(const AdamTensor* d_table, int64_t n, int64_t total, const AdamDTypes& dtypes,
              const AdamScalars& s, void* stream);
}  // namespace cuda

}  // namespace megadlm
