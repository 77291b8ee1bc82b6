// Python-facing pieces shared by the communicator bindings (csrc/nccl_bindings.cpp,
// every build) and the CUDA communicator (csrc/glue/nccl_glue.cpp, CUDA builds): the
// work handle returned by collectives, the Ctrl-C check, and construction without the
// GIL. Torch/pybind11 headers only, no CUDA.
#pragma once

#include "../torch_headers.h"

#include <functional>
#include <memory>
#include <vector>

#include "communicator.h"

namespace megadlm {
namespace nccl {

// Handle of one collective. wait() makes the waiting stream (torch's current stream in
// CUDA builds) wait for the collective's completion event -- no host sync -- and then
// drops the buffer references it held.
struct PyWork {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Work> work;
  std::vector<at::Tensor> keep;
  std::function<void*()> stream;

  void wait() {
    {
      pybind11::gil_scoped_release nogil;
      comm->wait(*work, stream());
    }
    keep.clear();
  }
  bool is_completed() {
    pybind11::gil_scoped_release nogil;
    return comm->completed(*work);
  }
};

// Polled by waits without the GIL: true once a signal handler raised (e.g. Ctrl-C ->
// KeyboardInterrupt is now the pending Python error).
inline bool python_interrupted() {
  pybind11::gil_scoped_acquire gil;
  return PyErr_CheckSignals() != 0;
}

// Build a Communicator with the GIL released (init polls for the other ranks). An
// interrupt re-raises the pending Python exception after the abort.
inline std::shared_ptr<Communicator> make_communicator(const UniqueId& id, int rank, int nranks,
                                                       double timeout_s, const StreamOps& ops,
                                                       void* comm_stream, double poll_s,
                                                       int device) {
  std::shared_ptr<Communicator> comm;
  bool interrupted = false;
  {
    pybind11::gil_scoped_release nogil;
    try {
      comm = std::make_shared<Communicator>(id, rank, nranks, timeout_s, ops, comm_stream,
                                            python_interrupted, poll_s, device);
    } catch (const CommInterrupted&) {
      interrupted = true;
    }
  }
  if (interrupted) throw pybind11::error_already_set();
  return comm;
}

// Release the GIL around close(): ncclCommFinalize/Destroy may wait for the device.
inline void close_without_gil(const std::shared_ptr<Communicator>& comm, double grace_s) {
  pybind11::gil_scoped_release nogil;
  comm->close(grace_s);
}

inline UniqueId unique_id_from(const std::string& bytes) {
  if (bytes.size() != sizeof(UniqueId))
    throw pybind11::value_error("unique_id must be 128 bytes (megadlm_ext.nccl.unique_id()), got " +
                                std::to_string(bytes.size()));
  UniqueId uid;
  std::memcpy(uid.internal, bytes.data(), sizeof(uid.internal));
  return uid;
}

}  // namespace nccl
}  // namespace megadlm
