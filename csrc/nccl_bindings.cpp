// Python bindings of the NCCL loader and communicator core (always built: dlopen needs
// no NCCL at build time) and, in CUDA builds, of the torch-facing communicator
// (csrc/glue/nccl_glue.cpp).
#include <dlfcn.h>
#include "torch_headers.h"

#include "nccl/nccl_py.h"
#ifdef MEGADLM_WITH_CUDA
#include "glue/glue.h"
#endif

namespace py = pybind11;

namespace megadlm {
namespace {

// The communicator core over raw pointers and a StreamOps table exported (as the symbol
// `megadlm_test_stream_ops`) by a test library. Lets CPU tests drive the real init,
// watchdog, abort and stream/event ordering code against a fake libnccl.
class TestCommunicator {
 public:
  TestCommunicator(const py::bytes& uid, int rank, int nranks, double timeout_s, double poll_s,
                   const std::string& ops_library, uintptr_t comm_stream, int device) {
    void* h = dlopen(ops_library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) throw py::value_error("ops_library " + ops_library + ": " + dlerror());
    auto* ops = static_cast<const nccl::StreamOps*>(dlsym(h, "megadlm_test_stream_ops"));
    if (!ops)
      throw py::value_error("ops_library " + ops_library + " has no megadlm_test_stream_ops");
    comm_ = nccl::make_communicator(nccl::unique_id_from(uid), rank, nranks, timeout_s, *ops,
                                    reinterpret_cast<void*>(comm_stream), poll_s, device);
  }
  nccl::PyWork all_reduce(uintptr_t send, uintptr_t recv, size_t count, int dtype, int op,
                          uintptr_t stream) {
    py::gil_scoped_release nogil;
    return wrap(comm_->all_reduce(ptr(send), ptr(recv), count, dtype, op, ptr(stream)), stream);
  }
  nccl::PyWork all_gather(uintptr_t send, uintptr_t recv, size_t count, int dtype,
                          uintptr_t stream) {
    py::gil_scoped_release nogil;
    return wrap(comm_->all_gather(ptr(send), ptr(recv), count, dtype, ptr(stream)), stream);
  }
  void abort(const std::string& why) { comm_->abort(why); }
  void close(double grace_s) { nccl::close_without_gil(comm_, grace_s); }
  std::string error() const { return comm_->error(); }

 private:
  static void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }
  nccl::PyWork wrap(std::shared_ptr<nccl::Work> w, uintptr_t stream) {
    return nccl::PyWork{comm_, std::move(w), {}, [stream] { return ptr(stream); }};
  }
  std::shared_ptr<nccl::Communicator> comm_;
};

}  // namespace
}  // namespace megadlm

void megadlm_register_nccl(py::module_& m) {
  using namespace megadlm;
  // Translators are tried newest first: the subclass is registered after its base.
  auto& comm_error = py::register_exception<nccl::CommError>(m, "NcclError", PyExc_RuntimeError);
  py::register_exception<nccl::CommTimeout>(m, "NcclTimeoutError", comm_error.ptr());
  m.def(
      "nccl_load",
      [](const std::vector<std::string>& paths) {
        std::string error;
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = nccl::load(paths, &error);
        }
        return py::make_tuple(ok, error);
      },
      py::arg("paths"),
      "Load libnccl from the first usable path; returns (ok, why earlier paths were refused).");
  m.def("nccl_loaded", &nccl::loaded);
  m.def("nccl_path", &nccl::loaded_path);
  m.def("nccl_version", &nccl::version);
  m.attr("nccl_min_version") = nccl::kMinVersion;
  m.def("nccl_unique_id", []() {
    nccl::UniqueId id = nccl::get_unique_id();
    return py::bytes(id.internal, sizeof(id.internal));
  });
  py::class_<nccl::PyWork>(m, "NcclWork")
      .def("wait", &nccl::PyWork::wait,
           "Make the current stream wait for this collective (no host sync).")
      .def("is_completed", &nccl::PyWork::is_completed);
  py::class_<TestCommunicator>(m, "_NcclTestCommunicator")
      .def(py::init<const py::bytes&, int, int, double, double, const std::string&, uintptr_t,
                    int>(),
           py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("timeout_s"),
           py::arg("poll_s"), py::arg("ops_library"), py::arg("comm_stream"), py::arg("device") = 0)
      .def("all_reduce", &TestCommunicator::all_reduce, py::arg("send"), py::arg("recv"),
           py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"))
      .def("all_gather", &TestCommunicator::all_gather, py::arg("send"), py::arg("recv"),
           py::arg("count"), py::arg("dtype"), py::arg("stream"))
      .def("abort", &TestCommunicator::abort, py::arg("why"))
      .def("close", &TestCommunicator::close, py::arg("grace_s") = nccl::Communicator::kCloseGraceS)
      .def("error", &TestCommunicator::error);
#ifdef MEGADLM_WITH_CUDA
  glue::register_nccl_communicator(m);
#endif
}
