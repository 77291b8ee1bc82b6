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

MEGADLM_HD int dtype_size(int32_t d) {
  return d == kF32 ? 4 : 2;
}

// What a kernel does with one element x of src (and d of dst), all math in fp32:
//   kCopy:       dst = round(x * scale)            (flatten / unflatten)
//   kAccumulate: dst = round(d + x * scale)        (accumulate_into; mul then add, no FMA,
//                                                   so it is bitwise the reference route)
//   kScale:      src == dst, dst = round(x * scale) (scale_)
//   kSumSquares: sum of x*x into fp32 partials     (l2_norm)
//   kNonFinite:  any exponent-all-ones element     (has_nonfinite)
//   kCopyStreaming: kCopy with non-temporal stores (CPU launcher's choice for outputs
//                   larger than the last-level cache: saves the read-for-ownership)
enum OpKind : int32_t {
  kCopy = 0,
  kAccumulate = 1,
  kScale = 2,
  kSumSquares = 3,
  kNonFinite = 4,
  kCopyStreaming = 5
};

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

// The walk helpers below take any table row with an int64_t `start` (Segment, or the
// AdamTensor rows of the fused AdamW step, megadlm/adam.h).
// Global end of segment i given the table and the global total.
template <class Seg>
MEGADLM_HD int64_t segment_end(const Seg* segs, int64_t nseg, int64_t i, int64_t total) {
  return i + 1 < nseg ? segs[i + 1].start : total;
}

// Index of the segment containing global element g (segs sorted by start, g < total).
template <class Seg>
MEGADLM_HD int64_t find_segment(const Seg* segs, int64_t nseg, int64_t g) {
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {  // last segment with start <= g
    int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].start <= g)
      lo = mid;
    else
      hi = mid - 1;
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
MEGADLM_HD float bf16_to_float(uint16_t h) {
  return bits_to_float(uint32_t(h) << 16);
}
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
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                  // below 2^-14: subnormal
    // Adding 0.5 moves the value's subnormal bits to the mantissa; the FPU rounds to
    // nearest even for us.
    float v = bits_to_float(a) + 0.5f;
    return uint16_t(sign | uint16_t(float_to_bits(v) - 0x3f000000u));
  }
  uint32_t mant_odd = (a >> 13) & 1u;
  a += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
  return uint16_t(sign | uint16_t(a >> 13));
}

// ---- element types as template parameters ---------------------------------------------
// The CUDA kernels are templates on the (source, destination) pair, so the dtype
// dispatch happens once per launch (or once per segment for mixed lists), never per
// element. Codes: pair = src * 3 + dst; kMixedPair when the list mixes pairs.
struct F32T {
  using T = float;
  static constexpr int32_t kCode = kF32;
};
struct BF16T {
  using T = uint16_t;
  static constexpr int32_t kCode = kBF16;
};
struct F16T {
  using T = uint16_t;
  static constexpr int32_t kCode = kF16;
};
struct MixedT {
  static constexpr int32_t kCode = -1;
};  // dtype read from each segment
constexpr int32_t kMixedPair = -1;

MEGADLM_HD int32_t pair_code(int32_t src, int32_t dst) {
  return src * 3 + dst;
}

// The pair shared by every segment, or kMixedPair (host: the launcher picks the kernel).
inline int32_t uniform_pair(const Segment* segs, int64_t nseg) {
  if (nseg == 0) return pair_code(kF32, kF32);
  const int32_t p = pair_code(segs[0].src_dtype, segs[0].dst_dtype);
  for (int64_t i = 1; i < nseg; ++i)
    if (pair_code(segs[i].src_dtype, segs[i].dst_dtype) != p) return kMixedPair;
  return p;
}

// Dispatch from a dtype / pair code to template types. Two copies on purpose: the host
// launchers call them with host lambdas, the mixed-list kernels with device lambdas,
// and nvcc keeps those apart.
#define MEGADLM_WITH_TYPE_BODY(code, f) \
  if (code == kF32)                     \
    f(F32T{});                          \
  else if (code == kBF16)               \
    f(BF16T{});                         \
  else                                  \
    f(F16T{})
