// Shims that let g++ compile the CUDA kernels' device code (csrc/cuda/*.cuh) as host
// code: blocks and threads become loops over blockIdx / threadIdx set by the caller, the
// vector types and the rounding intrinsics are plain C++. Shared by the emulations
// (cuda_emu.cpp, adam_emu.cpp); build with -ffp-contract=off so that the plain operators
// round like the device intrinsics. Not part of the package.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define __CUDACC__ 1
#define __host__
#define __device__
#define __forceinline__ inline
#define __restrict__
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) {
  return {a, b, c, d};
}
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) {
  return {a, b, c, d};
}
struct Dim3 {
  unsigned x;
};
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
inline float __fmul_rn(float a, float b) {
  return a * b;
}  // built with -ffp-contract=off
inline float __fadd_rn(float a, float b) {
  return a + b;
}
using std::fmaf;
using std::isfinite;
