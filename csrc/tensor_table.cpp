// TensorTable (see tensor_table.h): validation once, validate(), the per-table cache of
// built segment tables, the ops on a table and the Python class.
#include "tensor_table.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#ifdef MEGADLM_WITH_CUDA
#include "glue/glue.h"
#endif

namespace py = pybind11;

namespace megadlm {
namespace {

// (direction, flat buffer) keys cached per table. A table is used with one or two flat
// buffers (a bucket's param or grad buffer) and the in-place / read-only directions.
constexpr size_t kMaxBuilt = 8;

PyTypeObject* g_table_type = nullptr;  // set by register_tensor_table

// "0x7f3a..." (and "0x0"), as Python's f"0x{ptr:x}" spells it in the reference route.
std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(uintptr_t(p)));
  return buf;
}

// torch's Python spelling of a dtype ("torch.float32"), as the reference route prints it.
std::string py_dtype(at::ScalarType st) {
  py::gil_scoped_acquire gil;
  return std::string(py::str(py::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(st)))));
}

// What changed in tensor `t` since it was parsed into `it`, or "" if nothing did.
std::string moved(const at::Tensor& t, const Item& it, c10::Device device) {
  if (t.scalar_type() != scalar_type_of(it.dtype))
    return "is now " + py_dtype(t.scalar_type()) + ", was " + py_dtype(scalar_type_of(it.dtype));
  if (t.numel() != it.numel)
    return "has " + std::to_string(t.numel()) + " elements, had " + std::to_string(it.numel);
  if (t.device() != device) return "is now on " + t.device().str() + ", was on " + device.str();
  if (!t.is_contiguous()) return "is no longer contiguous";
  if (!it.numel) return std::string();
  // Through the storage: no check that could throw on a storage resized to nothing.
  const char* base = t.has_storage() ? static_cast<const char*>(t.storage().data()) : nullptr;
  const char* now = base ? base + t.storage_offset() * int64_t(t.element_size()) : nullptr;
  if (now != it.ptr) return "data moved from " + hex(it.ptr) + " to " + hex(now);
  return std::string();
}

void refuse_offsets(py::handle offsets) {
  if (!offsets.is_none())
    value_error(
        "offsets must be None with a TensorTable: the table carries its own "
        "(TensorTable(tensors, offsets=...))");
}

// The list path's device check against a flat buffer (it names the first tensor).
void check_device(const TensorTable& t, const at::Tensor& flat, const char* flat_name) {
  if (t.size() && flat.device() != t.device())
    value_error("tensors[0] is on " + t.device().str() + " but " + flat_name + " is on " +
                flat.device().str());
}

[[noreturn]] void no_cuda() {
  throw std::runtime_error("megadlm_ext was built without CUDA: rebuild with MEGADLM_EXT_CUDA=1");
}

// One op over a built table on the table's device, GIL released. Reductions return their
// 0-d result (on the device); elementwise ops an undefined tensor.
at::Tensor run_built(OpKind op, c10::Device device, BuiltTable& b, float scale) {
  const bool reduction = op == kSumSquares || op == kNonFinite;
  if (b.total == 0 && !reduction) return at::Tensor();
  py::gil_scoped_release nogil;
  if (device.is_cpu()) {
    const CpuResult r = cpu::run(op, b.segs.data(), int64_t(b.segs.size()), b.total, scale);
    return reduction ? cpu_reduction_result(op, r) : at::Tensor();
  }
#ifdef MEGADLM_WITH_CUDA
  return glue::cuda_run_owned(op, device, b.segs, b.pair, b.total, scale, b.dev_mu, b.dev);
#else
  no_cuda();
#endif
}

}  // namespace

TensorTable::TensorTable(py::handle tensors, py::handle offsets) {
  device_ = parse_list("tensors", tensors.ptr(), items_, c10::nullopt, "");
  need_ = parse_offsets(offsets.ptr(), items_, -1, "the flat buffer", offsets_);
  has_offsets_ = !offsets.is_none();
  objs_ = py::reinterpret_steal<py::tuple>(PySequence_Tuple(tensors.ptr()));
  if (!objs_) throw py::error_already_set();
  storages_.reserve(items_.size());
  for (size_t i = 0; i < items_.size(); ++i) {
    const at::Tensor& t = THPVariable_Unpack(PyTuple_GET_ITEM(objs_.ptr(), Py_ssize_t(i)));
    if (t.has_storage()) storages_.push_back(t.storage());
    numel_ += items_[i].numel;
  }
  bool same = !items_.empty();
  for (const Item& it : items_) same = same && it.dtype == items_[0].dtype;
  common_dtype_ = same ? items_[0].dtype : kF32;  // flatten's rule: mixed (or none): fp32
  shared_msg_ = shared_memory_message("tensors", items_);
}

