// The torch-facing NCCL communicator (CUDA builds only): checks tensors and drives the
// communicator core (csrc/nccl/communicator.h) with the CUDA runtime's streams/events.
// Each communicator owns a high-priority stream from torch's pool; a collective waits
// on the caller's current stream, runs on the comm stream, and returns an NcclWork
// whose wait() makes the current stream wait for it. Buffers are record_stream'ed on
// the comm stream (the caching allocator will not reuse them early) and held by the
// work until wait().
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "glue.h"
#include "../nccl/nccl_py.h"

namespace py = pybind11;

namespace megadlm {
namespace glue {
namespace {

// StreamOps over the CUDA runtime. Timing-free events: cheapest to record and query.
int ev_create(void** e) {
  return int(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(e), cudaEventDisableTiming));
}
int ev_destroy(void* e) {
  return int(cudaEventDestroy(static_cast<cudaEvent_t>(e)));
}
int ev_record(void* e, void* s) {
  return int(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(s)));
}
int stream_wait(void* s, void* e) {
  return int(cudaStreamWaitEvent(static_cast<cudaStream_t>(s), static_cast<cudaEvent_t>(e), 0));
}
int ev_query(void* e) {
  const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not-ready is not an error; keep it out of later checks
    return 1;
  }
  return r == cudaSuccess ? 0 : int(r);
}
const char* err_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
// The watchdog thread: bind to the communicator's device (its first CUDA call would
// otherwise create a context on device 0), and relax its capture mode so its event
// queries never invalidate a graph capture running on another thread.
int thread_init(int device) {
  const cudaError_t r = cudaSetDevice(device);
  if (r != cudaSuccess) return int(r);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  return int(cudaThreadExchangeStreamCaptureMode(&mode));
}
int stream_capturing(void* s, int* capturing) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const cudaError_t r = cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &st);
  *capturing = st != cudaStreamCaptureStatusNone;
  return int(r);
}
const nccl::StreamOps kCudaOps{ev_create,   ev_destroy,       ev_record,
                               stream_wait, ev_query,         err_string,
                               thread_init, stream_capturing, int(cudaErrorCudartUnloading)};

class NcclCommunicator {
 public:
  NcclCommunicator(const py::bytes& unique_id, int rank, int world_size, int device,
                   double timeout_s)
      : world_(world_size),
        device_(device),
        comm_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true,
                                                  static_cast<c10::DeviceIndex>(device))) {
    c10::cuda::CUDAGuard guard(
        static_cast<c10::DeviceIndex>(device));  // NCCL binds to the current device
    comm_ = nccl::make_communicator(nccl::unique_id_from(unique_id), rank, world_size, timeout_s,
                                    kCudaOps, comm_stream_.stream(), /*poll_s=*/0.1, device);
  }

  nccl::PyWork all_reduce(const at::Tensor& t, int op) {
    const int dt = check(t, "tensor");
    Call c(this);
    return keep(comm_->all_reduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dt, op, c.stream),
                {t});
  }

  nccl::PyWork reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op) {
    const int dt = check(out, "output");
    if (check(in, "input") != dt)
      throw py::value_error("reduce_scatter: input and output dtypes differ");
    if (in.numel() != out.numel() * world_)
      throw py::value_error("reduce_scatter: input has " + std::to_string(in.numel()) +
                            " elements, expected output.numel() * world_size = " +
                            std::to_string(out.numel() * world_));
    Call c(this);
    return keep(
        comm_->reduce_scatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), dt, op, c.stream),
        {out, in});
  }

  nccl::PyWork all_gather(const at::Tensor& out, const at::Tensor& in) {
    const int dt = check(out, "output");
    if (check(in, "input") != dt)
      throw py::value_error("all_gather: input and output dtypes differ");
    if (out.numel() != in.numel() * world_)
      throw py::value_error("all_gather: output has " + std::to_string(out.numel()) +
                            " elements, expected input.numel() * world_size = " +
                            std::to_string(in.numel() * world_));
    Call c(this);
    return keep(comm_->all_gather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), dt, c.stream),
                {out, in});
  }

  void abort(const std::string& why) { comm_->abort(why); }
  void close(double grace_s) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));  // finalize/destroy
    nccl::close_without_gil(comm_, grace_s);
  }
  std::string error() const { return comm_->error(); }
  int64_t stream_id() const { return int64_t(reinterpret_cast<uintptr_t>(comm_stream_.stream())); }

 private:
  // Device guard + current stream of the communicator's device, GIL released.
  struct Call {
    explicit Call(NcclCommunicator* self)
        : guard(static_cast<c10::DeviceIndex>(self->device_)),
          stream(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(self->device_))
                     .stream()) {}
    c10::cuda::CUDAGuard guard;
    cudaStream_t stream;
    py::gil_scoped_release nogil;
  };

  nccl::PyWork keep(std::shared_ptr<nccl::Work> w, std::vector<at::Tensor> tensors) {
    for (const at::Tensor& t : tensors) t.record_stream(comm_stream_);
    const auto dev = static_cast<c10::DeviceIndex>(device_);
    return nccl::PyWork{comm_, std::move(w), std::move(tensors), [dev] {
                          return static_cast<void*>(c10::cuda::getCurrentCUDAStream(dev).stream());
                        }};
  }

  int check(const at::Tensor& t, const char* name) const {
    if (!t.is_cuda() || t.get_device() != device_)
      throw py::value_error(std::string(name) + " is on " + t.device().str() +
                            " but the communicator is on cuda:" + std::to_string(device_));
    if (!t.is_contiguous())
      throw py::value_error(std::string(name) + " must be contiguous; pass t.contiguous()");
    switch (t.scalar_type()) {
      case at::kFloat: return nccl::kFloat32;
      case at::kBFloat16: return nccl::kBfloat16;
      case at::kHalf: return nccl::kFloat16;
      default:
        throw py::value_error(std::string(name) + " has dtype " + c10::toString(t.scalar_type()) +
                              "; supported: float32, bfloat16, float16");
    }
  }

  int64_t world_;
  int device_;
  c10::cuda::CUDAStream comm_stream_;
  std::shared_ptr<nccl::Communicator> comm_;
};

}  // namespace

void register_nccl_communicator(py::module_& m) {
  py::class_<NcclCommunicator>(m, "NcclCommunicator")
      .def(py::init<const py::bytes&, int, int, int, double>(), py::arg("unique_id"),
           py::arg("rank"), py::arg("world_size"), py::arg("device"), py::arg("timeout_s"))
      .def("all_reduce", &NcclCommunicator::all_reduce, py::arg("tensor"), py::arg("op"))
      .def("reduce_scatter", &NcclCommunicator::reduce_scatter, py::arg("output"), py::arg("input"),
           py::arg("op"))
      .def("all_gather", &NcclCommunicator::all_gather, py::arg("output"), py::arg("input"))
      .def("abort", &NcclCommunicator::abort, py::arg("why"))
      .def("close", &NcclCommunicator::close, py::arg("grace_s") = nccl::Communicator::kCloseGraceS)
      .def("error", &NcclCommunicator::error)
      .def_property_readonly("stream_id", &NcclCommunicator::stream_id);
}

}  // namespace glue
}  // namespace megadlm
