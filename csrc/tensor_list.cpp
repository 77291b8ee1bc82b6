// Argument parsing / validation shared by every op (see tensor_list.h).
#include "tensor_list.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace megadlm {

void value_error(const std::string& msg) {
  throw pybind11::value_error(msg);
}

const at::Tensor& as_tensor(PyObject* o, const char* name) {
  if (!THPVariable_Check(o))
    value_error(std::string(name) + " must be a tensor, got " + Py_TYPE(o)->tp_name);
  return THPVariable_Unpack(o);
}

void unsupported_device(const std::string& what, const c10::Device& device) {
  throw std::runtime_error(what + " is on " + device.str() +
                           "; this build of megadlm_ext runs cpu tensors" +
#ifdef MEGADLM_WITH_CUDA
                           " and cuda tensors"
#else
                           " only (rebuild with MEGADLM_EXT_CUDA=1 for cuda)"
#endif
  );
}

// The code of a supported dtype, -1 otherwise (no error text: callers on hot paths build it
// only when they throw).
static int32_t supported_code(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: return -1;
  }
}

int32_t dtype_code(at::ScalarType st, const std::string& what) {
  const int32_t code = supported_code(st);
  if (code < 0)
    value_error(what + " has dtype " + std::string(c10::toString(st)) +
                "; supported: float32, bfloat16, float16");
  return code;
}

at::ScalarType scalar_type_of(int32_t code) {
  return code == kF32 ? at::kFloat : code == kBF16 ? at::kBFloat16 : at::kHalf;
}

static std::string idx(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

static std::string strides_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.strides();
  return os.str();
}

c10::Device parse_list(const char* name, PyObject* obj, std::vector<Item>& items,
                       const c10::optional<c10::Device>& device, const char* device_owner) {
  items.clear();
  if (!PyList_Check(obj) && !PyTuple_Check(obj))
    value_error(std::string(name) + " must be a list or tuple of tensors, got " +
                Py_TYPE(obj)->tp_name);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** elems = PySequence_Fast_ITEMS(obj);
  items.reserve(size_t(n));
  c10::Device common = device.value_or(c10::Device(c10::kCPU));
  for (Py_ssize_t i = 0; i < n; ++i) {
    // Each tensor costs a chain of dependent cache misses (PyObject -> TensorImpl ->
    // StorageImpl); for 20k tensors that is most of the call. Prefetch each link a few
    // tensors ahead so the misses overlap.
    if (i + 12 < n) __builtin_prefetch(elems[i + 12]);
    if (i + 8 < n && THPVariable_CheckExact(elems[i + 8])) {
      const c10::TensorImpl* impl = THPVariable_Unpack(elems[i + 8]).unsafeGetTensorImpl();
      __builtin_prefetch(impl);
      __builtin_prefetch(reinterpret_cast<const char*>(impl) + 64);
      __builtin_prefetch(reinterpret_cast<const char*>(impl) + 128);
    }
    if (i + 4 < n && THPVariable_CheckExact(elems[i + 4])) {
      const at::Tensor& ahead = THPVariable_Unpack(elems[i + 4]);
      if (ahead.has_storage()) __builtin_prefetch(ahead.storage().unsafeGetStorageImpl());
    }
    PyObject* o = elems[i];
    if (!THPVariable_Check(o))
      value_error(idx(name, size_t(i)) + " is a " + Py_TYPE(o)->tp_name + ", not a tensor");
    const at::Tensor& t = THPVariable_Unpack(o);
    // The error's text is built only to throw: making "tensors[i]" for every tensor took 0.5
    // of the 2.4 ms of parsing 20k tensors (issue 44).
    int32_t code = supported_code(t.scalar_type());
    if (code < 0) code = dtype_code(t.scalar_type(), idx(name, size_t(i)));
    if (!t.is_contiguous())
      value_error(idx(name, size_t(i)) + " is not contiguous (strides " + strides_of(t) +
                  "); pass t.contiguous() (in-place ops need the original contiguous storage)");
    const c10::Device d = t.device();
    if (device.has_value()) {
      if (d != *device)
        value_error(idx(name, size_t(i)) + " is on " + d.str() + " but " + device_owner +
                    " is on " + device->str());
    } else if (i == 0) {
      common = d;
    } else if (d != common) {
      value_error(idx(name, size_t(i)) + " is on " + d.str() + " but " + name + "[0] is on " +
                  common.str());
    }
    if (!d.is_cpu() && !d.is_cuda())
      value_error(idx(name, size_t(i)) + " is on " + d.str() +
                  "; megadlm_ext runs on cpu tensors (and cuda tensors in CUDA builds)");
    const int64_t numel = t.numel();
    items.push_back(Item{numel ? static_cast<char*>(t.data_ptr()) : nullptr, numel, code});
  }
  return common;
}

