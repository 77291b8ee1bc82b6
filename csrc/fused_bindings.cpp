// Python bindings of the fused transformer ops (registered from bindings.cpp): validate the
// arguments (ValueError naming the op, the argument and the fix, worded as
// megadlm_ext/reference_fused.py words them), allocate the outputs, fill the params struct of
// megadlm/fused.h, release the GIL and run the CPU kernels or, for CUDA tensors in CUDA
// builds, the CUDA glue on torch's current stream.
#include <torch/csrc/autograd/python_variable.h>
#include "torch_headers.h"

#include <cmath>
#include <string>
#include <utility>

#include "megadlm/fused.h"
#include "tensor_list.h"

#ifdef MEGADLM_WITH_CUDA
#include "glue/fused_glue.h"
#endif

namespace py = pybind11;

namespace megadlm {
namespace {

struct Arg {
  const char* op;
  const char* name;
  std::string what() const { return std::string(op) + ": " + name; }
};

// The tensor behind `o`, of a supported dtype (fp32 / bf16 / fp16), on cpu or cuda.
const at::Tensor& tensor_arg(py::handle o, const Arg& a) {
  if (!THPVariable_Check(o.ptr()))
    value_error(a.what() + " must be a tensor, got " + Py_TYPE(o.ptr())->tp_name);
  const at::Tensor& t = THPVariable_Unpack(o.ptr());
  if (!t.device().is_cpu() && !t.device().is_cuda())
    value_error(a.what() + " is on " + t.device().str() +
                "; megadlm_ext runs cpu tensors (and cuda tensors in CUDA builds)");
  return t;
}

void check_float(const at::Tensor& t, const Arg& a) {
  dtype_code(t.scalar_type(), a.what());
}

void check_contiguous(const at::Tensor& t, const Arg& a) {
  if (!t.is_contiguous())
    value_error(a.what() + " is not contiguous (strides " + c10::str(t.strides()) + "); pass " +
                a.name + ".contiguous()");
}

// `t` has `ref`'s dtype, device and (when `shape` is null) shape.
void check_like(const at::Tensor& t, const Arg& a, const at::Tensor& ref, const char* ref_name,
                const c10::IntArrayRef* shape = nullptr) {
  if (t.scalar_type() != ref.scalar_type())
    value_error(a.what() + " is " + c10::toString(t.scalar_type()) + " but " + ref_name + " is " +
                c10::toString(ref.scalar_type()) + "; they must have the same dtype");
  if (t.device() != ref.device())
    value_error(a.what() + " is on " + t.device().str() + " but " + ref_name + " is on " +
                ref.device().str());
  const c10::IntArrayRef want = shape ? *shape : ref.sizes();
  if (!t.sizes().equals(want))
    value_error(a.what() + " has shape " + c10::str(t.sizes()) + " but must be " + c10::str(want));
}

// Runs `cpu()` or, on a CUDA device in a CUDA build, `gpu()`, without the GIL.
template <class C, class G>
void run_on(c10::Device device, const char* op, C&& cpu, G&& gpu) {
  if (device.is_cpu()) {
    py::gil_scoped_release nogil;
    cpu();
    return;
  }
#ifdef MEGADLM_WITH_CUDA
  if (device.is_cuda()) {
    py::gil_scoped_release nogil;
    gpu();
    return;
  }
#else
  (void)gpu;
#endif
  unsupported_device(std::string(op) + ": the tensors", device);
}

// ---- rotary embedding ------------------------------------------------------------------------
void check_angles(const at::Tensor& t, const Arg& a, const at::Tensor& x) {
  if (t.scalar_type() != at::kFloat)
    value_error(a.what() + " must be float32 (the angles are kept in fp32), got " +
                c10::toString(t.scalar_type()));
  if (t.device() != x.device())
    value_error(a.what() + " is on " + t.device().str() + " but x is on " + x.device().str());
  const bool ok = t.dim() == 4 && (t.size(0) == 1 || t.size(0) == x.size(0)) &&
                  t.size(1) == x.size(1) && t.size(2) == 1 && t.size(3) == x.size(3);
  if (!ok)
    value_error(a.what() + " has shape " + c10::str(t.sizes()) + " but must be [" +
                std::to_string(x.size(0)) + " or 1, " + std::to_string(x.size(1)) + ", 1, " +
                std::to_string(x.size(3)) + "] for x " + c10::str(x.sizes()));
}

at::Tensor rope(py::handle x_obj, py::handle cos_obj, py::handle sin_obj, bool backward) {
  const at::Tensor& x = tensor_arg(x_obj, {"rope", "x"});
  check_float(x, {"rope", "x"});
  if (x.dim() != 4 || x.size(3) % 2)
    value_error("rope: x must be [B, S, heads, D] with an even D, got shape " +
                c10::str(x.sizes()));
  const at::Tensor& cos = tensor_arg(cos_obj, {"rope", "cos"});
  const at::Tensor& sin = tensor_arg(sin_obj, {"rope", "sin"});
  check_angles(cos, {"rope", "cos"}, x);
  check_angles(sin, {"rope", "sin"}, x);
  if (x.size(2) * (x.size(3) / 2) >= (int64_t(1) << 31))
    value_error("rope: heads * D / 2 = " + std::to_string(x.size(2) * (x.size(3) / 2)) +
                " must be below 2^31");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  fused::RopeParams p{};
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.B = x.size(0), p.S = x.size(1), p.H = x.size(2), p.D = x.size(3);
  for (int d = 0; d < 4; ++d) p.xs[d] = x.stride(d);
  const int dims[3] = {0, 1, 3};  // cos/sin index [b, s, d]; the size-1 head dim is skipped
  for (int d = 0; d < 3; ++d) {
    // a size-1 batch dim broadcasts: stride 0 whatever the tensor says
    p.cs[d] = cos.size(dims[d]) == 1 ? 0 : cos.stride(dims[d]);
    p.ss[d] = sin.size(dims[d]) == 1 ? 0 : sin.stride(dims[d]);
  }
  p.dtype = dtype_code(x.scalar_type(), "rope: x");
  p.backward = backward ? 1 : 0;
  run_on(
      x.device(), "rope", [&] { fused::cpu::rope(p); },
      [&] {
#ifdef MEGADLM_WITH_CUDA
        glue::cuda_rope(p, x.device());
#endif
      });
  return out;
}

// ---- SwiGLU ----------------------------------------------------------------------------------
// Checks the fc1 output [..., 2F]; returns F.
int64_t check_gate_up(const at::Tensor& h, const char* op) {
  check_float(h, {op, "h"});
  check_contiguous(h, {op, "h"});
  if (h.dim() < 1 || h.size(-1) % 2)
    value_error(std::string(op) + ": h must be [..., 2F] ([gate | up]) with an even last dim, " +
                "got shape " + c10::str(h.sizes()));
  return h.size(-1) / 2;
}

std::vector<int64_t> half_shape(const at::Tensor& h, int64_t F) {
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end());
  shape.back() = F;
  return shape;
}

fused::SwigluParams swiglu_params(const at::Tensor& h, int64_t F) {
  fused::SwigluParams p{};
  p.in = h.data_ptr();
  p.F = F;
  p.M = F == 0 ? 0 : h.numel() / (2 * F);
  p.dtype = dtype_code(h.scalar_type(), "h");
  return p;
}

at::Tensor swiglu(py::handle h_obj) {
  const at::Tensor& h = tensor_arg(h_obj, {"swiglu", "h"});
  const int64_t F = check_gate_up(h, "swiglu");
  at::Tensor out = at::empty(half_shape(h, F), h.options());
  if (out.numel() == 0) return out;
  fused::SwigluParams p = swiglu_params(h, F);
  p.out = out.data_ptr();
  run_on(
      h.device(), "swiglu", [&] { fused::cpu::swiglu_fwd(p); },
      [&] {
#ifdef MEGADLM_WITH_CUDA
        glue::cuda_swiglu(p, true, h.device());
#endif
      });
  return out;
}

at::Tensor swiglu_backward(py::handle h_obj, py::handle grad_obj) {
  const at::Tensor& h = tensor_arg(h_obj, {"swiglu_backward", "h"});
  const int64_t F = check_gate_up(h, "swiglu_backward");
  const at::Tensor& g = tensor_arg(grad_obj, {"swiglu_backward", "grad_out"});
  const std::vector<int64_t> shape = half_shape(h, F);
  const c10::IntArrayRef want(shape);
  check_like(g, {"swiglu_backward", "grad_out"}, h, "h", &want);
  check_contiguous(g, {"swiglu_backward", "grad_out"});
  at::Tensor grad_h = at::empty(h.sizes(), h.options());
  if (grad_h.numel() == 0) return grad_h;
  fused::SwigluParams p = swiglu_params(h, F);
  p.grad = g.data_ptr();
  p.out = grad_h.data_ptr();
  run_on(
      h.device(), "swiglu_backward", [&] { fused::cpu::swiglu_bwd(p); },
      [&] {
#ifdef MEGADLM_WITH_CUDA
        glue::cuda_swiglu(p, false, h.device());
#endif
      });
  return grad_h;
}

// ---- residual add + RMSNorm --------------------------------------------------------------------
// x: [..., H] contiguous; weight: [H] of x's dtype and device. Returns H.
int64_t check_norm_input(const at::Tensor& x, const at::Tensor& w, const char* op,
                         const char* x_name) {
  check_float(x, {op, x_name});
  check_contiguous(x, {op, x_name});
  if (x.dim() < 1) value_error(std::string(op) + ": " + x_name + " must be [..., hidden]");
  const int64_t H = x.size(-1);
  const std::vector<int64_t> wshape{H};
  const c10::IntArrayRef want(wshape);
  check_like(w, {op, "weight"}, x, x_name, &want);
  check_contiguous(w, {op, "weight"});
  return H;
}

py::tuple add_rmsnorm(py::handle x_obj, py::handle h_obj, py::handle w_obj, double eps) {
  const at::Tensor& x = tensor_arg(x_obj, {"add_rmsnorm", "x"});
  const at::Tensor& h = tensor_arg(h_obj, {"add_rmsnorm", "h"});
  const at::Tensor& w = tensor_arg(w_obj, {"add_rmsnorm", "weight"});
  const int64_t H = check_norm_input(x, w, "add_rmsnorm", "x");
  check_like(h, {"add_rmsnorm", "h"}, x, "x");
  check_contiguous(h, {"add_rmsnorm", "h"});
  if (!(eps > 0.0) || !std::isfinite(eps))
    value_error("add_rmsnorm: eps must be a positive finite number, got " + std::to_string(eps));
  at::Tensor sum = at::empty(x.sizes(), x.options());
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    fused::AddNormFwdParams p{};
    p.x = x.data_ptr(), p.h = h.data_ptr(), p.w = w.data_ptr();
    p.sum = sum.data_ptr(), p.y = y.data_ptr(), p.rstd = rstd.data_ptr<float>();
    p.H = H, p.M = x.numel() / H, p.eps = float(eps);
    p.dtype = dtype_code(x.scalar_type(), "x");
    run_on(
        x.device(), "add_rmsnorm", [&] { fused::cpu::add_rmsnorm_fwd(p); },
        [&] {
#ifdef MEGADLM_WITH_CUDA
          glue::cuda_add_rmsnorm_fwd(p, x.device());
#endif
        });
  }
  return py::make_tuple(sum, y, rstd);
}

