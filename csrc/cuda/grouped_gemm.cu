// Grouped GEMM of the MoE experts on the GPU (host code only, no torch headers): a loop of
// cublasGemmEx on the handle's stream, one per group (expert) with rows; fp32 compute for
// bf16/fp16/fp32 inputs. The glue (csrc/glue/cuda_glue.cpp) passes torch's cuBLAS handle,
// bound to torch's current stream, and the group sizes on the host. The row-major tensors
// are read as column-major transposes: row-major C = A @ B is column-major C^T = B^T @ A^T.
#include <climits>
#include <stdexcept>
#include <string>

#include "cublas_subset.h"
#include "megadlm/kernels.h"

namespace megadlm {
namespace cuda {
namespace {

cudaDataType cuda_type(int32_t dtype) {
  return dtype == kF32 ? CUDA_R_32F : dtype == kBF16 ? CUDA_R_16BF : CUDA_R_16F;
}

void check_dim(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX)
    throw std::invalid_argument(std::string("grouped_gemm: ") + what + " = " + std::to_string(v) +
                                " must be in [0, 2^31)");
}

}  // namespace

void grouped_gemm(void* cublas_handle, int32_t dtype, int32_t out_dtype, const void* a,
                  const void* b, void* out, const int64_t* batch_sizes, int64_t groups, int64_t k,
                  int64_t n, bool trans_a, bool trans_b, float alpha, float beta) {
  check_dim(k, "k");
  check_dim(n, "n");
  if (k == 0 || n == 0) return;
  const cudaDataType t = cuda_type(dtype), to = cuda_type(out_dtype);
  const int64_t es = dtype_size(dtype), eo = dtype_size(out_dtype);
  auto h = static_cast<cublasHandle_t>(cublas_handle);
  const char* pa = static_cast<const char*>(a);
  const char* pb = static_cast<const char*>(b);
  char* po = static_cast<char*>(out);
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = batch_sizes[g];
    check_dim(rows, "a group's rows");
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    if (rows > 0 && !trans_a) {
      // out_g[rows, n] = a_g[rows, k] @ B_g: column-major out^T[n, rows] = B_g^T @ a_g^T,
      // where b_g read column-major is B_g^T (no transpose) or, for b_g [n, k], B_g (op T).
      const char* bg = pb + g * n * k * es;
      st = cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(rows),
                        int(k), &alpha, bg, t, trans_b ? int(k) : int(n), pa + row * k * es, t,
                        int(k), &beta, po + row * n * eo, to, int(n), CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
    } else if (rows > 0) {
      // out_g[k, n] = a_g^T @ b_g (a_g [rows, k], b_g [rows, n]): column-major
      // out_g^T[n, k] = b_g^T[n, rows] @ a_g[rows, k], a_g read column-major is a_g^T (op T).
      st = cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, int(n), int(k), int(rows), &alpha,
                        pb + row * n * es, t, int(n), pa + row * k * es, t, int(k), &beta,
                        po + g * k * n * eo, to, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
      throw std::runtime_error(std::string("grouped_gemm: cublasGemmEx failed for group ") +
                               std::to_string(g) + ": " + cublasGetStatusString(st));
    row += rows;
  }
}

}  // namespace cuda
}  // namespace megadlm