py::object TensorTable::offsets() const {
  if (!has_offsets_) return py::none();
  py::list out(offsets_.size());
  for (size_t i = 0; i < offsets_.size(); ++i) out[i] = py::int_(offsets_[i]);
  return out;
}

void TensorTable::check_distinct() const {
  if (!shared_msg_.empty()) value_error(shared_msg_);
}

void TensorTable::validate() const {
  for (size_t i = 0; i < items_.size(); ++i) {
    const at::Tensor& t = THPVariable_Unpack(PyTuple_GET_ITEM(objs_.ptr(), Py_ssize_t(i)));
    const std::string why = moved(t, items_[i], device_);
    if (!why.empty())
      value_error("TensorTable.validate: tensors[" + std::to_string(i) + "] " + why +
                  " since the table was built (its storage was replaced or reallocated: "
                  ".data =, set_, resize_); build a new TensorTable from the current tensors");
  }
}

bool TensorTable::matches(py::handle obj) const {
  PyObject* o = obj.ptr();
  if (!PyList_Check(o) && !PyTuple_Check(o)) return false;
  if (size_t(PySequence_Fast_GET_SIZE(o)) != items_.size()) return false;
  // Identity of the Python objects: the table holds them, so an id cannot be reused.
  PyObject** a = PySequence_Fast_ITEMS(o);
  PyObject** b = PySequence_Fast_ITEMS(objs_.ptr());
  return std::equal(a, a + items_.size(), b);
}

std::shared_ptr<BuiltTable> TensorTable::built(Dir dir, const at::Tensor* flat,
                                               const char* flat_name, bool cache) {
  const void* fp = nullptr;
  int32_t fd = kF32;
  int64_t fn = 0;
  if (flat) {
    fn = flat->numel();
    fp = fn ? flat->data_ptr() : nullptr;
    fd = dtype_code(flat->scalar_type(), flat_name);
  }
  if (cache) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < cache_.size(); ++k) {
      const BuiltTable& b = *cache_[k];
      if (b.dir != dir || b.flat != fp || b.flat_dtype != fd || b.flat_numel != fn) continue;
      std::rotate(cache_.begin(), cache_.begin() + int64_t(k), cache_.begin() + int64_t(k) + 1);
      ++hits_;
      return cache_.front();
    }
  }
  // A new flat buffer: the list path's per-call checks, once. The result cannot change for
  // this key while the tensors keep their memory (the table's assumption).
  if (flat) {
    if (need_ > fn) past_end_error(items_, offsets_, fn, flat_name);
    check_no_alias(flat_name, *flat, items_);
  }
  auto b = std::make_shared<BuiltTable>();
  b->dir = dir;
  b->flat = fp;
  b->flat_dtype = fd;
  b->flat_numel = fn;
  b->total = build_segments(items_, &offsets_, static_cast<char*>(const_cast<void*>(fp)), fd, dir,
                            b->segs);
  b->pair = uniform_pair(b->segs.data(), int64_t(b->segs.size()));
  if (cache) {
    std::lock_guard<std::mutex> lock(mu_);
    ++misses_;
    cache_.insert(cache_.begin(), b);
    if (cache_.size() > kMaxBuilt) cache_.pop_back();  // a running op holds its own reference
  }
  return b;
}

std::tuple<int64_t, int64_t, int64_t> TensorTable::cache_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {hits_, misses_, int64_t(cache_.size())};
}

void TensorTable::clear() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    cache_.clear();
  }
  items_.clear();
  offsets_.clear();
  storages_.clear();
  shared_msg_.clear();
  numel_ = need_ = 0;
  objs_ = py::tuple();
}

TensorTable* as_table(py::handle obj) {
  if (Py_TYPE(obj.ptr()) != g_table_type) return nullptr;  // the class is final
  return obj.cast<TensorTable*>();
}

at::Tensor table_flatten(TensorTable& t, py::handle out_obj, py::handle offsets_obj, double scale,
                         py::handle dtype_obj) {
  refuse_offsets(offsets_obj);
  c10::optional<at::ScalarType> dtype;
  at::Tensor out;
  parse_flatten_out(out_obj.ptr(), dtype_obj.ptr(), out, dtype);
  const bool fresh = !out.defined();
  if (fresh) {
    auto opts = at::TensorOptions()
                    .dtype(dtype.value_or(scalar_type_of(t.common_dtype())))
                    .device(t.device());
    // Gaps between offset ranges are zeros, never uninitialised memory (as the list path).
    out = t.has_offsets() ? at::zeros({t.flat_numel()}, opts) : at::empty({t.flat_numel()}, opts);
  } else {
    check_device(t, out, "out");
  }
  // A new buffer has a new address: its segment table is built for this call only, so it
  // does not push the tables of the caller's persistent buffers out of the cache.
  const auto b = t.built(Dir::ListToFlat, &out, "out", /*cache=*/!fresh);
  run_built(kCopy, t.device(), *b, float(scale));
  return out;
}

