// Stub for `make glue-check` (tools/cuda_stubs/README.md): the status type ATen/cuda/Exceptions.h names.
#pragma once
typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;
