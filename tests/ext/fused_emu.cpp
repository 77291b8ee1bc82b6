// Host emulation of the fused transformer ops' CUDA device code (csrc/cuda/fused_kernels.cuh):
// the very per-thread functions and launch plans the GPU kernels use, with blocks and threads
// run as loops on one CPU thread and the block reduction between the phases of a norm row a
// plain sum (the GPU's is a warp-shuffle tree: the order differs, not the math). Lets CI check
// the indexing, the strided and vector paths, the row ownership and the weight-gradient
// partials without a GPU (tests/ext/test_fused_emulation.py builds this with g++ and calls it
// through ctypes). Not part of the package.
//
// Every entry point takes the launcher's plan (`scalar` = 0: vectors where the launcher would
// take them) or forces the scalar build (`scalar` = 1), and returns 1 if the vector build ran.
#include <cstdint>
#include <vector>

#include "cuda_shims.h"
#include "megadlm/fused.h"
#include "../../csrc/cuda/fused_kernels.cuh"

using namespace megadlm;
using namespace megadlm::fused;
namespace dev = megadlm::cuda::fused_dev;

// body() for every thread of every block of a (grid, threads) launch.
template <class F>
static void each_thread(int64_t grid, int threads, F&& body) {
  gridDim.x = unsigned(grid);
  blockDim.x = unsigned(threads);
  for (int64_t b = 0; b < grid; ++b) {
    blockIdx.x = unsigned(b);
    for (int t = 0; t < threads; ++t) {
      threadIdx.x = unsigned(t);
      body();
    }
  }
}

template <class F>
static void each_thread_of_block(int threads, F&& body) {
  for (int t = 0; t < threads; ++t) {
    threadIdx.x = unsigned(t);
    body();
  }
}

extern "C" int emu_rope(const void* x, void* out, const float* cos, const float* sin,
                        const int64_t* sizes, const int64_t* xs, const int64_t* cs,
                        const int64_t* ss, int dtype, int backward, int scalar, int64_t grid) {
  RopeParams p{x,        out, cos, sin, sizes[0], sizes[1], sizes[2],
               sizes[3], {},  {},  {},  dtype,    backward};
  for (int d = 0; d < 4; ++d) p.xs[d] = xs[d];
  for (int d = 0; d < 3; ++d) p.cs[d] = cs[d], p.ss[d] = ss[d];
  const bool vec = !scalar && dev::rope_vectorizable(p);
  const int threads = dev::row_threads(p.H * (vec ? p.D / 2 / kVec : p.D / 2));
  if (grid <= 0) grid = dev::rows_grid(p.B * p.S);
  with_type(dtype, [&](auto s) {
    using S = decltype(s);
    each_thread(grid, threads, [&] {
      if (vec)
        dev::rope_block<S, kVec>(p);
      else
        dev::rope_block<S, 1>(p);
    });
  });
  return vec;
}

extern "C" int emu_swiglu(const void* in, const void* grad, void* out, int64_t M, int64_t F,
                          int dtype, int forward, int scalar, int64_t grid) {
  const SwigluParams p{in, grad, out, M, F, dtype};
  const bool vec = !scalar && dev::swiglu_vectorizable(p, forward != 0);
  const int threads = dev::row_threads(vec ? F / kVec : F);
  if (grid <= 0) grid = dev::rows_grid(M);
  with_type(dtype, [&](auto s) {
    using S = decltype(s);
    each_thread(grid, threads, [&] {
      if (vec && forward) dev::swiglu_block<S, kVec, true>(p);
      if (vec && !forward) dev::swiglu_block<S, kVec, false>(p);
      if (!vec && forward) dev::swiglu_block<S, 1, true>(p);
      if (!vec && !forward) dev::swiglu_block<S, 1, false>(p);
    });
  });
  return vec;
}

