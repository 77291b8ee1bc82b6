// Host API of the fused AdamW step, megadlm_ext._C.adamw_step (see megadlm/adam.h for the
// math and megadlm_ext/__init__.py for the documented contract). Validates the five lists
// (ValueError naming the list and index; the reference route, megadlm_ext/reference_adam.py,
// words every check the same way), fills the AdamTensor table in a thread-local arena,
// releases the GIL and runs the CPU kernel or, for CUDA tensors in CUDA builds, the CUDA
// glue on torch's current stream.
#include "torch_headers.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "megadlm/adam.h"
#include "tensor_list.h"

#ifdef MEGADLM_WITH_CUDA
#include "glue/adam_glue.h"
#endif

namespace py = pybind11;

namespace megadlm {
namespace {

enum List { kParams, kGrads, kExpAvgs, kExpAvgSqs, kModelParams, kLists };
const char* const kNames[kLists] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "model_params"};

struct AdamArena {
  std::array<std::vector<Item>, kLists> lists;
  std::vector<AdamTensor> table;
  // (first byte, end byte, list, index) of every non-empty tensor: the aliasing check
  std::vector<std::tuple<uintptr_t, uintptr_t, int, int64_t>> spans;
};
AdamArena& adam_arena() {
  thread_local AdamArena a;
  return a;
}

std::string at(int list, size_t i) {
  return std::string(kNames[list]) + "[" + std::to_string(i) + "]";
}

std::string dtype_str(int32_t code) {
  return code == kF32 ? "torch.float32" : code == kBF16 ? "torch.bfloat16" : "torch.float16";
}

[[noreturn]] void fail(const std::string& msg) {
  value_error("adamw_step: " + msg);
}

// The one dtype of list `k` (checked against `allowed`, `what` says which are); the dtype
// of an empty list is the first allowed.
int32_t list_dtype(int k, const std::vector<Item>& items, std::initializer_list<int32_t> allowed,
                   const char* what) {
  if (items.empty()) return *allowed.begin();
  const int32_t d = items[0].dtype;
  if (std::find(allowed.begin(), allowed.end(), d) == allowed.end())
    fail(at(k, 0) + " has dtype " + dtype_str(d) + "; " + kNames[k] + " must be " + what);
  for (size_t i = 1; i < items.size(); ++i)
    if (items[i].dtype != d)
      fail(at(k, i) + " is " + dtype_str(items[i].dtype) + " but " + at(k, 0) + " is " +
           dtype_str(d) + ": one dtype per list (call adamw_step once per dtype combination)");
  return d;
}

void check_scalars(double lr, double beta1, double beta2, double eps, double wd, int64_t step) {
  auto need = [](bool ok, const char* name, double v, const char* range) {
    if (!ok)  // the value as Python prints it, as the reference route's message does
      fail(std::string(name) + " must be " + range + ", got " +
           py::str(py::float_(v)).cast<std::string>());
  };
  need(std::isfinite(lr) && lr >= 0, "lr", lr, "a finite number >= 0");
  need(beta1 >= 0 && beta1 < 1, "beta1", beta1, "in [0, 1)");
  need(beta2 >= 0 && beta2 < 1, "beta2", beta2, "in [0, 1)");
  need(std::isfinite(eps) && eps >= 0, "eps", eps, "a finite number >= 0");
  need(std::isfinite(wd) && wd >= 0, "weight_decay", wd, "a finite number >= 0");
  if (step < 1)
    fail("step must be >= 1 (the number of this update, counted as torch's AdamW does), got " +
         std::to_string(step));
}

// Every tensor the step reads or writes must be distinct memory: the kernel writes params,
// moments and model params in place and reads the grads in the same pass.
void check_no_overlap(AdamArena& a, int nlists) {
  auto& spans = a.spans;
  spans.clear();
  for (int k = 0; k < nlists; ++k)
    for (size_t i = 0; i < a.lists[k].size(); ++i) {
      const Item& it = a.lists[k][i];
      if (!it.numel) continue;
      const uintptr_t b = uintptr_t(it.ptr);
      spans.emplace_back(b, b + uintptr_t(it.numel * dtype_size(it.dtype)), k, int64_t(i));
    }
  std::sort(spans.begin(), spans.end());
  for (size_t s = 1; s < spans.size(); ++s) {
    if (std::get<0>(spans[s]) >= std::get<1>(spans[s - 1])) continue;
    auto x = std::make_pair(std::get<2>(spans[s - 1]), std::get<3>(spans[s - 1]));
    auto y = std::make_pair(std::get<2>(spans[s]), std::get<3>(spans[s]));
    if (y < x) std::swap(x, y);
    fail(at(x.first, size_t(x.second)) + " and " + at(y.first, size_t(y.second)) +
         " share memory: every tensor the step reads or writes must be distinct");
  }
}

// Parses and checks the lists into the arena; returns their device.
c10::Device parse_lists(AdamArena& a, const std::array<py::handle, kLists>& objs, int nlists) {
  const c10::Device device =
      parse_list("params", objs[kParams].ptr(), a.lists[kParams], c10::nullopt, "");
  const size_t n = a.lists[kParams].size();
  for (int k = kGrads; k < nlists; ++k) {
    parse_list(kNames[k], objs[k].ptr(), a.lists[k], device, "params[0]");
    if (a.lists[k].size() != n)
      fail(std::string(kNames[k]) + " has " + std::to_string(a.lists[k].size()) +
           " tensors but params has " + std::to_string(n) + " (one entry per parameter)");
  }
  for (int k = kGrads; k < nlists; ++k)
    for (size_t i = 0; i < n; ++i)
      if (a.lists[k][i].numel != a.lists[kParams][i].numel)
        fail(at(k, i) + " has " + std::to_string(a.lists[k][i].numel) + " elements but " +
             at(kParams, i) + " has " + std::to_string(a.lists[kParams][i].numel));
  return device;
}

void adamw_step(py::handle params, py::handle grads, py::handle exp_avgs, py::handle exp_avg_sqs,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                int64_t step, py::handle model_params) {
  AdamArena& a = adam_arena();
  const int nlists = model_params.is_none() ? kModelParams : kLists;
  const c10::Device device =
      parse_lists(a, {params, grads, exp_avgs, exp_avg_sqs, model_params}, nlists);
  AdamDTypes d;
  list_dtype(kParams, a.lists[kParams], {kF32}, "float32 (the fp32 main params)");
  d.grad = list_dtype(kGrads, a.lists[kGrads], {kF32, kBF16}, "float32 or bfloat16");
  const char* moments = "float32, bfloat16 or float16 (stored unscaled)";
  d.exp_avg = list_dtype(kExpAvgs, a.lists[kExpAvgs], {kF32, kBF16, kF16}, moments);
  d.exp_avg_sq = list_dtype(kExpAvgSqs, a.lists[kExpAvgSqs], {kF32, kBF16, kF16}, moments);
  d.model_param = nlists == kLists ? list_dtype(kModelParams, a.lists[kModelParams], {kBF16, kF16},
                                                "bfloat16 or float16 (the model params' copy; "
                                                "fp32 params are their own main params)")
                                   : kNoModelParam;
  check_scalars(lr, beta1, beta2, eps, weight_decay, step);
  check_no_overlap(a, nlists);

  a.table.clear();
  int64_t total = 0;
  for (size_t i = 0; i < a.lists[kParams].size(); ++i) {
    const int64_t numel = a.lists[kParams][i].numel;
    if (!numel) continue;
    a.table.push_back(
        AdamTensor{reinterpret_cast<float*>(a.lists[kParams][i].ptr), a.lists[kGrads][i].ptr,
                   a.lists[kExpAvgs][i].ptr, a.lists[kExpAvgSqs][i].ptr,
                   nlists == kLists ? a.lists[kModelParams][i].ptr : nullptr, total, numel, 0});
    total += numel;
  }
  if (total == 0) return;
  const AdamScalars s = adam_scalars(lr, beta1, beta2, eps, weight_decay, step);
  py::gil_scoped_release nogil;
  if (device.is_cpu()) return cpu::adam_run(a.table.data(), int64_t(a.table.size()), total, d, s);
#ifdef MEGADLM_WITH_CUDA
  if (device.is_cuda()) return glue::cuda_adamw(device, a.table, total, d, s);
#endif
  unsupported_device("adamw_step: params", device);
}

}  // namespace
}  // namespace megadlm

// Adds adamw_step to the module (called from bindings.cpp's PYBIND11_MODULE).
void megadlm_register_adam(py::module_& m) {
  m.def("adamw_step", &megadlm::adamw_step, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::kw_only(), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("model_params") = py::none());
}
