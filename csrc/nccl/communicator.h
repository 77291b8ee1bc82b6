// The NCCL communicator core: torch-free and CUDA-free, so CI compiles it with plain
// g++ and tests it against a fake libnccl (tests/ext/fake_nccl.cpp) on CPU.
//
// What it guarantees (the hang and overlap items of the GPU path):
//   * init is non-blocking (ncclCommInitRankConfig, blocking=0) and polled against a
//     deadline; on timeout or interrupt the communicator is aborted, never left waiting;
//   * every collective runs on the communicator's own stream: the comm stream first
//     waits on an event recorded on the caller's stream (so it sees the fold kernel's
//     output), and a completion event is recorded after it. Work::wait makes the
//     caller's stream wait on that event -- no host sync;
//   * a watchdog thread polls ncclCommGetAsyncError and the completion events; an
//     async error, or a collective that does not finish within the timeout, aborts the
//     communicator (ncclCommAbort) and every later call raises an error naming the
//     rank and the collective;
//   * the watchdog binds itself to the communicator's device (thread_init) and never
//     queries an event recorded under CUDA graph capture (such a work is not watched:
//     the graph's replays complete it); the runtime's "shutting down" code at process
//     exit stops it quietly instead of counting as a communicator failure;
//   * wait()/completed() ask NCCL for an async error first, so a wait after a failure
//     raises even before the watchdog's next poll; close() is bounded by a grace period
//     and aborts (instead of flushing) when in-flight work or the flush does not finish.
// Streams and events are reached through StreamOps: the CUDA runtime in CUDA builds
// (csrc/glue/nccl_glue.cpp), a fake in the CPU tests.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "nccl_api.h"

namespace megadlm {
namespace nccl {

// Stream/event primitives, C ABI (a test library can export one as a plain struct).
// Every int is 0 on success; event_query returns 0 (complete), 1 (not ready) or an error.
struct StreamOps {
  int (*event_create)(void** event);
  int (*event_destroy)(void* event);
  int (*event_record)(void* event, void* stream);
  int (*stream_wait_event)(void* stream, void* event);
  int (*event_query)(void* event);
  const char* (*error_string)(int code);
  // Run first on the watchdog thread (CUDA: set the device, relax the capture mode);
  // may be null.
  int (*thread_init)(int device);
  // *capturing = 1 while `stream` is being captured into a CUDA graph; may be null.
  int (*stream_capturing)(void* stream, int* capturing);
  // The event_query code meaning "the runtime is unloading" (process exit); 0: none.
  int shutdown_error;
};

// Raised for NCCL failures (async errors, aborts, refused calls) and timeouts.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CommTimeout : CommError {
  using CommError::CommError;
};
// Raised when the Interrupted callback asked to stop (the binding turns it into the
// pending Python exception, e.g. KeyboardInterrupt).
struct CommInterrupted : CommError {
  using CommError::CommError;
};

// One collective in flight: its completion event on the comm stream.
struct Work {
  Work(const StreamOps* ops, uint64_t seq, std::string what);
  ~Work();
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  const StreamOps* ops;
  void* done = nullptr;
  uint64_t seq;
  std::string what;  // "all_reduce #12 (4096 elements, bfloat16)"
  std::chrono::steady_clock::time_point issued;
  bool captured = false;  // issued under CUDA graph capture: completed by the graph's replays
};

class Communicator {
 public:
  // Returns true when the caller wants to stop (e.g. Ctrl-C seen); polled during waits.
  using Interrupted = std::function<bool()>;

  // Joins the other ranks (non-blocking init, polled every `poll_s`). Throws CommTimeout
  // after `timeout_s`, CommError on an NCCL error; the communicator is aborted first.
  // `device` is passed to ops.thread_init on the watchdog thread.
  Communicator(const UniqueId& id, int rank, int nranks, double timeout_s, const StreamOps& ops,
               void* comm_stream, const Interrupted& interrupted, double poll_s = 0.05,
               int device = 0);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Enqueue on the comm stream after the work already on `stream` (see the header note).
  std::shared_ptr<Work> all_reduce(const void* send, void* recv, size_t count, int dtype, int op,
                                   void* stream);
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, size_t recv_count, int dtype,
                                       int op, void* stream);
  std::shared_ptr<Work> all_gather(const void* send, void* recv, size_t send_count, int dtype,
                                   void* stream);

  // `stream` waits for `work` (device-side; throws if the communicator failed).
  void wait(const Work& work, void* stream);
  bool completed(const Work& work);
  // Abort now (idempotent); later calls raise CommError(`why`).
  void abort(const std::string& why);
  // Stop the watchdog, flush and destroy. In-flight work and the flush get `grace_s`
  // (capped by the timeout; <= 0: the timeout) before the communicator is aborted
  // instead: a dead peer cannot hold close() for the whole timeout. Idempotent.
  void close(double grace_s = kCloseGraceS);
  static constexpr double kCloseGraceS = 30.0;
  std::string error() const;
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  uint64_t issued() const;

 private:
  using Call = std::function<int(Comm)>;
  std::shared_ptr<Work> enqueue(const char* name, size_t count, int dtype, void* stream,
                                const Call& call);
  // Poll ncclCommGetAsyncError until not in progress; on error/timeout (`limit`, default
  // the communicator's timeout) abort and throw.
  void wait_ready_locked(const std::string& what, bool interruptible);
  // `on_timeout`: the message when `limit` passes (default: the init's).
  void wait_ready_locked(const std::string& what, bool interruptible,
                         std::chrono::duration<double> limit, const std::string& on_timeout = "");
  // Throw if the communicator failed, or if NCCL reports an async error now.
  void check_healthy_locked(const char* what);
  bool drain_locked(std::chrono::steady_clock::time_point deadline);
  void watchdog();
  void fail_locked(const std::string& why);  // abort under mu_
  void check_ops(int code, const char* what);
  std::string where() const;  // "rank 1 of 4"

  const StreamOps ops_;
  void* comm_stream_;
  Interrupted interrupted_;
  const int rank_, nranks_, device_;
  const std::chrono::duration<double> timeout_, poll_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  Comm comm_ = nullptr;
  bool stop_ = false;
  bool unloading_ = false;  // the runtime is shutting down: NCCL and CUDA are left alone
  std::string error_;
  uint64_t seq_ = 0;
  std::string last_;  // the last collective issued, for error messages
  std::deque<std::shared_ptr<Work>> pending_;
  std::thread watchdog_;
};

}  // namespace nccl
}  // namespace megadlm
