// Torch-facing CUDA glue (compiled only in CUDA builds, -DMEGADLM_WITH_CUDA): turns a
// segment table into a device table (a content cache for lists, an owned copy for
// TensorTables) and calls the raw-pointer launchers of csrc/cuda on torch's current
// stream; hosts the NCCL communicator class.
#pragma once

#include "../torch_headers.h"

#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "megadlm/kernels.h"

namespace megadlm {
namespace glue {

// Run `op` over the table on `device`'s current stream. Elementwise ops return an
// undefined tensor; kSumSquares returns the 0-d fp32 norm (sqrt applied) and
// kNonFinite a 0-d int32 flag, both on the device (no host sync here).
at::Tensor cuda_run(OpKind op, c10::Device device, const std::vector<Segment>& segs, int64_t total,
                    float scale);

// Launch `op` over a segment table already on the device (`table`, `nseg` segments whose
// uniform pair is `pair`) on `device`'s current stream; the result as for cuda_run. The
// caller keeps `table` alive until this returns (stream order protects it after that).
at::Tensor cuda_launch(OpKind op, c10::Device device, const Segment* table, int64_t nseg,
                       int32_t pair, int64_t total, float scale);

// The device copy of a segment table owned by its user (a TensorTable's BuiltTable):
// freed with its owner, but kept for good once a captured CUDA graph reads it (the graph
// may be replayed after the owner is gone). See device_tables.cpp.
struct DeviceTable;
// cuda_run over `segs` (uniform pair `pair`) reading the owner's device copy `*dev`,
// uploaded at the first call (under `mu`): no lookup and no upload after that.
at::Tensor cuda_run_owned(OpKind op, c10::Device device, const std::vector<Segment>& segs,
                          int32_t pair, int64_t total, float scale, std::mutex& mu,
                          std::shared_ptr<DeviceTable>& dev);

// The device segment-table cache (see cuda_glue.cpp): (hits, misses, entries); clear
// drops every entry not held by a captured CUDA graph. For tests and benchmarks.
std::tuple<int64_t, int64_t, int64_t> table_cache_stats();
void clear_table_cache();
// The device-table cache for another kernel's table (the fused AdamW step's), given as
// rows of sizeof(Segment) bytes: the cache compares bytes, whatever the rows mean. Returns
// the device copy on `device`, valid for work queued on its current stream from now on;
// hold it until the launch is queued.
at::Tensor cached_device_table(c10::Device device, const std::vector<Segment>& rows);
// Blocks of the element kernel `cuda_run` would launch for this table.
int grid_for(OpKind op, c10::Device device, const std::vector<Segment>& segs, int64_t total);

// main_grad (fp32 [out, in]) += alpha * grad_output^T @ input (both [rows, *], same dtype,
// contiguous, checked by the bindings) with cuBLAS on torch's current stream.
void cuda_wgrad_accumulate(at::Tensor& main_grad, const at::Tensor& grad_output,
                           const at::Tensor& input, float alpha);

// Grouped GEMM of the MoE experts (see cuda::grouped_gemm) with cuBLAS on torch's current
// stream; `batch_sizes` is a host int64 tensor (checked by the bindings). `out` is written
// (beta = 0; groups without rows zeroed when trans_a) or added to (accumulate).
void cuda_grouped_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& batch_sizes,
                       at::Tensor& out, bool trans_a, bool trans_b, bool accumulate, float alpha);

// Adds class NcclCommunicator(unique_id: bytes, rank, world_size, device) to `m`.
void register_nccl_communicator(pybind11::module_& m);

}  // namespace glue
}  // namespace megadlm
