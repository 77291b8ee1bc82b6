// pybind11 module megadlm_ext._C: the host API of every op. Each op validates its
// arguments (tensor_list.h: ValueError naming the argument and index), fills a segment
// table in a thread-local arena, releases the GIL and runs the CPU launcher or, for
// CUDA tensors in CUDA builds, the CUDA glue on torch's current stream. Given a
// TensorTable instead of a list, an op hands over to tensor_table.cpp (no parsing).
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include "torch_headers.h"

#include <algorithm>
#include <cmath>

#include "megadlm/kernels.h"
#include "tensor_list.h"
#include "tensor_table.h"

#ifdef MEGADLM_WITH_CUDA
#include "glue/glue.h"
#endif

namespace py = pybind11;

namespace megadlm {
namespace {

// Run an elementwise op (no result) on `device`.
void run_elementwise(OpKind op, c10::Device device, const std::vector<Segment>& segs, int64_t total,
                     float scale) {
  if (total == 0) return;
  py::gil_scoped_release nogil;
  if (device.is_cpu()) {
    cpu::run(op, segs.data(), int64_t(segs.size()), total, scale);
    return;
  }
#ifdef MEGADLM_WITH_CUDA
  glue::cuda_run(op, device, segs, total, scale);
#else
  throw std::runtime_error("megadlm_ext was built without CUDA: rebuild with MEGADLM_EXT_CUDA=1");
#endif
}

at::Tensor flatten(py::handle tensors, py::handle out_obj, py::handle offsets_obj, double scale,
                   py::handle dtype_obj) {
  if (TensorTable* t = as_table(tensors))
    return table_flatten(*t, out_obj, offsets_obj, scale, dtype_obj);
  Arena& a = arena();
  const bool has_out = !out_obj.is_none();
  c10::optional<at::ScalarType> dtype;
  at::Tensor out;
  parse_flatten_out(out_obj.ptr(), dtype_obj.ptr(), out, dtype);
  c10::optional<c10::Device> dev;
  if (has_out) dev = out.device();
  const c10::Device device = parse_list("tensors", tensors.ptr(), a.items, dev, "out");
  const int64_t need =
      parse_offsets(offsets_obj.ptr(), a.items, has_out ? out.numel() : -1, "out", a.offsets);
  if (has_out) {
    check_no_alias("out", out, a.items);
  } else {
    if (!dtype) {
      dtype = at::kFloat;  // mixed (or no) dtypes: fp32
      if (!a.items.empty()) {
        bool same = true;
        for (const Item& it : a.items) same = same && it.dtype == a.items[0].dtype;
        if (same) dtype = scalar_type_of(a.items[0].dtype);
      }
    }
    auto opts = at::TensorOptions().dtype(*dtype).device(device);
    // Gaps between offset ranges are zeros, never uninitialised memory.
    out = offsets_obj.is_none() ? at::empty({need}, opts) : at::zeros({need}, opts);
  }
  const int32_t fd = dtype_code(out.scalar_type(), "out");
  const int64_t total = build_segments(a.items, &a.offsets,
                                       static_cast<char*>(out.numel() ? out.data_ptr() : nullptr),
                                       fd, Dir::ListToFlat, a.segs);
  run_elementwise(kCopy, device, a.segs, total, float(scale));
  return out;
}

void to_list(OpKind op, py::handle flat_obj, py::handle tensors, py::handle offsets_obj,
             double scale) {
  if (TensorTable* t = as_table(tensors))
    return table_to_list(op, flat_obj, *t, offsets_obj, scale);
  Arena& a = arena();
  const at::Tensor& flat = as_tensor(flat_obj.ptr(), "flat");
  check_flat("flat", flat);
  const c10::Device device = parse_list("tensors", tensors.ptr(), a.items, flat.device(), "flat");
  parse_offsets(offsets_obj.ptr(), a.items, flat.numel(), "flat", a.offsets);
  check_no_alias("flat", flat, a.items);
  if (op == kCopy) check_distinct("tensors", a.items);  // unflatten writes into the list
  const int32_t fd = dtype_code(flat.scalar_type(), "flat");
  char* fp = static_cast<char*>(flat.numel() ? flat.data_ptr() : nullptr);
  const int64_t total = build_segments(a.items, &a.offsets, fp, fd,
                                       op == kCopy ? Dir::FlatToList : Dir::ListToFlat, a.segs);
  run_elementwise(op, device, a.segs, total, float(scale));
}

void unflatten(py::handle flat, py::handle tensors, py::handle offsets, double scale) {
  to_list(kCopy, flat, tensors, offsets, scale);
}

void accumulate_into(py::handle flat, py::handle tensors, py::handle offsets, double scale) {
  to_list(kAccumulate, flat, tensors, offsets, scale);
}

void scale_(py::handle tensors, double factor) {
  if (TensorTable* t = as_table(tensors)) return table_scale(*t, factor);
  Arena& a = arena();
  const c10::Device device = parse_list("tensors", tensors.ptr(), a.items, c10::nullopt, "");
  check_distinct("tensors", a.items);
  const int64_t total = build_segments(a.items, nullptr, nullptr, kF32, Dir::InPlace, a.segs);
  run_elementwise(kScale, device, a.segs, total, float(factor));
}

// Shared front of the reductions (l2_norm, nonfinite_flag, has_nonfinite).
c10::Device reduce_setup(py::handle tensors, int64_t& total) {
  Arena& a = arena();
  const c10::Device device = parse_list("tensors", tensors.ptr(), a.items, c10::nullopt, "");
  total = build_segments(a.items, nullptr, nullptr, kF32, Dir::ReadOnly, a.segs);
  return device;
}

// One reduction of the list into a 0-d tensor on its device: the CUDA kernel's result (no
// host sync), or the CPU pass's result as a tensor.
at::Tensor reduce(py::handle tensors, OpKind op) {
  if (TensorTable* t = as_table(tensors)) return table_reduce(*t, op);
  int64_t total = 0;
  const c10::Device device = reduce_setup(tensors, total);
  const auto& segs = arena().segs;
#ifdef MEGADLM_WITH_CUDA
  if (device.is_cuda()) {
    py::gil_scoped_release nogil;
    return glue::cuda_run(op, device, segs, total, 1.0f);
  }
#endif
  if (!device.is_cpu())
    throw std::runtime_error("megadlm_ext was built without CUDA: rebuild with MEGADLM_EXT_CUDA=1");
  CpuResult result;
  {
    py::gil_scoped_release nogil;
    result = cpu::run(op, segs.data(), int64_t(segs.size()), total, 1.0f);
  }
  return cpu_reduction_result(op, result);
}

at::Tensor l2_norm(py::handle tensors) {
  return reduce(tensors, kSumSquares);
}

// 0-d int32 tensor on the list's device: 1 if any element is NaN/Inf. No host sync on
// CUDA (the flag stays on the device until the caller reads it).
at::Tensor nonfinite_flag(py::handle tensors) {
  return reduce(tensors, kNonFinite);
}

bool has_nonfinite(py::handle tensors) {
  // device -> host sync on CUDA: the caller asked for a bool
  return nonfinite_flag(tensors).item<int32_t>() != 0;
}

// ---- gradient-accumulation fusion ---------------------------------------------------------
// torch's Python spelling of a dtype, as the reference route's messages print it.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    default: return c10::toString(t);
  }
}

