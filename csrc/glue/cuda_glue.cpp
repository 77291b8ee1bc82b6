// Torch-facing CUDA glue of the element ops (CUDA builds only): finds or uploads the
// device segment table and launches on torch's current stream of the tensors' device.
// Also hands torch's cuBLAS handle to the weight-gradient GEMM (wgrad_gemm.cu).
//
// Device tables are cached by content. A DDP bucket passes the same table every step
// (same pointers, dtypes and layout, whatever the op), so from the second step on
// nothing is staged or uploaded: the launch reads the table already on the device.
// A lookup compares a few fields, then the whole table (memcmp: a few microseconds for
// 10k tensors). Entries are least-recently-used evicted past kMaxEntries / kMaxBytes.
// An entry keeps its pinned host copy (it is the comparison copy and the immutable
// source of the upload) and its device copy; a device copy used on another stream is
// record_stream'ed so eviction never frees it under a running kernel, and waits on the
// upload's event. A lookup returns the device tensor itself (not a raw pointer), so an
// eviction by another thread between the lookup and the launch cannot free it. Entries
// used while a stream is being captured into a CUDA graph are never evicted: the graph's
// kernels keep reading them on every replay. An entry first seen under capture is
// uploaded outside the graph (a synchronous copy on a side stream, capture mode relaxed
// for this thread), so eager calls and other graphs that hit it read a filled table. The
// upload and that ordering live in device_tables.cpp, shared with the device tables a
// TensorTable owns (no lookup at all).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>
#include <list>
#include <memory>
#include <mutex>

#include "device_tables.h"
#include "glue.h"

namespace megadlm {
namespace glue {
namespace {

constexpr size_t kMaxEntries = 256;
constexpr int64_t kMaxBytes = int64_t(64) << 20;

struct Entry {
  int device;
  int64_t nseg;
  DeviceCopy copy;  // `host` is the comparison copy, never modified after insertion
};

std::mutex g_mu;
// Most recently used first. Allocated once and never destroyed, as PyTorch does with its own
// process-lifetime caches (the caching allocator, the cuBLAS handle pool): a namespace-scope
// list would be destroyed by the exit handlers after the CUDA runtime has unloaded, and the
// destructor of an entry's CUDA tensor then throws cudaErrorCudartUnloading inside a
// destructor (std::terminate: every CUDA process ended with SIGABRT). The driver reclaims
// the memory at exit.
std::list<Entry>& g_entries = *new std::list<Entry>();
int64_t g_bytes = 0;
int64_t g_hits = 0, g_misses = 0;

bool same(const Entry& e, int device, const std::vector<Segment>& segs) {
  if (e.device != device || e.nseg != int64_t(segs.size())) return false;
  const auto* t = static_cast<const Segment*>(e.copy.host.data_ptr());
  const Segment &a = t[0], &b = segs[0], &c = t[e.nseg - 1], &d = segs.back();
  if (a.src != b.src || a.dst != b.dst || c.src != d.src || c.dst != d.dst || c.start != d.start)
    return false;
  return std::memcmp(t, segs.data(), segs.size() * sizeof(Segment)) == 0;
}

void evict_locked() {
  auto it = g_entries.end();
  while ((g_entries.size() > kMaxEntries || g_bytes > kMaxBytes) && it != g_entries.begin()) {
    --it;
    if (it->copy.graph) continue;
    g_bytes -= it->nseg * int64_t(sizeof(Segment));
    it = g_entries.erase(it);  // a still-running kernel is covered by record_stream
  }
}

// Device copy of `segs` on `device`, valid for work queued on `stream` from now on. The
// returned tensor keeps it alive until the caller's launch is queued.
at::Tensor device_table(c10::Device device, const std::vector<Segment>& segs,
                        const c10::cuda::CUDAStream& stream) {
  const bool capturing = is_capturing(stream);
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto it = g_entries.begin(); it != g_entries.end(); ++it) {
    if (!same(*it, device.index(), segs)) continue;
    g_entries.splice(g_entries.begin(), g_entries, it);
    Entry& e = g_entries.front();
    prepare_read(e.copy, stream, capturing);
    ++g_hits;
    return e.copy.dev;
  }
  ++g_misses;
  g_entries.push_front(Entry{device.index(), int64_t(segs.size()),
                             upload_segments(device, segs, stream, capturing)});
  at::Tensor dev = g_entries.front().copy.dev;  // eviction below may drop the entry itself
  g_bytes += int64_t(segs.size() * sizeof(Segment));
  evict_locked();
  return dev;
}

}  // namespace

at::Tensor cuda_run(OpKind op, c10::Device device, const std::vector<Segment>& segs, int64_t total,
                    float scale) {
  c10::cuda::CUDAGuard guard(device);
  if (total == 0 && op != kSumSquares && op != kNonFinite) return at::Tensor();
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  // Held until the launch is queued (stream order then protects the bytes).
  const at::Tensor table_keep = segs.empty() ? at::Tensor() : device_table(device, segs, stream);
  const Segment* table =
      segs.empty() ? nullptr : static_cast<const Segment*>(table_keep.data_ptr());
  return cuda_launch(op, device, table, int64_t(segs.size()),
                     uniform_pair(segs.data(), int64_t(segs.size())), total, scale);
}

at::Tensor cuda_launch(OpKind op, c10::Device device, const Segment* table, int64_t nseg,
                       int32_t pair, int64_t total, float scale) {
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  const auto on_dev = at::TensorOptions().device(device);
  at::Tensor out;
  if (op == kSumSquares) out = at::empty({}, on_dev.dtype(at::kFloat));
  if (op == kNonFinite) out = at::empty({}, on_dev.dtype(at::kInt));
  if (total == 0 && !out.defined()) return out;
  at::Tensor workspace;
  if (const int64_t wb = cuda::workspace_bytes(op))
    workspace = at::empty({wb}, on_dev.dtype(at::kByte));
  cuda::run(op, pair, table, nseg, total, scale,
            workspace.defined() ? workspace.data_ptr() : nullptr,
            out.defined() ? out.data_ptr() : nullptr, stream.stream());
  return out;
}

std::tuple<int64_t, int64_t, int64_t> table_cache_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return {g_hits, g_misses, int64_t(g_entries.size())};
}

