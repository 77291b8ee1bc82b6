// Host-side launch helpers shared by the .cu files (raw CUDA runtime, no torch): error
// checks and the cached occupancy query that sizes the one-wave grids.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace megadlm {
namespace cuda {

inline void check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw std::runtime_error("megadlm_ext CUDA " + what + " failed: " + cudaGetErrorString(e));
}

// An error left pending by earlier asynchronous work would otherwise surface at our
// launch check and be blamed on `op`: report it as what it is, before launching.
inline void check_pending(const std::string& op) {
  const cudaError_t prior = cudaGetLastError();
  if (prior != cudaSuccess)
    throw std::runtime_error(
        "megadlm_ext CUDA: an error from earlier work on this device was pending before " + op +
        " ran (not raised by megadlm_ext): " + cudaGetErrorString(prior) +
        ". Run with CUDA_LAUNCH_BLOCKING=1 to find the failing call");
}

// SM count and resident blocks per SM of `kernel` (launched with `threads` threads) on the
// current device, cached: the occupancy query costs microseconds, a launch is on the hot
// path.
inline std::pair<int, int> occupancy(const void* kernel, int threads) {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  static std::mutex m;
  static std::map<std::pair<const void*, int>, std::pair<int, int>> cache;
  std::lock_guard<std::mutex> lock(m);
  auto it = cache.find({kernel, dev});
  if (it != cache.end()) return it->second;
  int sms = 0, per_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
        "cudaDeviceGetAttribute");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return cache[{kernel, dev}] = {sms, per_sm};
}

}  // namespace cuda
}  // namespace megadlm
