// Weight-gradient GEMM of gradient-accumulation fusion on the GPU (host code only, no
// torch headers): main_grad (fp32, row-major [out, in]) += alpha * grad_output^T @ input
// with one cublasGemmEx per at most INT_MAX rows: bf16/fp16/fp32 inputs,
// CUBLAS_COMPUTE_32F, fp32 output, beta = 1. The glue (csrc/glue/cuda_glue.cpp) passes
// torch's cuBLAS handle, which torch has bound to its current stream (and workspace).
#include <climits>
#include <stdexcept>
#include <string>

#include "cublas_subset.h"
#include "megadlm/kernels.h"

namespace megadlm {
namespace cuda {

void wgrad_gemm_accumulate(void* cublas_handle, int32_t dtype, const void* grad_output,
                           const void* input, float* main_grad, int64_t rows, int64_t out_features,
                           int64_t in_features, float alpha) {
  if (rows == 0 || out_features == 0 || in_features == 0) return;
  if (out_features > INT_MAX || in_features > INT_MAX)
    throw std::invalid_argument("wgrad_accumulate: main_grad dims must each be below 2^31");
  const cudaDataType t = dtype == kF32 ? CUDA_R_32F : dtype == kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  const int64_t esize = dtype_size(dtype);
  const float beta = 1.0f;
  // Column-major view of the row-major tensors: main_grad is C[in, out] (ldc = in),
  // input is X[in, rows] (ld = in), grad_output is G[out, rows] (ld = out), and
  // C += alpha * X @ G^T is main_grad += alpha * grad_output^T @ input.
  for (int64_t r = 0; r < rows; r += INT_MAX) {
    const int k = int(rows - r < INT_MAX ? rows - r : INT_MAX);
    const char* x = static_cast<const char*>(input) + r * in_features * esize;
    const char* g = static_cast<const char*>(grad_output) + r * out_features * esize;
    const cublasStatus_t st = cublasGemmEx(
        static_cast<cublasHandle_t>(cublas_handle), CUBLAS_OP_N, CUBLAS_OP_T, int(in_features),
        int(out_features), k, &alpha, x, t, int(in_features), g, t, int(out_features), &beta,
        main_grad, CUDA_R_32F, int(in_features), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(std::string("wgrad_accumulate: cublasGemmEx failed: ") +
                               cublasGetStatusString(st));
  }
}

}  // namespace cuda
}  // namespace megadlm