// f(S{}) for a dtype code (host).
template <class F>
inline void with_type(int32_t code, F&& f) {
  MEGADLM_WITH_TYPE_BODY(code, f);
}
// f(S{}, D{}) for a pair code; kMixedPair -> f(MixedT{}, MixedT{}) (host).
template <class F>
inline void with_pair(int32_t pair, F&& f) {
  if (pair == kMixedPair)
    f(MixedT{}, MixedT{});
  else
    with_type(pair / 3, [&](auto s) { with_type(pair % 3, [&](auto d) { f(s, d); }); });
}
// f(S{}) for the source type of a pair code (ops whose destination is the source or none).
template <class F>
inline void with_src(int32_t pair, F&& f) {
  if (pair == kMixedPair)
    f(MixedT{});
  else
    with_type(pair / 3, f);
}

#if defined(__CUDACC__)
#define MEGADLM_DEVICE __device__ __forceinline__
#else
#define MEGADLM_DEVICE inline
#endif
// Device copies: f(S{}) for a dtype code; f(S{}, D{}) for a concrete (src, dst) pair.
template <class F>
MEGADLM_DEVICE void dev_with_type(int32_t code, F&& f) {
  MEGADLM_WITH_TYPE_BODY(code, f);
}
template <class F>
MEGADLM_DEVICE void dev_with_pair(int32_t src, int32_t dst, F&& f) {
  dev_with_type(src, [&](auto s) { dev_with_type(dst, [&](auto d) { f(s, d); }); });
}
#undef MEGADLM_WITH_TYPE_BODY

template <class S>
MEGADLM_HD float get(const void* p, int64_t i) {
  if constexpr (S::kCode == kF32)
    return static_cast<const float*>(p)[i];
  else if constexpr (S::kCode == kBF16)
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  else
    return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
}
template <class D>
MEGADLM_HD void put(void* p, int64_t i, float v) {
  if constexpr (D::kCode == kF32)
    static_cast<float*>(p)[i] = v;
  else if constexpr (D::kCode == kBF16)
    static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else
    static_cast<uint16_t*>(p)[i] = float_to_fp16(v);
}
template <class S>
MEGADLM_HD float to_float16bits(uint16_t h) {
  if constexpr (S::kCode == kBF16)
    return bf16_to_float(h);
  else
    return fp16_to_float(h);
}
template <class D>
MEGADLM_HD uint16_t from_float16bits(float v) {
  if constexpr (D::kCode == kBF16)
    return float_to_bf16(v);
  else
    return float_to_fp16(v);
}

#if defined(__CUDACC__)
// ---- CUDA aligned 16-byte vector helpers ---------------------------------------------
// A thread moves kVec = 8 elements: one 16-byte load for bf16/fp16, two for fp32.
constexpr int kVec = 8;

// Load 8 elements of type S starting at element i (address 16-byte aligned) as fp32.
template <class S>
__device__ __forceinline__ void load8(const void* base, int64_t i, float (&v)[kVec]) {
  if constexpr (S::kCode == kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    const float4 a = p[0], b = p[1];
    v[0] = a.x;
    v[1] = a.y;
    v[2] = a.z;
    v[3] = a.w;
    v[4] = b.x;
    v[5] = b.y;
    v[6] = b.z;
    v[7] = b.w;
  } else {
    const uint4 r = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = to_float16bits<S>(uint16_t(w[k] & 0xffffu));
      v[2 * k + 1] = to_float16bits<S>(uint16_t(w[k] >> 16));
    }
  }
}

// Store 8 fp32 values as type D at element i (address 16-byte aligned).
template <class D>
__device__ __forceinline__ void store8(void* base, int64_t i, const float (&v)[kVec]) {
  if constexpr (D::kCode == kF32) {
    float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + i);
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = uint32_t(from_float16bits<D>(v[2 * k])) |
             (uint32_t(from_float16bits<D>(v[2 * k + 1])) << 16);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}
#endif  // __CUDACC__

}  // namespace megadlm
