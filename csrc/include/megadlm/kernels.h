// megadlm/kernels.h -- launcher API between the bindings (torch-facing) and the kernels
// (torch-free: raw pointers, and a cudaStream_t passed as void* so this header needs no
// CUDA headers either).
#pragma once

#include <cstdint>
#include <string>

#include "megadlm/multi_tensor.h"

namespace megadlm {

// Result of one CPU pass: the fp32-accumulated sum of squares (combined across blocks
// in double, in a fixed order, so the result does not depend on the thread count) or
// whether a non-finite element was seen.
struct CpuResult {
  double sum_squares = 0.0;
  bool nonfinite = false;
};

namespace cpu {
// Run `op` over all `total` elements of the segment table on the calling thread's
// OpenMP team (torch's intra-op threads: torch.set_num_threads applies). Blocks of the
// global element range are spread over threads; no allocation after the first call
// of a given size (the per-block partials live in a reused thread-local arena).
CpuResult run(OpKind op, const Segment* segs, int64_t nseg, int64_t total, float scale);

// Which vector path `run` uses on this machine: "avx2+f16c" or "generic".
const char* isa();
// Tests: force the portable kernels ("generic") or restore detection ("auto"); not
// thread-safe against concurrent ops. Returns false for an unknown name.
bool set_isa(const std::string& name);
}  // namespace cpu

namespace cuda {
// Bytes of device workspace `run` needs for `op` (partials of the reductions + flag).
int64_t workspace_bytes(OpKind op);

// Launch `op` on `stream` (a cudaStream_t). `d_segs` is the segment table already in
// device memory; `pair` is uniform_pair() of it (picks the kernel typed on the
// (src, dst) dtypes, or the per-segment dispatching one for kMixedPair). For
// kSumSquares, `d_out` receives the fp32 sqrt(sum of squares) (one float); for
// kNonFinite an int32 flag (0/1). One launch for the element kernel whatever the number
// of tensors, plus one tiny finishing launch for reductions. Throws std::runtime_error
// naming the op on a launch failure, and (before launching) on an error left pending
// by earlier work, so that it is not blamed on this op; std::invalid_argument for an
// op the GPU does not run (kCopyStreaming is CPU-only).
void run(OpKind op, int32_t pair, const Segment* d_segs, int64_t nseg, int64_t total, float scale,
         void* d_workspace, void* d_out, void* stream);

// The grid `run` uses for `op` on the current device (tests, benchmarks).
int grid_for(OpKind op, int32_t pair, int64_t total);

// Gradient-accumulation fusion (csrc/cuda/wgrad_gemm.cu): main_grad (fp32, row-major
// [out_features, in_features]) += alpha * grad_output^T @ input, where grad_output is
// [rows, out_features] and input [rows, in_features], both row-major of `dtype` (DType).
// cuBLAS GEMM with fp32 compute and beta = 1 on `cublas_handle` (a cublasHandle_t,
// already bound to the stream to run on). Throws std::runtime_error on a cuBLAS error.
void wgrad_gemm_accumulate(void* cublas_handle, int32_t dtype, const void* grad_output,
                           const void* input, float* main_grad, int64_t rows, int64_t out_features,
                           int64_t in_features, float alpha);

// Grouped GEMM of the MoE experts (csrc/cuda/grouped_gemm.cu): one cublasGemmEx per group
// with rows (group sizes on the host, `batch_sizes[g]` >= 0), all row-major, inputs of
// `dtype`, output of `out_dtype` (DType), fp32 compute, out = alpha * op + beta * out.
//   trans_a false: out[T, n] rows of group g = a[T, k] rows of g @ (trans_b ? b_g^T : b_g),
//                  b is [groups, n, k] (trans_b) or [groups, k, n];
//   trans_a true:  out[groups, k, n], out_g = a_g^T @ b_g with a [T, k], b [T, n].
// Groups with no rows are skipped (the caller zeroes their trans_a output when beta == 0).
// Throws std::invalid_argument for dims of 2^31 or more, std::runtime_error on a cuBLAS error.
void grouped_gemm(void* cublas_handle, int32_t dtype, int32_t out_dtype, const void* a,
                  const void* b, void* out, const int64_t* batch_sizes, int64_t groups, int64_t k,
                  int64_t n, bool trans_a, bool trans_b, float alpha, float beta);
}  // namespace cuda

}  // namespace megadlm
