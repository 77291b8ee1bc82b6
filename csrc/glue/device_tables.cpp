// Device segment tables (see device_tables.h): the upload and read ordering shared with the
// content cache of cuda_glue.cpp, and the copies a TensorTable owns (cuda_run_owned).
//
// An owned copy lives in its BuiltTable, which lives in a TensorTable, a Python object.
// Freeing it is a CUDA free through torch's caching allocator, so it must not happen after
// the CUDA runtime has unloaded (the abort the content cache once caused from a static
// destructor). It cannot: a Python object is destroyed while the interpreter runs or during
// its finalization (module globals are cleared then, and PyTorch frees the tensors Python
// holds at that point), and both come before the C++ exit handlers that unload the runtime;
// an object never collected is never destroyed at all. Copies a captured graph reads move
// to keep_for_graphs' list, which is never destroyed.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <mutex>

#include "device_tables.h"
#include "glue.h"

namespace megadlm {
namespace glue {
namespace {

// Event recorded on `stream` after the upload (timing-free), destroyed with its copy.
std::shared_ptr<void> record_upload(const c10::cuda::CUDAStream& stream) {
  cudaEvent_t ev = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(ev, stream.stream()));
  return std::shared_ptr<void>(ev, [](void* e) { (void)cudaEventDestroy(cudaEvent_t(e)); });
}

// Relaxed capture mode for this thread while alive (only when `on`): pinned allocations,
// a side-stream copy and host syncs are then allowed while another stream captures.
struct RelaxCapture {
  explicit RelaxCapture(bool on) : on_(on) {
    if (on_) C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_));
  }
  ~RelaxCapture() {
    if (on_) (void)cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  bool on_;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// A stream of `device` other than `busy` (the capturing one) for the out-of-graph upload.
c10::cuda::CUDAStream side_stream(c10::Device device, const c10::cuda::CUDAStream& busy) {
  c10::cuda::CUDAStream s = c10::cuda::getStreamFromPool(false, device.index());
  return s == busy ? c10::cuda::getStreamFromPool(false, device.index()) : s;
}

}  // namespace

bool is_capturing(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capture));
  return capture != cudaStreamCaptureStatusNone;
}

DeviceCopy upload_segments(c10::Device device, const std::vector<Segment>& segs,
                           const c10::cuda::CUDAStream& stream, bool capturing) {
  const int64_t nbytes = int64_t(segs.size() * sizeof(Segment));
  RelaxCapture relax(capturing);  // a first sight of a table under capture
  at::Tensor host = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), segs.data(), size_t(nbytes));
  at::Tensor dev = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
  std::shared_ptr<void> uploaded;
  if (capturing) {
    // Not a memcpy node of the graph: filled now, for eager calls and every graph alike.
    const c10::cuda::CUDAStream side = side_stream(device, stream);
    C10_CUDA_CHECK(cudaMemcpyAsync(dev.data_ptr(), host.data_ptr(), size_t(nbytes),
                                   cudaMemcpyHostToDevice, side.stream()));
    C10_CUDA_CHECK(cudaStreamSynchronize(side.stream()));
  } else {  // ordered on `stream` before the kernel; torch keeps `host` until the copy ran
    dev.copy_(host, /*non_blocking=*/true);
    uploaded = record_upload(stream);
  }
  return DeviceCopy{host, dev, stream, uploaded, capturing};
}

void prepare_read(DeviceCopy& copy, const c10::cuda::CUDAStream& stream, bool capturing) {
  if (copy.alloc_stream != stream && copy.uploaded) {
    // The upload ran on alloc_stream: order this stream after it (a host wait under
    // capture, where an outside event cannot be waited on; only at capture time).
    if (capturing) {
      RelaxCapture relax(true);
      C10_CUDA_CHECK(cudaEventSynchronize(cudaEvent_t(copy.uploaded.get())));
    } else {
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), cudaEvent_t(copy.uploaded.get()), 0));
    }
  }
  if (capturing)
    copy.graph = true;
  else if (copy.alloc_stream != stream)
    copy.dev.record_stream(stream);
}

void keep_for_graphs(at::Tensor dev) {
  static std::mutex& mu = *new std::mutex();
  // Allocated once and never destroyed (see device_tables.h).
  static std::vector<at::Tensor>& kept = *new std::vector<at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  kept.push_back(std::move(dev));
}

// A TensorTable's device copy of one built segment table.
struct DeviceTable {
  explicit DeviceTable(DeviceCopy c) : copy(std::move(c)) {}
  ~DeviceTable() {
    if (copy.graph) keep_for_graphs(std::move(copy.dev));
  }
  DeviceCopy copy;
};

at::Tensor cuda_run_owned(OpKind op, c10::Device device, const std::vector<Segment>& segs,
                          int32_t pair, int64_t total, float scale, std::mutex& mu,
                          std::shared_ptr<DeviceTable>& dev) {
  if (segs.empty()) return cuda_launch(op, device, nullptr, 0, pair, total, scale);
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  const bool capturing = is_capturing(stream);
  at::Tensor keep;  // held until the launch is queued (stream order protects it after that)
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!dev) {
      dev = std::make_shared<DeviceTable>(upload_segments(device, segs, stream, capturing));
      // The owner never compares contents; torch's pinned allocator keeps the bytes until
      // the asynchronous upload has read them.
      dev->copy.host = at::Tensor();
    } else {
      prepare_read(dev->copy, stream, capturing);
    }
    keep = dev->copy.dev;
  }
  return cuda_launch(op, device, static_cast<const Segment*>(keep.data_ptr()), int64_t(segs.size()),
                     pair, total, scale);
}

}  // namespace glue
}  // namespace megadlm
