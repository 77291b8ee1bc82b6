// CUDA kernels of the fused transformer ops: raw pointers, a params struct and a
// cudaStream_t (no torch headers; the glue, csrc/glue/fused_glue.cpp, passes torch's current
// stream). The per-thread work is fused_kernels.cuh (also run by the host emulation); here
// are the __global__ wrappers, the block reduction between the phases of a norm row, and
// the launch shapes.
//
// Every kernel is one pass at memory bandwidth: a block per row (rope: per position, all
// heads), rows grid-strided, 8 elements per thread-step with 16-byte loads/stores when the
// row length and every pointer and row stride allow (else the scalar build, any strides),
// fp32 math, one rounding into the output, no host sync and no allocation (the glue
// allocates the outputs and the weight-gradient partials). The RMSNorm weight gradient is
// per-block partials (each thread owns the same columns in every row of its block, kept in
// shared memory) summed in block order by a second small kernel: deterministic, no atomics.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "megadlm/fused.h"
#include "fused_kernels.cuh"

namespace megadlm {
namespace fused {
namespace cuda {
namespace {

namespace dev = megadlm::cuda::fused_dev;

using dev::kMaxThreads;

// ---- kernels ------------------------------------------------------------------------------
template <class S, int V>
__global__ void __launch_bounds__(kMaxThreads) megadlm_rope_kernel(RopeParams p) {
  dev::rope_block<S, V>(p);
}

template <class S, int V, bool kForward>
__global__ void __launch_bounds__(kMaxThreads) megadlm_swiglu_kernel(SwigluParams p) {
  dev::swiglu_block<S, V, kForward>(p);
}

// Sum of `v` over the block, returned to every thread. The first barrier keeps a warp from
// overwriting `warp_sums` while another still reads the previous row's values.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kMaxThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  const int warps = int(blockDim.x + 31) / 32;
  float t = int(threadIdx.x & 31) < warps ? warp_sums[threadIdx.x & 31] : 0.f;
  for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
  return t;
}

template <class S, int V>
__global__ void __launch_bounds__(kMaxThreads) megadlm_add_rmsnorm_fwd_kernel(AddNormFwdParams p) {
  for (int64_t m = blockIdx.x; m < p.M; m += gridDim.x)
    dev::add_norm_fwd_out<S, V>(p, m, block_sum(dev::add_norm_fwd_sum<S, V>(p, m)));
}

template <class S, int V>
__global__ void __launch_bounds__(kMaxThreads) megadlm_add_rmsnorm_bwd_kernel(AddNormBwdParams p) {
  extern __shared__ float dw[];  // H floats: this block's weight-gradient partial
  dev::add_norm_dw_zero<V>(dw, p.H);
  for (int64_t m = blockIdx.x; m < p.M; m += gridDim.x)
    dev::add_norm_bwd_out<S, V>(p, m, block_sum(dev::add_norm_bwd_dot<S, V>(p, m)), dw);
  dev::add_norm_dw_store<V>(p, dw);
}

template <class S>
__global__ void megadlm_add_rmsnorm_dw_kernel(AddNormBwdParams p, int64_t blocks) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < p.H;
       c += int64_t(gridDim.x) * blockDim.x)
    dev::add_norm_dw_column<S>(p, blocks, c);
}

// ---- launch helpers ------------------------------------------------------------------------
void check_launch(const char* op, int64_t grid, int threads) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("megadlm_ext CUDA ") + op + " kernel launch failed (" +
                             std::to_string(grid) + " blocks x " + std::to_string(threads) +
                             " threads): " + cudaGetErrorString(e));
}

// An error left pending by earlier asynchronous work would surface at our launch check and be
// blamed on this op: report it as what it is.
void check_prior(const char* op) {
  const cudaError_t prior = cudaGetLastError();
  if (prior != cudaSuccess)
    throw std::runtime_error(
        std::string("megadlm_ext CUDA: an error from earlier work on this device was pending "
                    "before ") +
        op + " ran (not raised by megadlm_ext): " + cudaGetErrorString(prior) +
        ". Run with CUDA_LAUNCH_BLOCKING=1 to find the failing call");
}

}  // namespace

void rope(const RopeParams& p, void* stream) {
  if (p.B * p.S == 0 || p.H == 0 || p.D == 0) return;
  check_prior("rope");
  const bool vec = dev::rope_vectorizable(p);
  const int64_t grid = dev::rows_grid(p.B * p.S);
  const int threads = dev::row_threads(p.H * (vec ? p.D / 2 / kVec : p.D / 2));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  with_type(p.dtype, [&](auto s) {
    using S = decltype(s);
    if (vec)
      megadlm_rope_kernel<S, kVec><<<unsigned(grid), threads, 0, st>>>(p);
    else
      megadlm_rope_kernel<S, 1><<<unsigned(grid), threads, 0, st>>>(p);
  });
  check_launch("rope", grid, threads);
}

