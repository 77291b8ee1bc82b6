// Stub for `make glue-check` (tools/cuda_stubs/README.md): the handle type CUDAContextLight.h names.
#pragma once
typedef struct cublasLtContext* cublasLtHandle_t;
