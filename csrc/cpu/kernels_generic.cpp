// Portable build of the CPU kernels (any x86-64 / aarch64 CPU); cpu_run.cpp uses it when
// AVX2/F16C are missing.
#define MEGADLM_CPU_SIMD 0
#define MEGADLM_CPU_NS generic
#include <type_traits>

#include "megadlm/kernels.h"
#include "kernels_impl.h"

namespace megadlm {
namespace cpu {
CpuResult process_range_generic(OpKind op, const Segment* segs, int64_t nseg, int64_t total,
                                int64_t begin, int64_t end, float scale) {
  return generic::process_range(op, segs, nseg, total, begin, end, scale);
}
}  // namespace cpu
}  // namespace megadlm
