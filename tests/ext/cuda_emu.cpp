// Host emulation of the CUDA kernels' device code (csrc/cuda/multi_tensor_kernels.cuh):
// the very functions the GPU runs, with blocks and threads executed as loops on one CPU
// thread. Lets CI check the chunking, the segment walk, the alignment heads/tails and
// the 16-byte vector paths of the CUDA kernels without a GPU (tests/ext/test_cuda_emulation.py
// builds this with g++ and calls emu_run through ctypes). Not part of the package.
#include <cstdint>
#include <cstring>

#include "cuda_shims.h"
#include "megadlm/multi_tensor.h"
#include "../../csrc/cuda/multi_tensor_kernels.cuh"

using namespace megadlm;
using namespace megadlm::cuda;

template <int OP, class S, class D>
static void run_grid(const Segment* segs, int64_t nseg, int64_t total, float scale, int grid,
                     double* sum, int* flag) {
  gridDim.x = unsigned(grid);
  blockDim.x = kThreads;
  for (int b = 0; b < grid; ++b) {
    blockIdx.x = unsigned(b);
    for (int t = 0; t < kThreads; ++t) {
      threadIdx.x = unsigned(t);
      Acc acc;
      block_range<OP, S, D>(segs, nseg, total, scale, flag, acc);
      *sum += acc.sum;
      if (acc.bad) *flag = 1;
    }
  }
}

// The kernel the launcher picks: typed on the list's uniform (src, dst) pair, or the
// per-segment dispatching one (mixed lists; `force_mixed` runs it on any list).
template <int OP>
static void run_op(const Segment* segs, int64_t nseg, int64_t total, float scale, int grid,
                   int force_mixed, double* sum, int* flag) {
  const int32_t pair = force_mixed ? kMixedPair : uniform_pair(segs, nseg);
  with_kernel_types<OP>(pair, [&](auto s, auto d) {
    run_grid<OP, decltype(s), decltype(d)>(segs, nseg, total, scale, grid, sum, flag);
  });
}

extern "C" int emu_run(int op, const Segment* segs, int64_t nseg, int64_t total, float scale,
                       int grid, int force_mixed, double* sum, int* flag) {
  *sum = 0.0;
  *flag = 0;
  switch (op) {
    case kCopy: run_op<kCopy>(segs, nseg, total, scale, grid, force_mixed, sum, flag); return 0;
    case kAccumulate:
      run_op<kAccumulate>(segs, nseg, total, scale, grid, force_mixed, sum, flag);
      return 0;
    case kScale: run_op<kScale>(segs, nseg, total, scale, grid, force_mixed, sum, flag); return 0;
    case kSumSquares:
      run_op<kSumSquares>(segs, nseg, total, scale, grid, force_mixed, sum, flag);
      return 0;
    case kNonFinite:
      run_op<kNonFinite>(segs, nseg, total, scale, grid, force_mixed, sum, flag);
      return 0;
    default: return 1;
  }
}

// The pair code the launcher would pass for this table (-1: mixed).
extern "C" int emu_uniform_pair(const Segment* segs, int64_t nseg) {
  return uniform_pair(segs, nseg);
}

// The even split of `chunks` over `grid` blocks: chunk range of block b.
extern "C" void emu_block_chunks(int64_t chunks, int64_t grid, int64_t b, int64_t* c0,
                                 int64_t* c1) {
  block_chunks(chunks, grid, b, c0, c1);
}

// The launcher's grid for `total` elements given an occupancy and SM count.
extern "C" int emu_grid_size(int64_t total, int blocks_per_sm, int sms, int64_t cap) {
  return grid_size((total + kChunk - 1) / kChunk, blocks_per_sm, sms, cap);
}

extern "C" int64_t emu_chunk() {
  return kChunk;
}