void check_flat(const char* name, const at::Tensor& flat) {
  dtype_code(flat.scalar_type(), name);
  if (flat.dim() != 1 || !flat.is_contiguous()) {
    std::ostringstream os;
    os << name << " must be a contiguous 1-D tensor, got shape " << flat.sizes();
    value_error(os.str());
  }
  const c10::Device d = flat.device();
  if (!d.is_cpu() && !d.is_cuda())
    value_error(std::string(name) + " is on " + d.str() +
                "; megadlm_ext runs on cpu tensors (and cuda tensors in CUDA builds)");
}

static int64_t as_int(PyObject* o, size_t i) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.numel() == 1 && !at::isFloatingType(t.scalar_type())) return t.item<int64_t>();
  } else if (PyLong_Check(o) || PyIndex_Check(o)) {
    const long long v = PyLong_AsLongLong(o);
    if (!(v == -1 && PyErr_Occurred())) return v;
    PyErr_Clear();
  }
  value_error("offsets[" + std::to_string(i) + "] is a " + Py_TYPE(o)->tp_name +
              ", not an integer");
}

int64_t parse_offsets(PyObject* obj, const std::vector<Item>& items, int64_t flat_numel,
                      const char* flat_name, std::vector<int64_t>& offsets) {
  const size_t n = items.size();
  offsets.resize(n);
  if (obj == Py_None) {
    int64_t pos = 0;
    for (size_t i = 0; i < n; ++i) {
      offsets[i] = pos;
      pos += items[i].numel;
    }
    if (flat_numel < 0 || pos <= flat_numel) return pos;  // packed: in order, no overlap
    // else fall through to the range check, which names the first tensor that does not fit
  } else if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.dim() != 1 || at::isFloatingType(t.scalar_type()) || !t.device().is_cpu())
      value_error("offsets must be a 1-D integer CPU tensor or a list of ints");
    if (size_t(t.numel()) != n)
      value_error("offsets has " + std::to_string(t.numel()) + " entries but there are " +
                  std::to_string(n) + " tensors");
    at::Tensor l = t.to(at::kLong).contiguous();
    std::copy(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + n, offsets.begin());
  } else {
    if (!PyList_Check(obj) && !PyTuple_Check(obj))
      value_error(std::string("offsets must be None, a list of ints or an integer tensor, got ") +
                  Py_TYPE(obj)->tp_name);
    if (size_t(PySequence_Fast_GET_SIZE(obj)) != n)
      value_error("offsets has " + std::to_string(PySequence_Fast_GET_SIZE(obj)) +
                  " entries but there are " + std::to_string(n) + " tensors");
    PyObject** elems = PySequence_Fast_ITEMS(obj);
    for (size_t i = 0; i < n; ++i) offsets[i] = as_int(elems[i], i);
  }
  // Range checks, and overlap: a single pass when the ranges come in increasing order
  // (every bucket layout), a sort otherwise.
  int64_t need = 0, prev_end = 0;
  size_t prev = SIZE_MAX;
  bool sorted = true;
  for (size_t i = 0; i < n; ++i) {
    const int64_t o = offsets[i], m = items[i].numel;
    if (o < 0)
      value_error("offsets[" + std::to_string(i) + "] = " + std::to_string(o) + " is negative");
    if (flat_numel >= 0 && o + m > flat_numel)
      past_end_error(items, offsets, flat_numel, flat_name);
    need = std::max(need, o + m);
    if (m == 0) continue;
    if (prev != SIZE_MAX && o < prev_end) sorted = false;
    prev = i;
    prev_end = o + m;
  }
  if (!sorted) {
    auto& spans = arena().spans;
    spans.clear();
    for (size_t i = 0; i < n; ++i)
      if (items[i].numel) spans.emplace_back(uintptr_t(offsets[i]), int64_t(i));
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k) {
      const size_t a = size_t(spans[k - 1].second), b = size_t(spans[k].second);
      if (offsets[b] < offsets[a] + items[a].numel)
        value_error("tensors[" + std::to_string(std::min(a, b)) + "] and tensors[" +
                    std::to_string(std::max(a, b)) + "] overlap in " + flat_name + " (offsets " +
                    std::to_string(offsets[a]) + " and " + std::to_string(offsets[b]) + ")");
    }
  }
  return need;
}