void check_wgrad_input(const at::Tensor& t, const char* name, const at::Tensor& mg) {
  const std::string what = std::string("wgrad_accumulate: ") + name;
  dtype_code(t.scalar_type(), what);
  if (t.dim() < 1) value_error(what + " must have at least one dim");
  if (!t.is_contiguous())
    value_error(what + " is not contiguous (strides " + c10::str(t.strides()) + "); pass " + name +
                ".contiguous()");
  if (t.device() != mg.device())
    value_error(what + " is on " + t.device().str() + " but main_grad is on " + mg.device().str());
}

// Checks of wgrad_accumulate; every message names the argument (as reference.py does).
void check_wgrad(const at::Tensor& mg, const at::Tensor& go, const at::Tensor& x) {
  if (mg.scalar_type() != at::kFloat)
    value_error(std::string("wgrad_accumulate: main_grad must be float32 (the fp32 gradient "
                            "buffer), got ") +
                dtype_name(mg.scalar_type()));
  if (mg.dim() != 2 || !mg.is_contiguous())
    value_error(
        "wgrad_accumulate: main_grad must be a contiguous 2-D [out, in] tensor, got shape " +
        c10::str(mg.sizes()) + (mg.is_contiguous() ? "" : " (not contiguous)"));
  check_wgrad_input(go, "grad_output", mg);
  check_wgrad_input(x, "input", mg);
  if (go.scalar_type() != x.scalar_type())
    value_error(std::string("wgrad_accumulate: grad_output is ") + dtype_name(go.scalar_type()) +
                " but input is " + dtype_name(x.scalar_type()) + "; they must have the same dtype");
  if (go.size(-1) != mg.size(0) || x.size(-1) != mg.size(1))
    value_error("wgrad_accumulate: main_grad " + c10::str(mg.sizes()) +
                " must be [grad_output.shape[-1], input.shape[-1]] = [" +
                std::to_string(go.size(-1)) + ", " + std::to_string(x.size(-1)) + "]");
  if (!go.sizes().slice(0, go.dim() - 1).equals(x.sizes().slice(0, x.dim() - 1)))
    value_error("wgrad_accumulate: grad_output " + c10::str(go.sizes()) + " and input " +
                c10::str(x.sizes()) + " must have the same leading dims");
}

