// Python bindings of the NCCL loader (always built: dlopen needs no NCCL at build time)
// and, in CUDA builds, of the communicator (csrc/glue/nccl_glue.cpp).
#include <torch/extension.h>

#include "nccl/nccl_api.h"
#ifdef MEGADLM_WITH_CUDA
#include "glue/glue.h"
#endif

namespace py = pybind11;

void megadlm_register_nccl(py::module_& m) {
  using namespace megadlm;
  m.def("nccl_load", [](const std::vector<std::string>& paths) {
    std::string error;
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = nccl::load(paths, &error);
    }
    return py::make_tuple(ok, error);
  }, py::arg("paths"), "Load libnccl from the first loadable path; returns (ok, reasons).");
  m.def("nccl_loaded", &nccl::loaded);
  m.def("nccl_path", &nccl::loaded_path);
  m.def("nccl_version", &nccl::version);
  m.def("nccl_unique_id", []() {
    nccl::UniqueId id = nccl::get_unique_id();
    return py::bytes(id.internal, sizeof(id.internal));
  });
#ifdef MEGADLM_WITH_CUDA
  glue::register_nccl_communicator(m);
#endif
}
