// CPU kernel bodies, compiled twice: by kernels_avx2.cpp (AVX2 + F16C vector path) and
// by kernels_generic.cpp (portable scalar path the compiler may auto-vectorise).
// cpu_run.cpp picks one at run time. Torch-free on purpose: CMakeLists.txt compiles
// these files with plain g++.
//
// Layout: element functors per op (load/store of 8 lanes when MEGADLM_CPU_SIMD, scalar
// otherwise), a dtype dispatch over (src dtype, dst dtype), and `process_range`, which
// walks the segments intersecting a block [begin, end) of the global element range.
#pragma once

// The contract rounds x*scale before adding it (bitwise the reference route); GCC would
// otherwise contract the scalar tails into FMAs in the AVX2 build.
#pragma GCC optimize("fp-contract=off")

#include <algorithm>
#include <cmath>
#include <cstring>

#include "megadlm/multi_tensor.h"

#if MEGADLM_CPU_SIMD
#include <immintrin.h>
#endif

namespace megadlm {
namespace cpu {
namespace MEGADLM_CPU_NS {

// Storage types: F32 is float, BF16/F16 are raw uint16_t bit patterns.
struct F32 {
  using T = float;
  static float get(const T* p) { return *p; }
  static void put(T* p, float v) { *p = v; }
#if MEGADLM_CPU_SIMD
  static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static constexpr uintptr_t kStreamAlign = 32;
  static void stream(T* p, __m256 v) { _mm256_stream_ps(p, v); }
#endif
};
struct BF16 {
  using T = uint16_t;
  static float get(const T* p) { return bf16_to_float(*p); }
  static void put(T* p, float v) { *p = float_to_bf16(v); }
#if MEGADLM_CPU_SIMD
  static __m256 load(const T* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store(T* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static constexpr uintptr_t kStreamAlign = 16;
  static void stream(T* p, __m256 v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static __m128i pack(__m256 v) {
    // Round to nearest even on the bit pattern (as float_to_bf16), NaN -> quiet NaN.
    __m256i u = _mm256_castps_si256(v);
    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    // 8 x u32 -> 8 x u16: packus works per 128-bit lane, permute puts both halves low.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
  }
#endif
};
struct F16 {
  using T = uint16_t;
  static float get(const T* p) { return fp16_to_float(*p); }
  static void put(T* p, float v) { *p = float_to_fp16(v); }
#if MEGADLM_CPU_SIMD
  static __m256 load(const T* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(T* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static constexpr uintptr_t kStreamAlign = 16;
  static void stream(T* p, __m256 v) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack(v)); }
  static __m128i pack(__m256 v) {
    return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
#endif
};

// Segments of at most this many elements take a plain loop where the general path's
// setup (a memmove call) costs more than the work.
constexpr int64_t kTiny = 16;

// dst = src * scale (cast). Same-dtype unscaled copies are a memcpy.
template <typename S, typename D>
void copy_n(const typename S::T* src, typename D::T* dst, int64_t n, float scale) {
  if (std::is_same<S, D>::value && scale == 1.0f) {
    if constexpr (std::is_same<S, D>::value) {
      // Tiny segments (a table of one-element tensors): a loop beats the call to memmove.
      // src == dst (kScale) or disjoint: a forward copy of the bits either way.
      if (n <= kTiny) {
        for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
        return;
      }
    }
    std::memmove(dst, src, size_t(n) * sizeof(typename S::T));  // kScale: src == dst
    return;
  }
  int64_t i = 0;
#if MEGADLM_CPU_SIMD
  const __m256 s = _mm256_set1_ps(scale);
  if (scale == 1.0f) {
    for (; i + 8 <= n; i += 8) D::store(dst + i, S::load(src + i));
  } else {
    for (; i + 8 <= n; i += 8) D::store(dst + i, _mm256_mul_ps(S::load(src + i), s));
  }
#endif
  for (; i < n; ++i) D::put(dst + i, S::get(src + i) * scale);
}

// copy_n with non-temporal stores: the destination bypasses the cache (no
// read-for-ownership), for outputs far larger than the last-level cache. The caller
// issues the store fence.
template <typename S, typename D>
void copy_n_streaming(const typename S::T* src, typename D::T* dst, int64_t n, float scale) {
#if MEGADLM_CPU_SIMD
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & (D::kStreamAlign - 1)); ++i)
    D::put(dst + i, S::get(src + i) * scale);
  const __m256 s = _mm256_set1_ps(scale);
  if (scale == 1.0f) {
    for (; i + 8 <= n; i += 8) D::stream(dst + i, S::load(src + i));
  } else {
    for (; i + 8 <= n; i += 8) D::stream(dst + i, _mm256_mul_ps(S::load(src + i), s));
  }
  for (; i < n; ++i) D::put(dst + i, S::get(src + i) * scale);
#else
  copy_n<S, D>(src, dst, n, scale);
#endif
}

// dst = dst + src * scale, fp32 math, one rounding into dst's dtype.
template <typename S, typename D>
void accumulate_n(const typename S::T* src, typename D::T* dst, int64_t n, float scale) {
  int64_t i = 0;
#if MEGADLM_CPU_SIMD
  const __m256 s = _mm256_set1_ps(scale);
  for (; i + 8 <= n; i += 8)
    D::store(dst + i, _mm256_add_ps(D::load(dst + i), _mm256_mul_ps(S::load(src + i), s)));
#endif
  for (; i < n; ++i) D::put(dst + i, D::get(dst + i) + S::get(src + i) * scale);
}

// Sum of squares in fp32 (several independent lanes, then summed in double).
template <typename S>
double sum_squares_n(const typename S::T* src, int64_t n) {
  if (n < 8) {
    // No 8-lane block: below, every lane but acc[0] stays 0 and the result is the double
    // of acc[0], the in-order fp32 sum of the squares. The same sum, bitwise, without
    // setting up and folding the lanes (most of the cost of a one-element tensor).
    float a = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
      const float v = S::get(src + k);
      a += v * v;
    }
    return double(a);
  }
  int64_t i = 0;
  double total = 0.0;
#if MEGADLM_CPU_SIMD
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 32 <= n; i += 32) {
    __m256 v0 = S::load(src + i), v1 = S::load(src + i + 8);
    __m256 v2 = S::load(src + i + 16), v3 = S::load(src + i + 24);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
    a2 = _mm256_fmadd_ps(v2, v2, a2);
    a3 = _mm256_fmadd_ps(v3, v3, a3);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (float l : lanes) total += l;
#endif
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      float v = S::get(src + i + k);
      acc[k] += v * v;
    }
  for (; i < n; ++i) {
    float v = S::get(src + i);
    acc[0] += v * v;
  }
  for (float a : acc) total += a;
  return total;
}

// True if any element is NaN or +-inf (tested on the exponent bits: no conversion).
template <typename S>
bool nonfinite_n(const typename S::T* src, int64_t n) {
  using T = typename S::T;
  constexpr bool wide = sizeof(T) == 4;
  // Exponent mask: fp32 0x7f800000, bf16 0x7f80, fp16 0x7c00.
  const uint32_t mask = wide ? 0x7f800000u : (std::is_same<S, BF16>::value ? 0x7f80u : 0x7c00u);
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(src);
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    if (wide) {
      std::memcpy(&u, bytes + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      u = h;
    }
    any |= uint32_t((u & mask) == mask);
  }
  return any != 0;
}

// Apply `op` to `n` elements starting at element `off` of segment `sg`, whose (source,
// destination) types are S, D (reductions use S only).
template <typename S, typename D>
void apply_typed(OpKind op, const Segment& sg, int64_t off, int64_t n, float scale,
                 CpuResult& res) {
  const auto* src = static_cast<const typename S::T*>(sg.src) + off;
  if (op == kSumSquares) {
    res.sum_squares += sum_squares_n<S>(src, n);
    return;
  }
  if (op == kNonFinite) {
    res.nonfinite = res.nonfinite || nonfinite_n<S>(src, n);
    return;
  }
  auto* dst = static_cast<typename D::T*>(sg.dst) + off;
  if (op == kAccumulate)
    accumulate_n<S, D>(src, dst, n, scale);
  else if (op == kCopyStreaming)
    copy_n_streaming<S, D>(src, dst, n, scale);
  else
    copy_n<S, D>(src, dst, n, scale);
}

// The dtype dispatch: apply_typed of each (source, destination) pair, indexed by
// pair_code. One indirect call per segment, all of the work inlined behind it (a table of
// one-element tensors pays this per element, so no closure or nested dispatch).
using ApplyFn = void (*)(OpKind, const Segment&, int64_t, int64_t, float, CpuResult&);
inline constexpr ApplyFn kApply[9] = {
    apply_typed<F32, F32>,  apply_typed<F32, BF16>,  apply_typed<F32, F16>,
    apply_typed<BF16, F32>, apply_typed<BF16, BF16>, apply_typed<BF16, F16>,
    apply_typed<F16, F32>,  apply_typed<F16, BF16>,  apply_typed<F16, F16>};

inline void apply(OpKind op, const Segment& sg, int64_t off, int64_t n, float scale,
                  CpuResult& res) {
  kApply[pair_code(sg.src_dtype, sg.dst_dtype)](op, sg, off, n, scale, res);
}

#if MEGADLM_CPU_SIMD
// Streaming copy of fp32 segments whose destinations tile one contiguous range (a flatten of
// many small tensors): every aligned 32-byte chunk of the destination is one non-temporal
// store, and a chunk that straddles a segment boundary is assembled first, so small sources
// get the write bandwidth of one large streaming copy. (Streaming each segment on its own
// leaves two partial lines per boundary: measured slower; prefetching the next source or
// walking sources in address order: no gain, docs/extension.md.) False, nothing written,
// when the block's segments are not such a range.
inline bool stream_tiled_f32(const Segment* segs, int64_t nseg, int64_t total, int64_t begin,
                             int64_t end) {
  const int64_t first = find_segment(segs, nseg, begin);
  for (int64_t i = first; i < nseg && segs[i].start < end; ++i) {
    if (segs[i].src_dtype != kF32 || segs[i].dst_dtype != kF32) return false;
    if (i > first && static_cast<float*>(segs[i - 1].dst) + (segs[i].start - segs[i - 1].start) !=
                         static_cast<float*>(segs[i].dst))
      return false;
  }
  float* out = static_cast<float*>(segs[first].dst) - segs[first].start;  // out[g]: element g
  int64_t i = first, g = begin;
  auto src_at = [&](int64_t k) {  // k only grows: the segment index only moves forward
    while (k >= segment_end(segs, nseg, i, total)) ++i;
    return static_cast<const float*>(segs[i].src)[k - segs[i].start];
  };
  for (; g < end && (reinterpret_cast<uintptr_t>(out + g) & 31); ++g) out[g] = src_at(g);
  alignas(32) float chunk[8];
  while (g + 8 <= end) {
    while (g >= segment_end(segs, nseg, i, total)) ++i;
    const int64_t stop = std::min(end, segment_end(segs, nseg, i, total));
    if (g + 8 <= stop) {
      const float* base = static_cast<const float*>(segs[i].src) - segs[i].start;
      for (; g + 8 <= stop; g += 8) _mm256_stream_ps(out + g, _mm256_loadu_ps(base + g));
      continue;
    }
    for (int k = 0; k < 8; ++k) chunk[k] = src_at(g + k);
    _mm256_stream_ps(out + g, _mm256_load_ps(chunk));
    g += 8;
  }
  for (; g < end; ++g) out[g] = src_at(g);
  _mm_sfence();
  return true;
}
#endif

// Process global elements [begin, end) of the table.
inline CpuResult process_range(OpKind op, const Segment* segs, int64_t nseg, int64_t total,
                               int64_t begin, int64_t end, float scale) {
  CpuResult res;
  if (begin >= end) return res;
#if MEGADLM_CPU_SIMD
  if (op == kCopyStreaming && scale == 1.0f && stream_tiled_f32(segs, nseg, total, begin, end))
    return res;
#endif
  for (int64_t i = find_segment(segs, nseg, begin); i < nseg && segs[i].start < end; ++i) {
    int64_t s0 = segs[i].start, s1 = segment_end(segs, nseg, i, total);
    int64_t lo = begin > s0 ? begin : s0, hi = end < s1 ? end : s1;
    if (hi > lo) apply(op, segs[i], lo - s0, hi - lo, scale, res);
    if (op == kNonFinite && res.nonfinite) break;
  }
#if MEGADLM_CPU_SIMD
  if (op == kCopyStreaming) _mm_sfence();  // order the non-temporal stores
#endif
  return res;
}

}  // namespace MEGADLM_CPU_NS
}  // namespace cpu
}  // namespace megadlm