// CPU: fp32 inputs go straight to ATen's addmm_ (beta = 1). bf16/fp16 inputs are upcast
// in row chunks and each chunk is added with an fp32 addmm_, so no fp32 copy of the whole
// activation is made: a chunk pair holds at most kWgradChunkElems fp32 values (16 MiB) and
// no more than the 16-bit weight gradient it replaces (out * in / 2 fp32 values), but at
// least kWgradMinRows rows (GEMM efficiency). On CPUs without native bf16 GEMM this is also
// ~4x faster than torch's bf16 matmul (README_issue10_fusion.md).
constexpr int64_t kWgradChunkElems = int64_t(1) << 22;
constexpr int64_t kWgradMinRows = 64;

void cpu_wgrad(at::Tensor& mg, const at::Tensor& go, const at::Tensor& x, double alpha) {
  if (go.scalar_type() == at::kFloat) {
    mg.addmm_(go.t(), x, /*beta=*/1.0, alpha);
    return;
  }
  const int64_t rows = go.size(0);
  const int64_t budget = std::min(kWgradChunkElems, mg.numel() / 2);
  const int64_t chunk = std::max(kWgradMinRows, budget / (mg.size(0) + mg.size(1)));
  for (int64_t r = 0; r < rows; r += chunk) {
    const int64_t n = std::min(chunk, rows - r);
    mg.addmm_(go.narrow(0, r, n).to(at::kFloat).t(), x.narrow(0, r, n).to(at::kFloat),
              /*beta=*/1.0, alpha);
  }
}

void wgrad_accumulate(py::handle main_grad, py::handle grad_output, py::handle input,
                      double alpha) {
  at::Tensor mg = as_tensor(main_grad.ptr(), "main_grad");
  const at::Tensor& go_in = as_tensor(grad_output.ptr(), "grad_output");
  const at::Tensor& x_in = as_tensor(input.ptr(), "input");
  check_wgrad(mg, go_in, x_in);
  const at::Tensor go = go_in.reshape({-1, go_in.size(-1)});  // views: all are contiguous
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)});
  if (go.size(0) == 0 || mg.numel() == 0) return;
  py::gil_scoped_release nogil;
  at::NoGradGuard no_grad;
  if (mg.device().is_cpu()) return cpu_wgrad(mg, go, x, alpha);
#ifdef MEGADLM_WITH_CUDA
  if (mg.device().is_cuda()) return glue::cuda_wgrad_accumulate(mg, go, x, float(alpha));
#endif
  unsupported_device("wgrad_accumulate: main_grad", mg.device());
}

// ---- grouped GEMM (MoE experts) ------------------------------------------------------------
// Checks of grouped_gemm; the reference route (reference.py) words them the same way.
void check_grouped_tensor(const at::Tensor& t, const char* name, int64_t dim) {
  const std::string what = std::string("grouped_gemm: ") + name;
  dtype_code(t.scalar_type(), what);
  if (t.dim() != dim)
    value_error(what + " must be " + std::to_string(dim) + "-D, got shape " + c10::str(t.sizes()));
  if (!t.is_contiguous())
    value_error(what + " is not contiguous (strides " + c10::str(t.strides()) + "); pass " + name +
                ".contiguous()");
}

// Returns the group sizes (host int64) after checking them against a's rows.
const int64_t* check_batch_sizes(const at::Tensor& bs, int64_t rows) {
  if (bs.scalar_type() != at::kLong || bs.dim() != 1 || !bs.device().is_cpu() ||
      !bs.is_contiguous())
    value_error(
        "grouped_gemm: batch_sizes must be a contiguous 1-D int64 cpu tensor (the rows of "
        "each group), got " +
        dtype_name(bs.scalar_type()) + " " + c10::str(bs.sizes()) + " on " + bs.device().str());
  const int64_t* s = bs.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t g = 0; g < bs.numel(); ++g) {
    if (s[g] < 0)
      value_error("grouped_gemm: batch_sizes[" + std::to_string(g) + "] = " + std::to_string(s[g]) +
                  " is negative");
    total += s[g];
  }
  if (total != rows)
    value_error("grouped_gemm: batch_sizes sum to " + std::to_string(total) + " but a has " +
                std::to_string(rows) + " rows");
  return s;
}