py::tuple add_rmsnorm_backward(py::handle gs_obj, py::handle gy_obj, py::handle sum_obj,
                               py::handle w_obj, py::handle rstd_obj) {
  const char* op = "add_rmsnorm_backward";
  const at::Tensor& s = tensor_arg(sum_obj, {op, "sum"});
  const at::Tensor& w = tensor_arg(w_obj, {op, "weight"});
  const int64_t H = check_norm_input(s, w, op, "sum");
  for (auto [obj, name] : {std::pair{gs_obj, "grad_sum"}, std::pair{gy_obj, "grad_y"}}) {
    const at::Tensor& g = tensor_arg(obj, {op, name});
    check_like(g, {op, name}, s, "sum");
    check_contiguous(g, {op, name});
  }
  const at::Tensor& gs = THPVariable_Unpack(gs_obj.ptr());
  const at::Tensor& gy = THPVariable_Unpack(gy_obj.ptr());
  const at::Tensor& rstd = tensor_arg(rstd_obj, {op, "rstd"});
  const bool rstd_ok = rstd.scalar_type() == at::kFloat && rstd.device() == s.device() &&
                       rstd.sizes().equals(s.sizes().slice(0, s.dim() - 1)) && rstd.is_contiguous();
  if (!rstd_ok)
    value_error(std::string(op) + ": rstd must be the contiguous float32 " +
                c10::str(s.sizes().slice(0, s.dim() - 1)) + " tensor add_rmsnorm returned, got " +
                c10::toString(rstd.scalar_type()) + " " + c10::str(rstd.sizes()) + " on " +
                rstd.device().str());
  at::Tensor grad_x = at::empty(s.sizes(), s.options());
  at::Tensor grad_w = at::empty({H}, w.options());
  fused::AddNormBwdParams p{};
  p.grad_sum = gs.data_ptr(), p.grad_y = gy.data_ptr(), p.sum = s.data_ptr();
  p.w = w.data_ptr(), p.rstd = rstd.data_ptr<float>();
  p.grad_x = grad_x.data_ptr(), p.grad_w = grad_w.data_ptr();
  p.H = H, p.M = H == 0 ? 0 : s.numel() / H;
  p.dtype = dtype_code(s.scalar_type(), "sum");
  if (H > 0)
    run_on(
        s.device(), op, [&] { fused::cpu::add_rmsnorm_bwd(p); },
        [&] {
#ifdef MEGADLM_WITH_CUDA
          glue::cuda_add_rmsnorm_bwd(p, s.device());
#endif
        });
  return py::make_tuple(grad_x, grad_w);
}

}  // namespace
}  // namespace megadlm

// Called by csrc/bindings.cpp's module definition.
void megadlm_register_fused(py::module_& m) {
  using namespace megadlm;
  m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"), py::kw_only(),
        py::arg("backward") = false);
  m.def("swiglu", &swiglu, py::arg("h"));
  m.def("swiglu_backward", &swiglu_backward, py::arg("h"), py::arg("grad_out"));
  m.def("add_rmsnorm", &add_rmsnorm, py::arg("x"), py::arg("h"), py::arg("weight"), py::arg("eps"));
  m.def("add_rmsnorm_backward", &add_rmsnorm_backward, py::arg("grad_sum"), py::arg("grad_y"),
        py::arg("sum"), py::arg("weight"), py::arg("rstd"));
}
