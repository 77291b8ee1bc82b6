// CPU kernel of the fused AdamW step (megadlm_ext.adamw_step on CPU tensors): the global
// element range of the AdamTensor table in blocks over the OpenMP team (torch's intra-op
// threads, as cpu_run.cpp), each element through adam_element -- the very function the
// CUDA kernel's scalar path runs -- typed on the list's storage dtypes.
//
// The contract is bitwise equality with the CUDA kernel and the reference route's torch
// expressions, so every fp32 operation must round on its own: no FMA contraction here.
#pragma GCC optimize("fp-contract=off")

#include <omp.h>

#include <algorithm>

#include "megadlm/adam.h"

namespace megadlm {
namespace cpu {
namespace {

// 64k elements per block, as the other CPU kernels: the per-block segment lookup is noise.
constexpr int64_t kBlock = int64_t(1) << 16;

template <class G, class M, class V, class P>
void adam_range(const AdamTensor* table, int64_t n, int64_t total, int64_t begin, int64_t end,
                const AdamScalars& s) {
  for (int64_t i = find_segment(table, n, begin); i < n && table[i].start < end; ++i) {
    const AdamTensor& t = table[i];
    const int64_t lo = std::max(begin, t.start) - t.start;
    const int64_t hi = std::min(end, segment_end(table, n, i, total)) - t.start;
    for (int64_t k = lo; k < hi; ++k) adam_element<G, M, V, P>(t, k, s);
  }
}

}  // namespace

void adam_run(const AdamTensor* table, int64_t n, int64_t total, const AdamDTypes& dtypes,
              const AdamScalars& s) {
  if (n == 0 || total == 0) return;
  with_adam_types(dtypes, [&](auto g, auto m, auto v, auto p) {
    auto range = &adam_range<decltype(g), decltype(m), decltype(v), decltype(p)>;
    const int64_t nblocks = (total + kBlock - 1) / kBlock;
    if (nblocks == 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
      range(table, n, total, 0, total, s);
      return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b)
      range(table, n, total, b * kBlock, std::min(total, (b + 1) * kBlock), s);
  });
}

}  // namespace cpu
}  // namespace megadlm