// Checks the operands; returns the shape of the result.
std::vector<int64_t> check_grouped(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bs,
                                   bool trans_a, bool trans_b) {
  check_grouped_tensor(a, "a", 2);
  check_grouped_tensor(b, "b", trans_a ? 2 : 3);
  if (b.scalar_type() != a.scalar_type())
    value_error("grouped_gemm: a is " + dtype_name(a.scalar_type()) + " but b is " +
                dtype_name(b.scalar_type()) + "; they must have the same dtype");
  if (b.device() != a.device())
    value_error("grouped_gemm: b is on " + b.device().str() + " but a is on " + a.device().str());
  check_batch_sizes(bs, a.size(0));
  const int64_t groups = bs.numel();
  if (trans_a) {
    if (trans_b) value_error("grouped_gemm: trans_a and trans_b together are not supported");
    if (b.size(0) != a.size(0))
      value_error("grouped_gemm: with trans_a, a " + c10::str(a.sizes()) + " and b " +
                  c10::str(b.sizes()) + " must have the same rows");
    return {groups, a.size(1), b.size(1)};
  }
  const int64_t inner = trans_b ? b.size(2) : b.size(1);
  if (b.size(0) != groups || inner != a.size(1))
    value_error("grouped_gemm: b " + c10::str(b.sizes()) + " must be [" + std::to_string(groups) +
                (trans_b ? ", n, " + std::to_string(a.size(1)) + "]"
                         : ", " + std::to_string(a.size(1)) + ", n]") +
                " for a " + c10::str(a.sizes()) + " and " + std::to_string(groups) +
                " batch_sizes" + (trans_b ? " (trans_b)" : ""));
  return {a.size(0), trans_b ? b.size(1) : b.size(2)};
}

void check_grouped_out(const at::Tensor& out, const at::Tensor& a,
                       const std::vector<int64_t>& shape) {
  if (out.scalar_type() != a.scalar_type() && out.scalar_type() != at::kFloat)
    value_error("grouped_gemm: out is " + dtype_name(out.scalar_type()) + "; it must be " +
                dtype_name(a.scalar_type()) + " (a's dtype) or torch.float32");
  if (!out.sizes().equals(shape) || !out.is_contiguous())
    value_error("grouped_gemm: out must be a contiguous " + c10::str(at::IntArrayRef(shape)) +
                " tensor, got " + c10::str(out.sizes()) +
                (out.is_contiguous() ? "" : " (not contiguous)"));
  if (out.device() != a.device())
    value_error("grouped_gemm: out is on " + out.device().str() + " but a is on " +
                a.device().str());
}

// o (= or +=) alpha * x @ y, products accumulated in fp32 (16-bit operands are upcast).
void cpu_gemm_into(at::Tensor o, const at::Tensor& x, const at::Tensor& y, bool acc, double alpha) {
  const at::Tensor xf = x.to(at::kFloat), yf = y.to(at::kFloat);  // no copy for fp32
  if (o.scalar_type() == at::kFloat) {
    o.addmm_(xf, yf, acc ? 1.0 : 0.0, alpha);
    return;
  }
  at::Tensor r = at::mm(xf, yf);
  if (alpha != 1.0) r.mul_(alpha);
  if (acc) r.add_(o.to(at::kFloat));
  o.copy_(r);  // one rounding into the 16-bit output
}

// One call for all groups: a loop over the groups' ATen GEMMs, without the Python and
// autograd overhead of a per-expert loop (the weights are upcast once, not per group).
void cpu_grouped(const at::Tensor& a, const at::Tensor& b, const int64_t* sizes, int64_t groups,
                 at::Tensor& out, bool trans_a, bool trans_b, bool acc, double alpha) {
  const at::Tensor bw = trans_a ? b : b.to(at::kFloat);
  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = sizes[g];
    const at::Tensor ag = a.narrow(0, row, rows);
    if (trans_a) {
      at::Tensor og = out.select(0, g);
      if (rows == 0) {
        if (!acc) og.zero_();
      } else {
        cpu_gemm_into(og, ag.t(), b.narrow(0, row, rows), acc, alpha);
      }
    } else if (rows > 0) {
      const at::Tensor bg = bw.select(0, g);
      cpu_gemm_into(out.narrow(0, row, rows), ag, trans_b ? bg.t() : bg, acc, alpha);
    }
    row += rows;
  }
}

