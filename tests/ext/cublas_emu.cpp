// Host emulation of the two cuBLAS calls csrc/cuda/grouped_gemm.cu makes, so that its
// row-major <-> column-major argument mapping is checked on machines without a GPU
// (tests/ext/test_grouped_gemm.py): a naive column-major fp32 GEMM with cuBLAS's meaning
// of transa/transb, m, n, k, lda, ldb, ldc, alpha and beta. fp32 operands only.
#include <cstdint>

#include "../../csrc/cuda/grouped_gemm.cu"

extern "C" {
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void* alpha, const void* A, cudaDataType,
                            int lda, const void* B, cudaDataType, int ldb, const void* beta,
                            void* C, cudaDataType, int ldc, cublasComputeType_t, cublasGemmAlgo_t) {
  const float* a = static_cast<const float*>(A);
  const float* b = static_cast<const float*>(B);
  float* c = static_cast<float*>(C);
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double s = 0.0;
      for (int p = 0; p < k; ++p) {
        const float av = transa == CUBLAS_OP_N ? a[i + p * lda] : a[p + i * lda];
        const float bv = transb == CUBLAS_OP_N ? b[p + j * ldb] : b[j + p * ldb];
        s += double(av) * double(bv);
      }
      float& dst = c[i + j * ldc];
      dst = float(al * s + (be == 0.0f ? 0.0 : double(be) * dst));
    }
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasGetStatusString(cublasStatus_t) {
  return "emulated";
}

int emu_grouped(const float* a, const float* b, float* out, const int64_t* sizes, int64_t groups,
                int64_t k, int64_t n, int trans_a, int trans_b, float alpha, float beta) {
  try {
    megadlm::cuda::grouped_gemm(nullptr, megadlm::kF32, megadlm::kF32, a, b, out, sizes, groups, k,
                                n, trans_a != 0, trans_b != 0, alpha, beta);
  } catch (...) {
    return 1;
  }
  return 0;
}
}
