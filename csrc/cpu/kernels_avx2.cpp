// AVX2 + F16C build of the CPU kernels (selected at run time by cpu_run.cpp when the CPU
// has them). The target pragma covers only this file, which includes no torch headers,
// so no AVX2 copy of an inline torch function can leak into the rest of the module.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
#define MEGADLM_CPU_SIMD 1
#define MEGADLM_CPU_NS avx2
#include <type_traits>

#include "megadlm/kernels.h"
#include "kernels_impl.h"

namespace megadlm {
namespace cpu {
CpuResult process_range_avx2(OpKind op, const Segment* segs, int64_t nseg, int64_t total,
                             int64_t begin, int64_t end, float scale) {
  return avx2::process_range(op, segs, nseg, total, begin, end, scale);
}
}  // namespace cpu
}  // namespace megadlm
#endif  // x86