at::Tensor grouped_gemm(py::handle a_obj, py::handle b_obj, py::handle bs_obj, bool trans_a,
                        bool trans_b, py::handle out_obj, bool accumulate, double alpha) {
  const at::Tensor& a = as_tensor(a_obj.ptr(), "a");
  const at::Tensor& b = as_tensor(b_obj.ptr(), "b");
  const at::Tensor& bs = as_tensor(bs_obj.ptr(), "batch_sizes");
  const std::vector<int64_t> shape = check_grouped(a, b, bs, trans_a, trans_b);
  at::Tensor out;
  if (out_obj.is_none()) {
    if (accumulate) value_error("grouped_gemm: accumulate=True needs out");
    out = at::empty(shape, a.options());
  } else {
    out = as_tensor(out_obj.ptr(), "out");
    check_grouped_out(out, a, shape);
  }
  if (out.numel() == 0) return out;
  py::gil_scoped_release nogil;
  at::NoGradGuard no_grad;
  if (a.device().is_cpu()) {
    cpu_grouped(a, b, bs.data_ptr<int64_t>(), bs.numel(), out, trans_a, trans_b, accumulate, alpha);
    return out;
  }
#ifdef MEGADLM_WITH_CUDA
  if (a.device().is_cuda()) {
    glue::cuda_grouped_gemm(a, b, bs, out, trans_a, trans_b, accumulate, float(alpha));
    return out;
  }
#endif
  unsupported_device("grouped_gemm: a", a.device());
}

py::dict backend_info() {
  py::dict d;
  d["compiled"] = true;
#ifdef MEGADLM_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
  d["nccl"] = false;  // megadlm_ext/__init__.py fills this in from megadlm_ext.nccl
  d["cpu_isa"] = cpu::isa();
  return d;
}

}  // namespace
}  // namespace megadlm

void megadlm_register_nccl(py::module_& m);  // csrc/nccl/nccl_bindings.cpp
void megadlm_register_adam(py::module_& m);  // csrc/adam_bindings.cpp

void megadlm_register_fused(py::module_& m);  // csrc/fused_bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace megadlm;
  m.doc() = "megadlm_ext compiled ops (see megadlm_ext/__init__.py for the documented API)";
  m.def("backend_info", &backend_info);
  register_tensor_table(m);
  m.def("flatten", &flatten, py::arg("tensors"), py::arg("out") = py::none(), py::kw_only(),
        py::arg("offsets") = py::none(), py::arg("scale") = 1.0, py::arg("dtype") = py::none());
  m.def("unflatten", &unflatten, py::arg("flat"), py::arg("tensors"), py::kw_only(),
        py::arg("offsets") = py::none(), py::arg("scale") = 1.0);
  m.def("accumulate_into", &accumulate_into, py::arg("flat"), py::arg("tensors"), py::kw_only(),
        py::arg("offsets") = py::none(), py::arg("scale") = 1.0);
  m.def("scale_", &scale_, py::arg("tensors"), py::arg("factor"));
  m.def("l2_norm", &l2_norm, py::arg("tensors"));
  m.def("has_nonfinite", &has_nonfinite, py::arg("tensors"));
  m.def("nonfinite_flag", &nonfinite_flag, py::arg("tensors"));
  m.def("wgrad_accumulate", &wgrad_accumulate, py::arg("main_grad"), py::arg("grad_output"),
        py::arg("input"), py::kw_only(), py::arg("alpha") = 1.0);
  m.def("grouped_gemm", &grouped_gemm, py::arg("a"), py::arg("b"), py::arg("batch_sizes"),
        py::kw_only(), py::arg("trans_a") = false, py::arg("trans_b") = false,
        py::arg("out") = py::none(), py::arg("accumulate") = false, py::arg("alpha") = 1.0);
  m.def(
      "_set_cpu_isa",
      [](const std::string& name) {
        if (!cpu::set_isa(name))
          value_error("_set_cpu_isa: expected 'generic' or 'auto', got '" + name + "'");
      },
      py::arg("name"),
      "Tests only: force the portable CPU kernels ('generic') or re-detect ('auto').");
#ifdef MEGADLM_WITH_CUDA
  m.def("_cuda_table_cache_stats", &glue::table_cache_stats,
        "Tests/benchmarks: (hits, misses, entries) of the device segment-table cache.");
  m.def("_cuda_clear_table_cache", &glue::clear_table_cache,
        "Tests/benchmarks: drop cached device tables (not those held by captured CUDA graphs).");
#endif
  megadlm_register_nccl(m);
  megadlm_register_adam(m);
  megadlm_register_fused(m);
}
