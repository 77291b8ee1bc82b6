// megadlm/multi_tensor.h -- the one shared header of the kernels.
//
// Holds what every kernel file needs and nothing torch-specific (the CPU kernels and
// the .cu files are compiled without torch headers, see CMakeLists.txt):
//   * DType / OpKind codes passed from the bindings to the kernels,
//   * Segment: one tensor of a tensor list, as raw pointers + its element range in the
//     concatenation of the list ("global element index"). Kernels parallelise over the
//     global range [0, total) -- never per tensor -- so 20k tiny tensors spread over
//     all threads / blocks exactly like one big tensor;
//   * scalar fp32 <-> bf16/fp16 conversions usable on host and device,
//   * the aligned 16-byte load/store helpers of the CUDA kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MEGADLM_HD __host__ __device__ __forceinline__
#else
#define MEGADLM_HD inline
#endif

namespace megadlm {

// Element types the ops accept (values shared with the bindings' dtype mapping).
enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

MEGADLM_HD int dtype_size(int32_t d) { return d == kF32 ? 4 : 2; }

// What a kernel does with one element x of src (and d of dst), all math in fp32:
//   kCopy:       dst = round(x * scale)            (flatten / unflatten)
//   kAccumulate: dst = round(d + x * scale)        (accumulate_into; mul then add, no FMA,
//                                                   so it is bitwise the reference route)
//   kScale:      src == dst, dst = round(x * scale) (scale_)
//   kSumSquares: sum of x*x into fp32 partials     (l2_norm)
//   kNonFinite:  any exponent-all-ones element     (has_nonfinite)
//   kCopyStreaming: kCopy with non-temporal stores (CPU launcher's choice for outputs
//                   larger than the last-level cache: saves the read-for-ownership)
enum OpKind : int32_t { kCopy = 0, kAccumulate = 1, kScale = 2, kSumSquares = 3, kNonFinite = 4,
                        kCopyStreaming = 5 };

// One tensor of a list. `start` is the prefix sum of numel over the previous segments
// (empty tensors are dropped by the bindings), so segment i covers global elements
// [start, start + numel). 32 bytes, trivially copyable: it is memcpy'd to the device.
struct Segment {
  const void* src;    // read from (kScale: same as dst)
  void* dst;          // written to (nullptr for the reductions)
  int64_t start;      // global index of this segment's first element
  int32_t src_dtype;  // DType
  int32_t dst_dtype;  // DType
};
static_assert(sizeof(Segment) == 32, "Segment layout is shared with the CUDA kernels");

// Number of elements of segment i given the table and the global total.
MEGADLM_HD int64_t segment_end(const Segment* segs, int64_t nseg, int64_t i, int64_t total) {
  return i + 1 < nseg ? segs[i + 1].start : total;
}

// Index of the segment containing global element g (segs sorted by start, g < total).
MEGADLM_HD int64_t find_segment(const Segment* segs, int64_t nseg, int64_t g) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {  // last segment with start <= g
    int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].start <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// ---- scalar conversions (round to nearest even, NaN stays NaN) -------------------------
MEGADLM_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
MEGADLM_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MEGADLM_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }
MEGADLM_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
MEGADLM_HD float fp16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {  // zero / subnormal: man * 2^-24
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}
MEGADLM_HD uint16_t float_to_fp16(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);         // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);        // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                        // below 2^-14: subnormal
    // Adding 0.5 moves the value's subnormal bits to the mantissa; the FPU rounds to
    // nearest even for us.
    float v = bits_to_float(a) + 0.5f;
    return uint16_t(sign | uint16_t(float_to_bits(v) - 0x3f000000u));
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return uint16_t(sign | uint16_t(a >> 13));
}

// Load element i of a `dtype` array as fp32 / store fp32 as `dtype` (scalar paths).
MEGADLM_HD float load_as_float(const void* p, int32_t dtype, int64_t i) {
  if (dtype == kF32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dtype == kBF16 ? bf16_to_float(h) : fp16_to_float(h);
}
MEGADLM_HD void store_from_float(void* p, int32_t dtype, int64_t i, float v) {
  if (dtype == kF32) { static_cast<float*>(p)[i] = v; return; }
  static_cast<uint16_t*>(p)[i] = dtype == kBF16 ? float_to_bf16(v) : float_to_fp16(v);
}

#if defined(__CUDACC__)
// ---- CUDA aligned 16-byte vector helpers ---------------------------------------------
// A thread moves kVec = 8 elements: one 16-byte load for bf16/fp16, two for fp32.
constexpr int kVec = 8;

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Load 8 elements starting at element i (address 16-byte aligned) as fp32.
__device__ __forceinline__ void load8(const void* base, int32_t dtype, int64_t i, float (&v)[kVec]) {
  if (dtype == kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    uint4 r = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint16_t lo = uint16_t(w[k] & 0xffffu), hi = uint16_t(w[k] >> 16);
      v[2 * k] = dtype == kBF16 ? bf16_to_float(lo) : fp16_to_float(lo);
      v[2 * k + 1] = dtype == kBF16 ? bf16_to_float(hi) : fp16_to_float(hi);
    }
  }
}

// Store 8 fp32 values as `dtype` at element i (address 16-byte aligned).
__device__ __forceinline__ void store8(void* base, int32_t dtype, int64_t i, const float (&v)[kVec]) {
  if (dtype == kF32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint16_t lo = dtype == kBF16 ? float_to_bf16(v[2 * k]) : float_to_fp16(v[2 * k]);
      uint16_t hi = dtype == kBF16 ? float_to_bf16(v[2 * k + 1]) : float_to_fp16(v[2 * k + 1]);
      w[k] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}
#endif  // __CUDACC__

}  // namespace megadlm
