// Shims that let g++ compile the CUDA kernels' device code for a host emulation (blocks and
// threads run as loops on one CPU thread): CUDA's qualifiers become nothing or `inline`, its
// vector types plain structs, threadIdx / blockIdx / blockDim / gridDim globals the emulation
// sets before each call, and the round-to-nearest intrinsics plain operators (build with
// -ffp-contract=off). Included first by tests/ext/cuda_emu.cpp and tests/ext/fused_emu.cpp.
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