template <class S, int V>
static void add_norm_fwd_grid(const AddNormFwdParams& p, int64_t grid, int threads) {
  gridDim.x = unsigned(grid);
  blockDim.x = unsigned(threads);
  for (int64_t b = 0; b < grid; ++b) {
    blockIdx.x = unsigned(b);
    for (int64_t m = b; m < p.M; m += grid) {
      float total = 0.f;  // the block reduction
      each_thread_of_block(threads, [&] { total += dev::add_norm_fwd_sum<S, V>(p, m); });
      each_thread_of_block(threads, [&] { dev::add_norm_fwd_out<S, V>(p, m, total); });
    }
  }
}

extern "C" int emu_add_rmsnorm(const void* x, const void* h, const void* w, void* sum, void* y,
                               float* rstd, int64_t M, int64_t H, float eps, int dtype, int scalar,
                               int64_t grid) {
  const AddNormFwdParams p{x, h, w, sum, y, rstd, M, H, eps, dtype};
  const void* ptrs[] = {x, h, w, sum, y};
  const bool vec = !scalar && dev::norm_vectorizable(H, ptrs, 5);
  const int threads = dev::row_threads(vec ? H / kVec : H);
  if (grid <= 0) grid = dev::rows_grid(M);
  with_type(dtype, [&](auto s) {
    using S = decltype(s);
    if (vec)
      add_norm_fwd_grid<S, kVec>(p, grid, threads);
    else
      add_norm_fwd_grid<S, 1>(p, grid, threads);
  });
  return vec;
}

template <class S, int V>
static void add_norm_bwd_grid(const AddNormBwdParams& p, int64_t blocks, int threads) {
  gridDim.x = unsigned(blocks);
  blockDim.x = unsigned(threads);
  std::vector<float> dw(size_t(p.H));  // the block's shared memory
  for (int64_t b = 0; b < blocks; ++b) {
    blockIdx.x = unsigned(b);
    each_thread_of_block(threads, [&] { dev::add_norm_dw_zero<V>(dw.data(), p.H); });
    for (int64_t m = b; m < p.M; m += blocks) {
      float dot = 0.f;  // the block reduction
      each_thread_of_block(threads, [&] { dot += dev::add_norm_bwd_dot<S, V>(p, m); });
      each_thread_of_block(threads, [&] { dev::add_norm_bwd_out<S, V>(p, m, dot, dw.data()); });
    }
    each_thread_of_block(threads, [&] { dev::add_norm_dw_store<V>(p, dw.data()); });
  }
  for (int64_t c = 0; c < p.H; ++c) dev::add_norm_dw_column<S>(p, blocks, c);
}

// `partial` holds emu_add_rmsnorm_bwd_blocks(M, H, sms) * H floats (or blocks * H with
// blocks > 0 given).
extern "C" int emu_add_rmsnorm_backward(const void* grad_sum, const void* grad_y, const void* sum,
                                        const void* w, const float* rstd, void* grad_x,
                                        float* partial, void* grad_w, int64_t M, int64_t H,
                                        int dtype, int scalar, int64_t blocks, int sms) {
  const AddNormBwdParams p{grad_sum, grad_y, sum, w, rstd, grad_x, partial, grad_w, M, H, dtype};
  const void* ptrs[] = {grad_sum, grad_y, sum, w, grad_x};
  const bool vec = !scalar && dev::norm_vectorizable(H, ptrs, 5);
  const int threads = dev::row_threads(vec ? H / kVec : H);
  if (blocks <= 0) blocks = dev::add_rmsnorm_bwd_blocks(M, H, sms);
  with_type(dtype, [&](auto s) {
    using S = decltype(s);
    if (vec)
      add_norm_bwd_grid<S, kVec>(p, blocks, threads);
    else
      add_norm_bwd_grid<S, 1>(p, blocks, threads);
  });
  return vec;
}

extern "C" int64_t emu_add_rmsnorm_bwd_blocks(int64_t M, int64_t H, int sms) {
  return dev::add_rmsnorm_bwd_blocks(M, H, sms);
}

extern "C" int emu_row_threads(int64_t vectors) {
  return dev::row_threads(vectors);
}
