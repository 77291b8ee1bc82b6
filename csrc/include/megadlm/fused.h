// megadlm/fused.h -- the transformer's fused elementwise ops, shared by the CPU kernels
// (csrc/cpu/fused_cpu.cpp), the CUDA device code (csrc/cuda/fused_kernels.cuh) and the
// bindings (csrc/fused_bindings.cpp): the parameter structs the bindings fill, the
// launchers, and the per-element math, written once as __host__ __device__ functions so
// that the CPU kernels, the GPU kernels and the host emulation of the GPU code
// (tests/ext/fused_emu.cpp) compute the same expressions. Torch-free and CUDA-free.
//
//   rope:        out = x * cos + rotate_half(x) * sin per pair (i, i + D/2), or its transpose
//                (the gradient: the inverse rotation when cos/sin repeat their halves)
//   swiglu:      out = silu(gate) * up of [gate | up]; backward: d[gate | up] in one pass
//   add_rmsnorm: sum = x + h (rounded to the dtype), y = sum * rstd * w,
//                rstd = 1 / sqrt(mean(sum^2) + eps); backward: the grads of x (= of h) and w
// All math in fp32; one rounding into the output dtype.
#pragma once

#include <cmath>
#include <cstdint>

#include "megadlm/multi_tensor.h"

namespace megadlm {
namespace fused {

// ---- parameters (element offsets and strides, not bytes) -----------------------------------
struct RopeParams {
  const void* x;     // [B, S, H, D] of `dtype`, strides xs (any; the vector path needs xs[3] == 1)
  void* out;         // [B, S, H, D] contiguous, `dtype`
  const float* cos;  // fp32, indexed [b, s, d] with strides cs (cs[0] == 0 broadcasts over B)
  const float* sin;  // fp32, strides ss
  int64_t B, S, H, D;
  int64_t xs[4];
  int64_t cs[3], ss[3];
  int32_t dtype;     // DType of x and out
  int32_t backward;  // 0: the rotation; 1: its transpose (the gradient of the rotation)
};

struct SwigluParams {
  const void* in;    // [M, 2F] contiguous: [gate | up] per row
  const void* grad;  // backward: the gradient of out, [M, F] contiguous; forward: unused
  void* out;         // forward: [M, F]; backward: the gradient of in, [M, 2F]
  int64_t M, F;
  int32_t dtype;
};

struct AddNormFwdParams {
  const void* x;  // [M, H] contiguous, `dtype`
  const void* h;  // [M, H] contiguous, `dtype`
  const void* w;  // [H], `dtype`
  void* sum;      // out: x + h, [M, H]
  void* y;        // out: rmsnorm(sum) * w, [M, H]
  float* rstd;    // out: [M] fp32
  int64_t M, H;
  float eps;
  int32_t dtype;
};

struct AddNormBwdParams {
  const void* grad_sum;  // [M, H]: gradient of the `sum` output
  const void* grad_y;    // [M, H]: gradient of the `y` output
  const void* sum;       // [M, H]: the saved `sum` output
  const void* w;         // [H]
  const float* rstd;     // [M]
  void* grad_x;          // out: [M, H], the gradient of x and of h (sum = x + h)
  float* partial;        // [P, H] fp32: per-block sums of grad_y * normalised over its rows
  void* grad_w;          // out: [H], the sum of the P partials
  int64_t M, H;
  int32_t dtype;
};

// ---- per-element math ------------------------------------------------------------------------
// One rotate-half pair (x1 = x[i], x2 = x[i + D/2]) with c1 = cos[i], c2 = cos[i + D/2] (and
// s1, s2 of sin). Forward: x * cos + [-x2, x1] * sin. Backward: the transpose of that linear
// map applied to the incoming gradient (x1, x2) -- no cat, no neg.
MEGADLM_HD void rope_pair(float x1, float x2, float c1, float c2, float s1, float s2, bool backward,
                          float* o1, float* o2) {
  if (!backward) {
    *o1 = x1 * c1 - x2 * s1;
    *o2 = x2 * c2 + x1 * s2;
  } else {
    *o1 = x1 * c1 + x2 * s2;
    *o2 = x2 * c2 - x1 * s1;
  }
}

// silu(g) = g / (1 + exp(-g)), torch's own expression (CPU and CUDA).
MEGADLM_HD float silu(float g) {
  return g / (1.0f + expf(-g));
}

// silu(gate) * up.
MEGADLM_HD float swiglu_value(float gate, float up) {
  return silu(gate) * up;
}

// Gradients of silu(gate) * up given d = d out: silu is recomputed from gate (nothing else is
// saved). silu'(g) = sig(g) * (1 + g * (1 - sig(g))), torch's silu_backward.
MEGADLM_HD void swiglu_grads(float gate, float up, float d, float* d_gate, float* d_up) {
  const float sig = 1.0f / (1.0f + expf(-gate));
  *d_up = d * silu(gate);
  *d_gate = d * up * (sig * (1.0f + gate * (1.0f - sig)));
}

// 1 / sqrt(mean of squares + eps) of a row of `n` elements whose squares sum to `sum_sq`.
MEGADLM_HD float rms_rstd(float sum_sq, int64_t n, float eps) {
  return 1.0f / sqrtf(sum_sq / float(n) + eps);
}

// Gradient of x (and h) at one element of an add+RMSNorm row: the residual's own gradient
// plus the norm's, r * (g_n - n * mean(g_n * n)) with g_n = grad_y * w and n = sum * r.
MEGADLM_HD float rms_grad_input(float grad_sum, float gn, float n, float r, float mean_dot) {
  return grad_sum + r * (gn - n * mean_dot);
}

// fp32 -> the dtype S -> fp32: the value the stored `sum` has (the norm reads what is stored,
// as the unfused x + h followed by a norm does).
template <class S>
MEGADLM_HD float round_to(float v) {
  if constexpr (S::kCode == kF32)
    return v;
  else if constexpr (S::kCode == kBF16)
    return bf16_to_float(float_to_bf16(v));
  else
    return fp16_to_float(float_to_fp16(v));
}

// ---- launchers ---------------------------------------------------------------------------
namespace cpu {
// On the calling thread's OpenMP team (torch's intra-op threads). The weight gradient of
// add_rmsnorm_bwd sums per-block partials of a fixed number of rows in block order (the
// result does not depend on the thread count); `partial` may be null there.
void rope(const RopeParams& p);
void swiglu_fwd(const SwigluParams& p);
void swiglu_bwd(const SwigluParams& p);
void add_rmsnorm_fwd(const AddNormFwdParams& p);
void add_rmsnorm_bwd(const AddNormBwdParams& p);
}  // namespace cpu

namespace cuda {
// On `stream` (a cudaStream_t); `sms` is the device's multiprocessor count. Raw pointers
// into device memory; the vector paths are taken where sizes and alignment allow (see
// csrc/cuda/fused.cu). Throws std::runtime_error naming the op on a launch failure.
void rope(const RopeParams& p, void* stream);
void swiglu_fwd(const SwigluParams& p, void* stream);
void swiglu_bwd(const SwigluParams& p, void* stream);
void add_rmsnorm_fwd(const AddNormFwdParams& p, void* stream);
// `partial` must hold add_rmsnorm_bwd_blocks(M, H, sms) * H floats.
void add_rmsnorm_bwd(const AddNormBwdParams& p, int sms, void* stream);
int64_t add_rmsnorm_bwd_blocks(int64_t M, int64_t H, int sms);
}  // namespace cuda

}  // namespace fused
}  // namespace megadlm
