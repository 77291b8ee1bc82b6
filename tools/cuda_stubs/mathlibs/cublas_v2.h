// Stub for `make glue-check` (tools/cuda_stubs/README.md): the handle and status types torch names.
#pragma once
#include <library_types.h>
typedef struct cublasContext* cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;
