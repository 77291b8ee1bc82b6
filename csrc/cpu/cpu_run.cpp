// CPU launcher: splits the global element range of a segment table into fixed blocks,
// spreads the blocks over the OpenMP team (the same libgomp as torch, so
// torch.set_num_threads applies) and picks the AVX2 or generic kernel build once.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "megadlm/kernels.h"

namespace megadlm {
namespace cpu {

CpuResult process_range_generic(OpKind, const Segment*, int64_t, int64_t, int64_t, int64_t, float);
#if defined(__x86_64__) || defined(__i386__)
CpuResult process_range_avx2(OpKind, const Segment*, int64_t, int64_t, int64_t, int64_t, float);
#endif

namespace {
// 64k elements (256 KiB of fp32) per block: large enough that the per-block segment
// lookup is noise, small enough that 2 threads get balanced work on a few MB.
constexpr int64_t kBlock = int64_t(1) << 16;
// 16M elements: 64 MB of fp32, twice this machine class's L3.
constexpr int64_t kStreamingElems = int64_t(1) << 24;
constexpr int64_t kStreamingMinAvg = int64_t(1) << 16;

using RangeFn = CpuResult (*)(OpKind, const Segment*, int64_t, int64_t, int64_t, int64_t, float);

RangeFn pick() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("fma"))
    return process_range_avx2;
#endif
  return process_range_generic;
}
RangeFn kRange = pick();

// fp32 -> fp32 with destinations back to back (a flatten into one buffer): the AVX2 kernel
// streams those whole 32-byte chunks at a time, small segments included (kernels_impl.h).
bool tiles_f32_range(const Segment* segs, int64_t nseg) {
  for (int64_t i = 0; i < nseg; ++i) {
    if (segs[i].src_dtype != kF32 || segs[i].dst_dtype != kF32) return false;
    if (i > 0 && static_cast<float*>(segs[i - 1].dst) + (segs[i].start - segs[i - 1].start) !=
                     static_cast<float*>(segs[i].dst))
      return false;
  }
  return true;
}
}  // namespace

const char* isa() {
  return kRange == process_range_generic ? "generic" : "avx2+f16c";
}

bool set_isa(const std::string& name) {
  if (name == "generic") {
    kRange = process_range_generic;
    return true;
  }
  if (name == "auto") {
    kRange = pick();
    return true;
  }
  return false;
}

CpuResult run(OpKind op, const Segment* segs, int64_t nseg, int64_t total, float scale) {
  if (nseg == 0 || total == 0) return CpuResult{};
  const int64_t nblocks = (total + kBlock - 1) / kBlock;
  // Outputs beyond the last-level cache go out with non-temporal stores (a third less
  // memory traffic); smaller ones stay cached for whoever reads them next. Not for
  // many small tensors, except fp32 ones flattened back to back (the kernel then streams
  // across segment boundaries): streaming each small segment on its own leaves two partial
  // lines per boundary, which non-temporal stores handle badly (measured slower on 20k x
  // 2k-element lists).
  if (op == kCopy && total >= kStreamingElems &&
      (total / nseg >= kStreamingMinAvg || tiles_f32_range(segs, nseg)))
    op = kCopyStreaming;
  if (nblocks == 1 || omp_get_max_threads() == 1 || omp_in_parallel())
    return kRange(op, segs, nseg, total, 0, total, scale);

  if (op == kCopy || op == kCopyStreaming || op == kAccumulate || op == kScale) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b)
      kRange(op, segs, nseg, total, b * kBlock, std::min(total, (b + 1) * kBlock), scale);
    return CpuResult{};
  }
  if (op == kNonFinite) {
    std::atomic<bool> found{false};
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      if (found.load(std::memory_order_relaxed)) continue;  // early out, no sync needed
      if (kRange(op, segs, nseg, total, b * kBlock, std::min(total, (b + 1) * kBlock), scale)
              .nonfinite)
        found.store(true, std::memory_order_relaxed);
    }
    CpuResult r;
    r.nonfinite = found.load();
    return r;
  }
  // kSumSquares: one partial per block, summed in block order so the result is the same
  // for any thread count. The partials live in a reused thread-local arena.
  thread_local std::vector<double> partials;
  if (int64_t(partials.size()) < nblocks) partials.resize(size_t(nblocks));
  double* part = partials.data();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b)
    part[b] = kRange(op, segs, nseg, total, b * kBlock, std::min(total, (b + 1) * kBlock), scale)
                  .sum_squares;
  CpuResult r;
  for (int64_t b = 0; b < nblocks; ++b) r.sum_squares += part[b];
  return r;
}

}  // namespace cpu
}  // namespace megadlm
