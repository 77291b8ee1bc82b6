// The NCCL communicator class (CUDA builds only): checks tensors, then calls the
// dlopen'ed NCCL (csrc/nccl) on torch's current stream of the communicator's device.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

#include "glue.h"
#include "../nccl/nccl_api.h"

namespace py = pybind11;

namespace megadlm {
namespace glue {
namespace {

class NcclCommunicator {
 public:
  NcclCommunicator(const py::bytes& unique_id, int rank, int world_size, int device)
      : world_(world_size), device_(device) {
    const std::string id = unique_id;
    if (id.size() != sizeof(nccl::UniqueId))
      throw py::value_error("unique_id must be 128 bytes (megadlm_ext.nccl.unique_id())");
    nccl::UniqueId uid;
    std::memcpy(uid.internal, id.data(), sizeof(uid.internal));
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    py::gil_scoped_release nogil;  // blocks until every rank has joined
    comm_ = nccl::comm_init_rank(world_size, uid, rank);
  }
  ~NcclCommunicator() {
    try { close(); } catch (...) {}
  }

  void all_reduce(const at::Tensor& t, int op) {
    const int dt = check(t, "tensor");
    Call c(this);
    nccl::all_reduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dt, op, live(), c.stream);
  }

  void reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op) {
    const int dt = check(out, "output");
    if (check(in, "input") != dt) throw py::value_error("reduce_scatter: input and output dtypes differ");
    if (in.numel() != out.numel() * world_)
      throw py::value_error("reduce_scatter: input has " + std::to_string(in.numel()) + " elements, expected output.numel() * world_size = " +
                            std::to_string(out.numel() * world_));
    Call c(this);
    nccl::reduce_scatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), dt, op, live(), c.stream);
  }

  void all_gather(const at::Tensor& out, const at::Tensor& in) {
    const int dt = check(out, "output");
    if (check(in, "input") != dt) throw py::value_error("all_gather: input and output dtypes differ");
    if (out.numel() != in.numel() * world_)
      throw py::value_error("all_gather: output has " + std::to_string(out.numel()) + " elements, expected input.numel() * world_size = " +
                            std::to_string(in.numel() * world_));
    Call c(this);
    nccl::all_gather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), dt, live(), c.stream);
  }

  void close() {
    if (comm_) {
      nccl::Comm c = comm_;
      comm_ = nullptr;
      nccl::comm_destroy(c);
    }
  }

 private:
  // Device guard + current stream of the communicator's device, GIL released.
  struct Call {
    explicit Call(NcclCommunicator* self)
        : guard(static_cast<c10::DeviceIndex>(self->device_)),
          stream(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(self->device_)).stream()) {}
    c10::cuda::CUDAGuard guard;
    cudaStream_t stream;
    py::gil_scoped_release nogil;
  };

  nccl::Comm live() const {
    if (!comm_) throw std::runtime_error("the NCCL communicator was closed");
    return comm_;
  }

  int check(const at::Tensor& t, const char* name) const {
    if (!t.is_cuda() || t.get_device() != device_)
      throw py::value_error(std::string(name) + " is on " + t.device().str() + " but the communicator is on cuda:" +
                            std::to_string(device_));
    if (!t.is_contiguous()) throw py::value_error(std::string(name) + " must be contiguous");
    switch (t.scalar_type()) {
      case at::kFloat: return nccl::kFloat32;
      case at::kBFloat16: return nccl::kBfloat16;
      case at::kHalf: return nccl::kFloat16;
      default:
        throw py::value_error(std::string(name) + " has dtype " + c10::toString(t.scalar_type()) +
                              "; supported: float32, bfloat16, float16");
    }
  }

  nccl::Comm comm_ = nullptr;
  int64_t world_;
  int device_;
};

}  // namespace

void register_nccl_communicator(py::module_& m) {
  py::class_<NcclCommunicator>(m, "NcclCommunicator")
      .def(py::init<const py::bytes&, int, int, int>(), py::arg("unique_id"), py::arg("rank"),
           py::arg("world_size"), py::arg("device"))
      .def("all_reduce", &NcclCommunicator::all_reduce, py::arg("tensor"), py::arg("op"))
      .def("reduce_scatter", &NcclCommunicator::reduce_scatter, py::arg("output"), py::arg("input"), py::arg("op"))
      .def("all_gather", &NcclCommunicator::all_gather, py::arg("output"), py::arg("input"))
      .def("close", &NcclCommunicator::close);
}

}  // namespace glue
}  // namespace megadlm