void past_end_error(const std::vector<Item>& items, const std::vector<int64_t>& offsets,
                    int64_t flat_numel, const char* flat_name) {
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t o = offsets[i], m = items[i].numel;
    if (o + m > flat_numel)
      value_error("tensors[" + std::to_string(i) + "] (" + std::to_string(m) +
                  " elements at offset " + std::to_string(o) + ") runs past the end of " +
                  flat_name + " (" + std::to_string(flat_numel) + " elements)");
  }
  value_error(std::string("past_end_error: no tensor runs past the end of ") + flat_name);
}

void parse_flatten_out(PyObject* out_obj, PyObject* dtype_obj, at::Tensor& out,
                       c10::optional<at::ScalarType>& dtype) {
  if (dtype_obj != Py_None) {
    if (!THPDtype_Check(dtype_obj)) value_error("dtype must be a torch.dtype or None");
    dtype = reinterpret_cast<THPDtype*>(dtype_obj)->scalar_type;
    dtype_code(*dtype, "dtype argument");
  }
  if (out_obj == Py_None) return;
  out = as_tensor(out_obj, "out");
  check_flat("out", out);
  if (dtype && *dtype != out.scalar_type())
    value_error(std::string("dtype=") + c10::toString(*dtype) +
                " disagrees with out.dtype=" + c10::toString(out.scalar_type()));
}

void check_no_alias(const char* flat_name, const at::Tensor& flat, const std::vector<Item>& items) {
  if (flat.numel() == 0) return;
  const uintptr_t f0 = uintptr_t(flat.data_ptr()), f1 = f0 + uintptr_t(flat.nbytes());
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].numel) continue;
    const uintptr_t t0 = uintptr_t(items[i].ptr),
                    t1 = t0 + uintptr_t(items[i].numel * dtype_size(items[i].dtype));
    if (t0 < f1 && f0 < t1)
      value_error("tensors[" + std::to_string(i) + "] aliases " + flat_name +
                  ": in-place ops need separate memory");
  }
}

void check_distinct(const char* name, const std::vector<Item>& items) {
  const std::string msg = shared_memory_message(name, items);
  if (!msg.empty()) value_error(msg);
}

std::string shared_memory_message(const char* name, const std::vector<Item>& items) {
  auto& spans = arena().spans;
  spans.clear();
  bool sorted = true;  // tensors carved from one buffer in order: no sort needed
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].numel) {
      if (!spans.empty() && uintptr_t(items[i].ptr) < spans.back().first) sorted = false;
      spans.emplace_back(uintptr_t(items[i].ptr), int64_t(i));
    }
  if (!sorted) std::sort(spans.begin(), spans.end());
  for (size_t k = 1; k < spans.size(); ++k) {
    const Item& a = items[size_t(spans[k - 1].second)];
    if (spans[k].first < spans[k - 1].first + uintptr_t(a.numel * dtype_size(a.dtype))) {
      const int64_t i = std::min(spans[k - 1].second, spans[k].second);
      const int64_t j = std::max(spans[k - 1].second, spans[k].second);
      return std::string(name) + "[" + std::to_string(i) + "] and " + name + "[" +
             std::to_string(j) + "] share memory: in-place ops need distinct tensors";
    }
  }
  return std::string();
}

int64_t build_segments(const std::vector<Item>& items, const std::vector<int64_t>* offsets,
                       char* flat, int32_t flat_dtype, Dir dir, std::vector<Segment>& segs) {
  segs.clear();
  segs.reserve(items.size());
  int64_t total = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    if (!it.numel) continue;
    char* f = flat ? flat + (*offsets)[i] * dtype_size(flat_dtype) : nullptr;
    Segment s{};
    s.start = total;
    switch (dir) {
      case Dir::ListToFlat:
        s.src = it.ptr;
        s.dst = f;
        s.src_dtype = it.dtype;
        s.dst_dtype = flat_dtype;
        break;
      case Dir::FlatToList:
        s.src = f;
        s.dst = it.ptr;
        s.src_dtype = flat_dtype;
        s.dst_dtype = it.dtype;
        break;
      case Dir::InPlace:
        s.src = it.ptr;
        s.dst = it.ptr;
        s.src_dtype = s.dst_dtype = it.dtype;
        break;
      case Dir::ReadOnly:
        s.src = it.ptr;
        s.dst = nullptr;
        s.src_dtype = s.dst_dtype = it.dtype;
        break;
    }
    segs.push_back(s);
    total += it.numel;
  }
  return total;
}

at::Tensor cpu_reduction_result(OpKind op, const CpuResult& r) {
  if (op == kSumSquares)
    return at::scalar_tensor(float(std::sqrt(r.sum_squares)),
                             at::TensorOptions().dtype(at::kFloat));
  return at::scalar_tensor(int32_t(r.nonfinite), at::TensorOptions().dtype(at::kInt));
}

Arena& arena() {
  thread_local Arena a;
  return a;
}

}  // namespace megadlm
