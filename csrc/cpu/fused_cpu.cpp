// CPU kernels of the fused transformer ops (megadlm/fused.h): the per-element math of the GPU
// kernels, over rows spread on the OpenMP team (the same libgomp as torch, so
// torch.set_num_threads applies). The model never runs these in training -- on CPU it takes
// the unfused torch ops, bitwise what it always did -- they are the compiled CPU route of the
// ops, which tests force and compare with the unfused model. Row statistics are summed in
// double; the RMSNorm weight gradient sums fp32 partials of kDwRows rows in block order, so
// no result depends on the thread count.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "megadlm/fused.h"

namespace megadlm {
namespace fused {
namespace cpu {
namespace {

constexpr int64_t kDwRows = 64;  // rows per weight-gradient partial
// Below this many elements a call runs on the calling thread: waking the team costs more than
// the work (cpu_run.cpp's block size).
constexpr int64_t kParallelMin = int64_t(1) << 16;

// f(r) for rows [0, rows) of `row_elems` elements each.
template <class F>
void parallel_rows(int64_t rows, int64_t row_elems, F&& f) {
  if (rows <= 1 || rows * row_elems < kParallelMin || omp_get_max_threads() == 1 ||
      omp_in_parallel()) {
    for (int64_t r = 0; r < rows; ++r) f(r);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) f(r);
}

template <class S>
void rope_typed(const RopeParams& p) {
  const int64_t half = p.D / 2;
  parallel_rows(p.B * p.S * p.H, p.D, [&](int64_t row) {
    const int64_t h = row % p.H, bs = row / p.H, s = bs % p.S, b = bs / p.S;
    const int64_t xo = b * p.xs[0] + s * p.xs[1] + h * p.xs[2], oo = row * p.D;
    const int64_t co = b * p.cs[0] + s * p.cs[1], so = b * p.ss[0] + s * p.ss[1];
    for (int64_t i = 0; i < half; ++i) {
      float o1, o2;
      rope_pair(get<S>(p.x, xo + i * p.xs[3]), get<S>(p.x, xo + (i + half) * p.xs[3]),
                p.cos[co + i * p.cs[2]], p.cos[co + (i + half) * p.cs[2]], p.sin[so + i * p.ss[2]],
                p.sin[so + (i + half) * p.ss[2]], p.backward != 0, &o1, &o2);
      put<S>(p.out, oo + i, o1);
      put<S>(p.out, oo + half + i, o2);
    }
  });
}

template <class S>
void swiglu_fwd_typed(const SwigluParams& p) {
  parallel_rows(p.M, 3 * p.F, [&](int64_t m) {
    const int64_t in = m * 2 * p.F, out = m * p.F;
    for (int64_t j = 0; j < p.F; ++j)
      put<S>(p.out, out + j, swiglu_value(get<S>(p.in, in + j), get<S>(p.in, in + p.F + j)));
  });
}

template <class S>
void swiglu_bwd_typed(const SwigluParams& p) {
  parallel_rows(p.M, 5 * p.F, [&](int64_t m) {
    const int64_t in = m * 2 * p.F, go = m * p.F;
    for (int64_t j = 0; j < p.F; ++j) {
      float dg, du;
      swiglu_grads(get<S>(p.in, in + j), get<S>(p.in, in + p.F + j), get<S>(p.grad, go + j), &dg,
                   &du);
      put<S>(p.out, in + j, dg);
      put<S>(p.out, in + p.F + j, du);
    }
  });
}

template <class S>
void add_rmsnorm_fwd_typed(const AddNormFwdParams& p) {
  parallel_rows(p.M, 4 * p.H, [&](int64_t m) {
    const int64_t row = m * p.H;
    double sum_sq = 0.0;
    for (int64_t j = 0; j < p.H; ++j) {
      const float s = round_to<S>(get<S>(p.x, row + j) + get<S>(p.h, row + j));
      put<S>(p.sum, row + j, s);
      sum_sq += double(s) * double(s);
    }
    const float r = rms_rstd(float(sum_sq), p.H, p.eps);
    p.rstd[m] = r;
    for (int64_t j = 0; j < p.H; ++j)
      put<S>(p.y, row + j, get<S>(p.sum, row + j) * r * get<S>(p.w, j));
  });
}

// Rows [m0, m1) of the backward: grad_x, and grad_y * n summed into `dw` (H floats).
template <class S>
void add_rmsnorm_bwd_rows(const AddNormBwdParams& p, int64_t m0, int64_t m1, float* dw) {
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t row = m * p.H;
    const float r = p.rstd[m];
    double dot = 0.0;
    for (int64_t j = 0; j < p.H; ++j)
      dot += double(get<S>(p.grad_y, row + j) * get<S>(p.w, j) * (get<S>(p.sum, row + j) * r));
    const float mean_dot = float(dot) / float(p.H);
    for (int64_t j = 0; j < p.H; ++j) {
      const float gy = get<S>(p.grad_y, row + j), n = get<S>(p.sum, row + j) * r;
      put<S>(p.grad_x, row + j,
             rms_grad_input(get<S>(p.grad_sum, row + j), gy * get<S>(p.w, j), n, r, mean_dot));
      dw[j] += gy * n;
    }
  }
}

template <class S>
void add_rmsnorm_bwd_typed(const AddNormBwdParams& p) {
  const int64_t blocks = (p.M + kDwRows - 1) / kDwRows;
  std::vector<float> partial(size_t(blocks * p.H), 0.f);
  parallel_rows(blocks, kDwRows * 5 * p.H, [&](int64_t b) {
    add_rmsnorm_bwd_rows<S>(p, b * kDwRows, std::min(p.M, (b + 1) * kDwRows),
                            partial.data() + b * p.H);
  });
  for (int64_t j = 0; j < p.H; ++j) {
    double t = 0.0;
    for (int64_t b = 0; b < blocks; ++b) t += double(partial[size_t(b * p.H + j)]);
    put<S>(p.grad_w, j, float(t));
  }
}

}  // namespace

void rope(const RopeParams& p) {
  with_type(p.dtype, [&](auto s) { rope_typed<decltype(s)>(p); });
}

void swiglu_fwd(const SwigluParams& p) {
  with_type(p.dtype, [&](auto s) { swiglu_fwd_typed<decltype(s)>(p); });
}

void swiglu_bwd(const SwigluParams& p) {
  with_type(p.dtype, [&](auto s) { swiglu_bwd_typed<decltype(s)>(p); });
}

void add_rmsnorm_fwd(const AddNormFwdParams& p) {
  with_type(p.dtype, [&](auto s) { add_rmsnorm_fwd_typed<decltype(s)>(p); });
}

void add_rmsnorm_bwd(const AddNormBwdParams& p) {
  with_type(p.dtype, [&](auto s) { add_rmsnorm_bwd_typed<decltype(s)>(p); });
}

}  // namespace cpu
}  // namespace fused
}  // namespace megadlm
