// Parsing and validation of the ops' Python arguments (tensor lists, offsets, flat
// buffers) into a segment table. Every error is a ValueError naming the argument and
// the tensor index; nothing is allocated on the hot path after warm-up (thread-local
// arenas are reused). Shared by the list path (bindings.cpp) and TensorTable
// (tensor_table.cpp), so both refuse the same inputs with the same messages.
#pragma once

#include "torch_headers.h"

#include <string>
#include <vector>

#include "megadlm/kernels.h"
#include "megadlm/multi_tensor.h"

namespace megadlm {

// One tensor of a parsed list.
struct Item {
  char* ptr;  // first byte (nullptr for 0-element tensors)
  int64_t numel;
  int32_t dtype;  // DType
};

// Raise a Python ValueError (pybind11 maps it) with `msg`.
[[noreturn]] void value_error(const std::string& msg);

// RuntimeError: `what` (e.g. "grouped_gemm: a") is on `device`, which this build cannot run;
// the message names the devices the build runs (and how to add cuda to a CPU build).
[[noreturn]] void unsupported_device(const std::string& what, const c10::Device& device);

// The tensor behind `o`; ValueError naming `name` if it is not one.
const at::Tensor& as_tensor(PyObject* o, const char* name);

// DType code of a scalar type; ValueError naming `what` if unsupported.
int32_t dtype_code(at::ScalarType st, const std::string& what);
at::ScalarType scalar_type_of(int32_t code);

// Parse `obj` (list/tuple of tensors) into `items`. Every tensor must be contiguous, of
// a supported dtype, and on `device` (when given, `device_owner` names what set it) or
// else on the device of element 0. Returns the common device (CPU for an empty list).
c10::Device parse_list(const char* name, PyObject* obj, std::vector<Item>& items,
                       const c10::optional<c10::Device>& device, const char* device_owner);

// Validate a flat buffer argument: contiguous 1-D tensor of a supported dtype.
void check_flat(const char* name, const at::Tensor& flat);

// Element offsets of each item into a flat buffer of `flat_numel` elements (-1: no
// bound, the buffer is allocated to fit). `obj` is None (packed), a sequence of ints
// or an integer tensor. Checks range and that destination ranges do not overlap.
// Returns the number of elements the flat buffer needs.
int64_t parse_offsets(PyObject* obj, const std::vector<Item>& items, int64_t flat_numel,
                      const char* flat_name, std::vector<int64_t>& offsets);

// ValueError naming the first tensor whose range [offsets[i], +numel) runs past the end of a
// flat buffer of `flat_numel` elements (called once the caller knows one does).
[[noreturn]] void past_end_error(const std::vector<Item>& items,
                                 const std::vector<int64_t>& offsets, int64_t flat_numel,
                                 const char* flat_name);

// flatten's `out` and `dtype` arguments: `out` (left undefined for None) must be a flat
// buffer agreeing with `dtype`; `dtype` (left empty for None) must be supported.
void parse_flatten_out(PyObject* out_obj, PyObject* dtype_obj, at::Tensor& out,
                       c10::optional<at::ScalarType>& dtype);

// ValueError if any tensor's bytes overlap the flat buffer's.
void check_no_alias(const char* flat_name, const at::Tensor& flat, const std::vector<Item>& items);

// ValueError if two tensors of the list share memory (in-place writes into the list).
void check_distinct(const char* name, const std::vector<Item>& items);
// The message check_distinct raises, or "" when the tensors are distinct.
std::string shared_memory_message(const char* name, const std::vector<Item>& items);

// Which way an op moves data between the list and a flat buffer.
enum class Dir { ListToFlat, FlatToList, InPlace, ReadOnly };

// Fill `segs` from the parsed items (empty tensors dropped; `flat`/`offsets` unused for
// InPlace/ReadOnly); returns the element total.
int64_t build_segments(const std::vector<Item>& items, const std::vector<int64_t>* offsets,
                       char* flat, int32_t flat_dtype, Dir dir, std::vector<Segment>& segs);

// The 0-d result tensor (CPU) of a CPU reduction: fp32 norm (kSumSquares) or int32 flag.
at::Tensor cpu_reduction_result(OpKind op, const CpuResult& r);

// Thread-local scratch reused across calls (no allocation once warm).
struct Arena {
  std::vector<Item> items;
  std::vector<int64_t> offsets;
  std::vector<Segment> segs;
  std::vector<std::pair<uintptr_t, int64_t>> spans;  // (start byte, item index)
};
Arena& arena();

}  // namespace megadlm