namespace {
template <bool kForward>
void swiglu(const SwigluParams& p, void* stream, const char* op) {
  if (p.M == 0 || p.F == 0) return;
  check_prior(op);
  const bool vec = dev::swiglu_vectorizable(p, kForward);
  const int64_t grid = dev::rows_grid(p.M);
  const int threads = dev::row_threads(vec ? p.F / kVec : p.F);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  with_type(p.dtype, [&](auto s) {
    using S = decltype(s);
    if (vec)
      megadlm_swiglu_kernel<S, kVec, kForward><<<unsigned(grid), threads, 0, st>>>(p);
    else
      megadlm_swiglu_kernel<S, 1, kForward><<<unsigned(grid), threads, 0, st>>>(p);
  });
  check_launch(op, grid, threads);
}
}  // namespace

void swiglu_fwd(const SwigluParams& p, void* stream) {
  swiglu<true>(p, stream, "swiglu");
}

void swiglu_bwd(const SwigluParams& p, void* stream) {
  swiglu<false>(p, stream, "swiglu_backward");
}

void add_rmsnorm_fwd(const AddNormFwdParams& p, void* stream) {
  if (p.M == 0 || p.H == 0) return;
  check_prior("add_rmsnorm");
  const void* ptrs[] = {p.x, p.h, p.w, p.sum, p.y};
  const bool vec = dev::norm_vectorizable(p.H, ptrs, 5);
  const int64_t grid = dev::rows_grid(p.M);
  const int threads = dev::row_threads(vec ? p.H / kVec : p.H);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  with_type(p.dtype, [&](auto s) {
    using S = decltype(s);
    if (vec)
      megadlm_add_rmsnorm_fwd_kernel<S, kVec><<<unsigned(grid), threads, 0, st>>>(p);
    else
      megadlm_add_rmsnorm_fwd_kernel<S, 1><<<unsigned(grid), threads, 0, st>>>(p);
  });
  check_launch("add_rmsnorm", grid, threads);
}

int64_t add_rmsnorm_bwd_blocks(int64_t M, int64_t H, int sms) {
  return dev::add_rmsnorm_bwd_blocks(M, H, sms);
}

namespace {
// Dynamic shared memory of the backward kernel (H floats); above the default 48 KiB the
// kernel is allowed more (H > 12288), up to what the device offers.
template <class K>
void allow_shared(K kernel, int64_t bytes) {
  if (bytes <= 48 * 1024) return;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e != cudaSuccess)
    throw std::runtime_error(
        "megadlm_ext CUDA add_rmsnorm_backward: hidden size needs " + std::to_string(bytes) +
        " bytes of shared memory for the weight-gradient partial: " + cudaGetErrorString(e));
}
}  // namespace

void add_rmsnorm_bwd(const AddNormBwdParams& p, int sms, void* stream) {
  if (p.H == 0) return;
  check_prior("add_rmsnorm_backward");
  const void* ptrs[] = {p.grad_sum, p.grad_y, p.sum, p.w, p.grad_x};
  const bool vec = dev::norm_vectorizable(p.H, ptrs, 5);
  const int64_t blocks = p.M == 0 ? 0 : dev::add_rmsnorm_bwd_blocks(p.M, p.H, sms);
  const int threads = dev::row_threads(vec ? p.H / kVec : p.H);
  const int64_t smem = p.H * int64_t(sizeof(float));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  with_type(p.dtype, [&](auto s) {
    using S = decltype(s);
    if (blocks > 0) {
      if (vec) {
        allow_shared(megadlm_add_rmsnorm_bwd_kernel<S, kVec>, smem);
        megadlm_add_rmsnorm_bwd_kernel<S, kVec><<<unsigned(blocks), threads, smem, st>>>(p);
      } else {
        allow_shared(megadlm_add_rmsnorm_bwd_kernel<S, 1>, smem);
        megadlm_add_rmsnorm_bwd_kernel<S, 1><<<unsigned(blocks), threads, smem, st>>>(p);
      }
      check_launch("add_rmsnorm_backward", blocks, threads);
    }
    const int64_t cols = (p.H + kMaxThreads - 1) / kMaxThreads;
    megadlm_add_rmsnorm_dw_kernel<S><<<unsigned(cols), kMaxThreads, 0, st>>>(p, blocks);
    check_launch("add_rmsnorm_backward (weight gradient)", cols, kMaxThreads);
  });
}

}  // namespace cuda
}  // namespace fused
}  // namespace megadlm
