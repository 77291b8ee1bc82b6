// Device copies of segment tables (CUDA builds), shared by the content cache of lists
// (cuda_glue.cpp) and the copies TensorTables own (device_tables.cpp): the upload, which
// under CUDA-graph capture happens outside the graph, and the ordering of a reading stream
// after it.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include "../torch_headers.h"

#include <memory>
#include <vector>

#include "megadlm/multi_tensor.h"

namespace megadlm {
namespace glue {

struct DeviceCopy {
  at::Tensor host;  // pinned bytes uploaded from (the content cache compares against them)
  at::Tensor dev;   // the table on the device
  c10::cuda::CUDAStream alloc_stream;  // where `dev` was allocated and uploaded
  std::shared_ptr<void> uploaded;      // event after the upload on alloc_stream (null: synchronous)
  bool graph = false;  // read by a captured CUDA graph: must live as long as the graph
};

// Whether `stream` is being captured into a CUDA graph.
bool is_capturing(const c10::cuda::CUDAStream& stream);

// A new device copy of `segs`, readable by work queued on `stream` from now on. Under
// capture (`capturing`) it is filled now, outside the graph (a synchronous copy on a side
// stream, capture mode relaxed for this thread): eager calls and every graph read a
// filled table, and the graph holds no memcpy node. Marked `graph` then.
DeviceCopy upload_segments(c10::Device device, const std::vector<Segment>& segs,
                           const c10::cuda::CUDAStream& stream, bool capturing);

// Make `copy.dev` safe to read from `stream` for work queued from now on: ordered after
// the upload (a host wait under capture, where an outside event cannot be waited on), and
// either record_stream'ed (so freeing it waits for that work) or, under capture, marked
// `graph`.
void prepare_read(DeviceCopy& copy, const c10::cuda::CUDAStream& stream, bool capturing);

// Keep `dev` until the process ends (a captured graph may still read it). Never destroyed:
// no CUDA call from a static destructor after the runtime has unloaded.
void keep_for_graphs(at::Tensor dev);

}  // namespace glue
}  // namespace megadlm
