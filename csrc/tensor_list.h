// Parsing and validation of the ops' Python arguments (tensor lists, offsets, flat
// buffers) into a segment table. Every error is a ValueError naming the argument and
// the tensor index; nothing is allocated on the hot path after warm-up (thread-local
// arenas are reused).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

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

// ValueError if any tensor's bytes overlap the flat buffer's.
void check_no_alias(const char* flat_name, const at::Tensor& flat, const std::vector<Item>& items);

// ValueError if two tensors of the list share memory (in-place writes into the list).
void check_distinct(const char* name, const std::vector<Item>& items);

// Thread-local scratch reused across calls (no allocation once warm).
struct Arena {
  std::vector<Item> items;
  std::vector<int64_t> offsets;
  std::vector<Segment> segs;
  std::vector<std::pair<uintptr_t, int64_t>> spans;  // (start byte, item index)
};
Arena& arena();

}  // namespace megadlm