void table_to_list(OpKind op, py::handle flat_obj, TensorTable& t, py::handle offsets_obj,
                   double scale) {
  refuse_offsets(offsets_obj);
  const at::Tensor& flat = as_tensor(flat_obj.ptr(), "flat");
  check_flat("flat", flat);
  check_device(t, flat, "flat");
  const bool writes_list = op == kCopy;  // unflatten
  const auto b = t.built(writes_list ? Dir::FlatToList : Dir::ListToFlat, &flat, "flat");
  if (writes_list) t.check_distinct();
  run_built(op, t.device(), *b, float(scale));
}

void table_scale(TensorTable& t, double factor) {
  t.check_distinct();
  run_built(kScale, t.device(), *t.built(Dir::InPlace, nullptr, ""), float(factor));
}

at::Tensor table_reduce(TensorTable& t, OpKind op) {
  return run_built(op, t.device(), *t.built(Dir::ReadOnly, nullptr, ""), 1.0f);
}

namespace {

const char* kTableDoc = R"doc(TensorTable(tensors, *, offsets=None)

A tensor list validated once, for tensors that persist across steps (parameters,
main-grad buffers, optimizer state). Pass it wherever an op takes ``tensors``:
flatten, unflatten, accumulate_into, scale_, l2_norm, has_nonfinite, nonfinite_flag give
bitwise the list's results, with O(1) host work per call on a known table (the segment
table of each flat buffer is built on first use and cached here; on CUDA so is its
device copy, so an eager call is one launch).

``tensors`` is checked as the list path checks it (contiguous, float32/bfloat16/float16,
one device); ``offsets`` (None: packed) are the tensors' element offsets in every flat
buffer used with the table (ops then take ``offsets=None``). The table holds the tensors
and their storages. It assumes that their memory does not change while it is used: no
``.data =``, ``set_``, ``resize_`` or ``untyped_storage().resize_`` on them (the table
would keep using the old memory). ``validate()`` checks that in O(n) and raises a
ValueError naming the first tensor that moved; ``matches(tensors)`` says whether a list
holds exactly this table's tensor objects (an O(n) pointer comparison).)doc";

int traverse(PyObject* self, visitproc visit, void* arg) {
#if PY_VERSION_HEX >= 0x03090000
  Py_VISIT(Py_TYPE(self));
#endif
  if (py::detail::is_holder_constructed(self)) {
    auto& t = py::cast<TensorTable&>(py::handle(self));
    Py_VISIT(t.objects());
  }
  return 0;
}

int clear_refs(PyObject* self) {
  if (py::detail::is_holder_constructed(self)) py::cast<TensorTable&>(py::handle(self)).clear();
  return 0;
}

}  // namespace

void register_tensor_table(py::module_& m) {
  // Garbage-collector support: a table stored where one of its tensors reaches it (a
  // tensor attribute) would otherwise be a cycle the collector cannot see into.
  auto gc = py::custom_type_setup([](PyHeapTypeObject* heap_type) {
    PyTypeObject* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = traverse;
    type->tp_clear = clear_refs;
  });
  py::class_<TensorTable> cls(m, "TensorTable", gc, py::is_final(), kTableDoc);
  cls.def(py::init<py::handle, py::handle>(), py::arg("tensors"), py::kw_only(),
          py::arg("offsets") = py::none())
      .def("__len__", &TensorTable::size)
      .def_property_readonly("tensors", &TensorTable::tensors, "The tensors (a tuple).")
      .def_property_readonly("offsets", &TensorTable::offsets,
                             "Element offsets in a flat buffer (a list), or None (packed).")
      .def_property_readonly("device", &TensorTable::device, "The tensors' device.")
      .def_property_readonly("numel", &TensorTable::numel, "Elements of all tensors.")
      .def_property_readonly("flat_numel", &TensorTable::flat_numel,
                             "Elements a flat buffer needs for this layout.")
      .def("validate", &TensorTable::validate,
           "ValueError naming the first tensor whose memory, size, dtype or layout changed "
           "since the table was built (O(n)).")
      .def("matches", &TensorTable::matches, py::arg("tensors"),
           "True iff `tensors` is a list/tuple of exactly this table's tensor objects, in "
           "order (O(n) pointer comparison; no tensor is read).")
      .def("_cache_stats", &TensorTable::cache_stats,
           "Tests: (hits, misses, entries) of the table's segment-table cache.")
      .def("__repr__", [](const TensorTable& t) {
        return "TensorTable(" + std::to_string(t.size()) + " tensors, " +
               std::to_string(t.numel()) + " elements, " + t.device().str() +
               (t.has_offsets() ? ", offsets" : "") + ")";
      });
  g_table_type = reinterpret_cast<PyTypeObject*>(cls.ptr());
}

}  // namespace megadlm