void clear_table_cache() {
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto it = g_entries.begin(); it != g_entries.end();) {
    if (it->copy.graph) {
      ++it;
      continue;
    }
    g_bytes -= it->nseg * int64_t(sizeof(Segment));
    it = g_entries.erase(it);
  }
  g_hits = g_misses = 0;
}

at::Tensor cached_device_table(c10::Device device, const std::vector<Segment>& rows) {
  return device_table(device, rows, c10::cuda::getCurrentCUDAStream(device.index()));
}

int grid_for(OpKind op, c10::Device device, const std::vector<Segment>& segs, int64_t total) {
  c10::cuda::CUDAGuard guard(device);
  return cuda::grid_for(op, uniform_pair(segs.data(), int64_t(segs.size())), total);
}

void cuda_wgrad_accumulate(at::Tensor& main_grad, const at::Tensor& grad_output,
                           const at::Tensor& input, float alpha) {
  c10::cuda::CUDAGuard guard(main_grad.device());
  // torch binds its handle to the current stream (and its workspace) on every fetch.
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const at::ScalarType st = grad_output.scalar_type();
  const int32_t dt = st == at::kFloat ? kF32 : st == at::kBFloat16 ? kBF16 : kF16;
  cuda::wgrad_gemm_accumulate(handle, dt, grad_output.data_ptr(), input.data_ptr(),
                              main_grad.data_ptr<float>(), grad_output.size(0), main_grad.size(0),
                              main_grad.size(1), alpha);
}

void cuda_grouped_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& batch_sizes,
                       at::Tensor& out, bool trans_a, bool trans_b, bool accumulate, float alpha) {
  c10::cuda::CUDAGuard guard(out.device());
  auto code = [](at::ScalarType st) {
    return st == at::kFloat ? kF32 : st == at::kBFloat16 ? kBF16 : kF16;
  };
  const int64_t* sizes = batch_sizes.data_ptr<int64_t>();
  const int64_t groups = batch_sizes.numel();
  if (trans_a && !accumulate)  // a group without rows gets no GEMM: its block is zero
    for (int64_t g = 0; g < groups; ++g)
      if (sizes[g] == 0) out.select(0, g).zero_();
  const int64_t k = a.size(1);
  const int64_t n = trans_a ? b.size(1) : (trans_b ? b.size(1) : b.size(2));
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  cuda::grouped_gemm(handle, code(a.scalar_type()), code(out.scalar_type()), a.data_ptr(),
                     b.data_ptr(), out.data_ptr(), sizes, groups, k, n, trans_a, trans_b, alpha,
                     accumulate ? 1.0f : 0.0f);
}

}  // namespace glue
}  // namespace megadlm
