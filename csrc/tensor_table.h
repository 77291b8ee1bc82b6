// TensorTable: a tensor list validated once, for tensors that persist across steps
// (parameters, main-grad buffers, optimizer state). Every op that takes a list takes a
// table too and gives bitwise the same result (same segment table, same kernels); on a
// known table an op does O(1) host work: the segment table of each (direction, flat
// buffer) is built on first use and cached in the table, and on CUDA so is its device
// copy, so an eager call is one launch.
//
// What a table assumes: its tensors keep their memory while the table is used -- no
// `.data =`, `set_`, `resize_` or `untyped_storage().resize_` on them. The table holds the
// tensors and their storages, so their memory is never freed under it by ordinary means
// (a `.data =` swap leaves the table writing the old, still-allocated storage), but a
// reallocation is invisible without reading every tensor: `validate()` does that (O(n))
// and names the first tensor that moved.
#pragma once

#include "torch_headers.h"

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor_list.h"

namespace megadlm {
namespace glue {
struct DeviceTable;  // csrc/glue/device_tables.cpp (CUDA builds)
}  // namespace glue

// The segment table of one (direction, flat buffer) key. Immutable once built, except for
// its device copy, made at the first CUDA launch.
struct BuiltTable {
  Dir dir = Dir::ReadOnly;
  const void* flat = nullptr;  // the flat buffer's first byte (nullptr: InPlace / ReadOnly)
  int32_t flat_dtype = kF32;
  int64_t flat_numel = 0;
  std::vector<Segment> segs;
  int64_t total = 0;
  int32_t pair = 0;   // uniform_pair(segs): the kernel's dtype pair
  std::mutex dev_mu;  // guards dev
  std::shared_ptr<glue::DeviceTable> dev;
};

// Hidden like pybind11's own types (it holds a py::tuple): used inside this module only.
class __attribute__((visibility("hidden"))) TensorTable {
 public:
  // Validates `tensors` (as the list path does) and `offsets` (None: packed).
  TensorTable(pybind11::handle tensors, pybind11::handle offsets);

  size_t size() const { return items_.size(); }
  c10::Device device() const { return device_; }
  int32_t common_dtype() const { return common_dtype_; }
  bool has_offsets() const { return has_offsets_; }
  int64_t numel() const { return numel_; }
  int64_t flat_numel() const { return need_; }
  pybind11::tuple tensors() const { return objs_; }
  pybind11::object offsets() const;

  // ValueError (the list path's message) if two tensors share memory: for in-place writes.
  void check_distinct() const;
  // ValueError naming the first tensor whose memory, size, dtype or layout changed.
  void validate() const;
  // True iff `obj` is a list/tuple of exactly this table's tensor objects, in order.
  bool matches(pybind11::handle obj) const;

  // The segment table for `dir` into/out of `flat` (nullptr for InPlace / ReadOnly),
  // cached (LRU) unless `cache` is false; on a miss the range and alias checks of the list
  // path run against `flat` (named `flat_name`).
  std::shared_ptr<BuiltTable> built(Dir dir, const at::Tensor* flat, const char* flat_name,
                                    bool cache = true);
  std::tuple<int64_t, int64_t, int64_t> cache_stats() const;  // (hits, misses, entries)

  // Drops every reference (the garbage collector's tp_clear): the table is then empty.
  void clear();
  PyObject* objects() const { return objs_.ptr(); }

 private:
  pybind11::tuple objs_;                // the tensors (strong references)
  std::vector<c10::Storage> storages_;  // their storages, kept even if a tensor's is swapped
  std::vector<Item> items_;
  std::vector<int64_t> offsets_;
  c10::Device device_ = c10::Device(c10::kCPU);
  int32_t common_dtype_ = kF32;  // flatten's default output dtype
  bool has_offsets_ = false;
  int64_t numel_ = 0, need_ = 0;
  std::string shared_msg_;  // "" when the tensors are distinct

  mutable std::mutex mu_;                           // guards the cache and its counters
  std::vector<std::shared_ptr<BuiltTable>> cache_;  // most recently used first
  int64_t hits_ = 0, misses_ = 0;
};

// The table behind `obj`, or nullptr when it is not one (a type-pointer compare).
TensorTable* as_table(pybind11::handle obj);

// The ops on a table: the list path's contract and checks (tensor_list.h), except that
// `offsets` must be None (the table carries its own).
at::Tensor table_flatten(TensorTable& t, pybind11::handle out, pybind11::handle offsets,
                         double scale, pybind11::handle dtype);
void table_to_list(OpKind op, pybind11::handle flat, TensorTable& t, pybind11::handle offsets,
                   double scale);
void table_scale(TensorTable& t, double factor);
at::Tensor table_reduce(TensorTable& t, OpKind op);  // kSumSquares / kNonFinite

// Adds class TensorTable to the module.
void register_tensor_table(pybind11::module_& m);

}  // namespace megadlm
