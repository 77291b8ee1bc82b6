// Host emulation of the fused AdamW step's device code (csrc/cuda/adam_kernels.cuh): the
// very functions the GPU runs, blocks and threads executed as loops on one CPU thread, so
// CI checks the chunking, the walk over the AdamTensor table, the alignment heads/tails and
// the 8-element vector path without a GPU (tests/ext/test_adam_emulation.py builds this
// with g++ and calls it through ctypes). Not part of the package.
#include "cuda_shims.h"
#include "megadlm/adam.h"
#include "../../csrc/cuda/adam_kernels.cuh"

using namespace megadlm;
using namespace megadlm::cuda;

namespace {
AdamDTypes dtypes_of(const int32_t* d) {
  return AdamDTypes{d[0], d[1], d[2], d[3]};
}
}  // namespace

// The typed kernel adam_run would launch for these dtypes, on `grid` emulated blocks.
extern "C" void emu_adam(const AdamTensor* table, int64_t n, int64_t total, const int32_t* dtypes,
                         double lr, double beta1, double beta2, double eps, double wd, int64_t step,
                         int grid) {
  const AdamScalars s = adam_scalars(lr, beta1, beta2, eps, wd, step);
  with_adam_types(dtypes_of(dtypes), [&](auto g, auto m, auto v, auto p) {
    gridDim.x = unsigned(grid);
    blockDim.x = kThreads;
    for (int b = 0; b < grid; ++b) {
      blockIdx.x = unsigned(b);
      for (int t = 0; t < kThreads; ++t) {
        threadIdx.x = unsigned(t);
        adam_block_range<decltype(g), decltype(m), decltype(v), decltype(p)>(table, n, total, s);
      }
    }
  });
}

// The scalar head before the vector path of row `t` from element a (-1: scalar throughout).
extern "C" int emu_adam_head(const AdamTensor* t, int64_t a, const int32_t* dtypes) {
  int h = 0;
  with_adam_types(dtypes_of(dtypes), [&](auto g, auto m, auto v, auto p) {
    h = adam_head<decltype(g), decltype(m), decltype(v), decltype(p)>(*t, a);
  });
  return h;
}

extern "C" int64_t emu_adam_row_bytes() {
  return int64_t(sizeof(AdamTensor));
}
