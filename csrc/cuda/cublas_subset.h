// The few cuBLAS declarations csrc/cuda/wgrad_gemm.cu uses. A real CUDA build (toolkit
// with cuBLAS) takes them from <cublas_v2.h>; the compile check of CI (`make cuda-check`),
// whose nvcc install has no cuBLAS headers, gets this subset of cuBLAS's stable C API
// (values and signatures as in cublas_api.h of CUDA 11.0 and later). The module itself
// links libcublas only in CUDA builds (setup.py).
#pragma once

#include <library_types.h>  // cudaDataType_t: part of the CUDA runtime headers

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#else
extern "C" {
typedef struct cublasContext* cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);
const char* cublasGetStatusString(cublasStatus_t status);
}
#endif
