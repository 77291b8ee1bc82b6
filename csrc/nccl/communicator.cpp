// NCCL communicator core (see communicator.h). Torch-free and CUDA-free.
#include "communicator.h"

#include <algorithm>

namespace megadlm {
namespace nccl {
namespace {

using Clock = std::chrono::steady_clock;

const char* dtype_name(int dtype) {
  switch (dtype) {
    case kFloat16: return "float16";
    case kFloat32: return "float32";
    case kBfloat16: return "bfloat16";
    default: return "unknown dtype";
  }
}

std::string seconds(std::chrono::duration<double> d) {
  std::string s = std::to_string(d.count());
  return s.substr(0, s.find('.') + 2) + " s";
}

// Short sleeps first (an enqueue in progress usually finishes in microseconds), then
// the poll period.
void backoff(std::chrono::duration<double>& nap, std::chrono::duration<double> poll) {
  std::this_thread::sleep_for(nap);
  nap = std::min(nap * 2, poll);
}
}  // namespace

Work::Work(const StreamOps* o, uint64_t s, std::string w)
    : ops(o), seq(s), what(std::move(w)), issued(Clock::now()) {}
Work::~Work() {
  if (done) ops->event_destroy(done);
}

Communicator::Communicator(const UniqueId& id, int rank, int nranks, double timeout_s,
                           const StreamOps& ops, void* comm_stream, const Interrupted& interrupted,
                           double poll_s, int device)
    : ops_(ops),
      comm_stream_(comm_stream),
      interrupted_(interrupted),
      rank_(rank),
      nranks_(nranks),
      device_(device),
      timeout_(timeout_s),
      poll_(poll_s) {
  if (timeout_s <= 0)
    throw std::invalid_argument("timeout must be positive, got " + std::to_string(timeout_s));
  std::lock_guard<std::mutex> lock(mu_);
  Config config;
  config.blocking = 0;  // returns at once; we poll with a deadline instead of hanging
  const int r = comm_init_rank_config(&comm_, nranks, id, rank, &config);
  if (r != kSuccess && r != kInProgress) {
    fail_locked("NCCL ncclCommInitRankConfig failed on " + where() + ": " + error_string(r));
    throw CommError(error_);
  }
  wait_ready_locked("ncclCommInitRankConfig", true);
  watchdog_ = std::thread([this] { watchdog(); });
}

Communicator::~Communicator() {
  try {
    close();
  } catch (...) {
  }
}

std::string Communicator::where() const {
  return "rank " + std::to_string(rank_) + " of " + std::to_string(nranks_);
}

void Communicator::fail_locked(const std::string& why) {
  // Never an empty message: an empty error_ reads as "healthy" to wait() and completed().
  if (error_.empty())
    error_ = why.empty() ? "the NCCL communicator was aborted on " + where() : why;
  if (comm_) {
    comm_abort(comm_);  // frees the communicator and unblocks its kernels
    comm_ = nullptr;
  }
  stop_ = true;
  cv_.notify_all();
}

void Communicator::wait_ready_locked(const std::string& what, bool interruptible) {
  wait_ready_locked(what, interruptible, timeout_);
}

void Communicator::wait_ready_locked(const std::string& what, bool interruptible,
                                     std::chrono::duration<double> limit,
                                     const std::string& on_timeout) {
  const auto deadline = Clock::now() + limit;
  std::chrono::duration<double> nap(1e-5);
  for (;;) {
    int state = kSuccess;
    const int r = get_async_error(comm_, &state);
    if (r != kSuccess) state = r;
    if (state == kSuccess) return;
    if (state != kInProgress) {
      fail_locked("NCCL " + what + " failed on " + where() + ": " + error_string(state) +
                  "; the communicator was aborted");
      throw CommError(error_);
    }
    if (Clock::now() >= deadline) {
      if (!on_timeout.empty()) {
        fail_locked(on_timeout);
        throw CommTimeout(error_);
      }
      fail_locked(
          "NCCL " + what + " timed out after " + seconds(limit) + " on " + where() +
          ": another rank never joined or stopped answering (did it fail after the unique-id "
          "broadcast?); the communicator was aborted. Raise --distributed-timeout-minutes if "
          "ranks are just slow to start");
      throw CommTimeout(error_);
    }
    if (interruptible && interrupted_ && interrupted_()) {
      fail_locked("NCCL " + what + " interrupted on " + where() + "; the communicator was aborted");
      throw CommInterrupted(error_);
    }
    backoff(nap, poll_);
  }
}

void Communicator::check_ops(int code, const char* what) {
  if (code != 0) {
    fail_locked(std::string(what) + " failed on " + where() + ": " +
                (ops_.error_string ? ops_.error_string(code) : "error " + std::to_string(code)));
    throw CommError(error_);
  }
}

std::shared_ptr<Work> Communicator::enqueue(const char* name, size_t count, int dtype, void* stream,
                                            const Call& call) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_) throw CommError(error_.empty() ? "the NCCL communicator was closed" : error_);
  const uint64_t seq = ++seq_;
  auto work =
      std::make_shared<Work>(&ops_, seq,
                             std::string(name) + " #" + std::to_string(seq) + " (" +
                                 std::to_string(count) + " elements, " + dtype_name(dtype) + ")");
  last_ = work->what;
  if (ops_.stream_capturing) {
    int capturing = 0;
    check_ops(ops_.stream_capturing(stream, &capturing), "querying the stream's capture status");
    work->captured = capturing != 0;
  }
  // The comm stream starts after everything already queued on the caller's stream.
  void* ready = nullptr;
  check_ops(ops_.event_create(&ready), "event create");
  const int rec = ops_.event_record(ready, stream);
  const int wt = rec ? rec : ops_.stream_wait_event(comm_stream_, ready);
  ops_.event_destroy(ready);  // legal once recorded: the wait keeps its own reference
  check_ops(wt, "ordering the comm stream after the current stream");
  const int r = call(comm_);
  if (r == kInProgress)
    wait_ready_locked(work->what, false);
  else if (r != kSuccess) {
    fail_locked("NCCL " + work->what + " failed on " + where() + ": " + error_string(r) +
                "; the communicator was aborted");
    throw CommError(error_);
  }
  check_ops(ops_.event_create(&work->done), "event create");
  check_ops(ops_.event_record(work->done, comm_stream_),
            "recording the collective's completion event");
  // A captured event must not be queried (the query fails, and in global capture mode
  // it would invalidate the capture): the watchdog watches eager work only.
  if (!work->captured) pending_.push_back(work);
  return work;
}

std::shared_ptr<Work> Communicator::all_reduce(const void* send, void* recv, size_t count,
                                               int dtype, int op, void* stream) {
  return enqueue("all_reduce", count, dtype, stream, [&](Comm c) {
    return nccl::all_reduce(send, recv, count, dtype, op, c, comm_stream_);
  });
}

std::shared_ptr<Work> Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count,
                                                   int dtype, int op, void* stream) {
  return enqueue("reduce_scatter", recv_count, dtype, stream, [&](Comm c) {
    return nccl::reduce_scatter(send, recv, recv_count, dtype, op, c, comm_stream_);
  });
}

std::shared_ptr<Work> Communicator::all_gather(const void* send, void* recv, size_t send_count,
                                               int dtype, void* stream) {
  return enqueue("all_gather", send_count, dtype, stream, [&](Comm c) {
    return nccl::all_gather(send, recv, send_count, dtype, c, comm_stream_);
  });
}

void Communicator::check_healthy_locked(const char* what) {
  if (!error_.empty()) throw CommError(error_);
  if (!comm_) throw CommError("the NCCL communicator was closed");
  // The watchdog polls every poll_s; ask NCCL now so a failure in between is not missed.
  int state = kSuccess;
  const int r = get_async_error(comm_, &state);
  if (r != kSuccess || (state != kSuccess && state != kInProgress)) {
    fail_locked(std::string("NCCL error on ") + where() + " seen by " + what + ": " +
                error_string(r != kSuccess ? r : state) + " (last collective issued: " +
                (last_.empty() ? "none" : last_) + "); the communicator was aborted");
    throw CommError(error_);
  }
}

void Communicator::wait(const Work& work, void* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  check_healthy_locked("wait()");
  check_ops(ops_.stream_wait_event(stream, work.done),
            "waiting for the collective's completion event");
}

bool Communicator::completed(const Work& work) {
  std::lock_guard<std::mutex> lock(mu_);
  check_healthy_locked("is_completed()");
  if (work.captured)
    throw CommError("NCCL " + work.what + " was captured into a CUDA graph on " + where() +
                    ": it completes with each replay; synchronize the replay's stream instead "
                    "of polling is_completed()");
  const int q = ops_.event_query(work.done);
  if (q != 0 && q != 1) check_ops(q, "querying the collective's completion event");
  return q == 0;
}

void Communicator::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_locked(why);
}

std::string Communicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

uint64_t Communicator::issued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seq_;
}

void Communicator::watchdog() {
  // Without this the thread's first CUDA call would create a context on device 0 (every
  // rank on GPU 0), and in global capture mode its queries would break a capture.
  const int init = ops_.thread_init ? ops_.thread_init(device_) : 0;
  std::unique_lock<std::mutex> lock(mu_);
  if (init != 0) {
    fail_locked("the NCCL watchdog could not bind to device " + std::to_string(device_) + " on " +
                where() + ": " +
                (ops_.error_string ? ops_.error_string(init) : std::to_string(init)) +
                "; the communicator was aborted");
    return;
  }
  while (!stop_) {
    cv_.wait_for(lock, poll_);
    if (stop_ || !comm_) break;
    int state = kSuccess;
    const int r = get_async_error(comm_, &state);
    if (r != kSuccess || (state != kSuccess && state != kInProgress)) {
      fail_locked("NCCL error on " + where() + ": " + error_string(r != kSuccess ? r : state) +
                  " (last collective issued: " + (last_.empty() ? "none" : last_) +
                  "); the watchdog aborted the communicator");
      break;
    }
    while (!pending_.empty()) {  // retire finished collectives, time the oldest one
      const int q = ops_.event_query(pending_.front()->done);
      if (q == 0) {
        pending_.pop_front();
        continue;
      }
      if (q != 1 && ops_.shutdown_error != 0 && q == ops_.shutdown_error) {
        // Process exit: the CUDA runtime is unloading. Not a communicator failure, and
        // NCCL/CUDA must not be called any more (abort/destroy would touch a dying runtime).
        if (error_.empty())
          error_ = "the CUDA runtime is shutting down (process exit); the NCCL communicator on " +
                   where() + " can no longer be used";
        unloading_ = true;
        stop_ = true;
        break;
      }
      if (q != 1) {
        fail_locked("CUDA error while waiting for NCCL " + pending_.front()->what + " on " +
                    where() + ": " +
                    (ops_.error_string ? ops_.error_string(q) : std::to_string(q)) +
                    "; the watchdog aborted the communicator");
      } else if (Clock::now() - pending_.front()->issued > timeout_) {
        fail_locked(
            "NCCL " + pending_.front()->what + " did not complete within " + seconds(timeout_) +
            " on " + where() +
            ": another rank failed, never issued it, or issued a different collective; the "
            "watchdog aborted the communicator. Raise --distributed-timeout-minutes if a step is "
            "legitimately that slow");
      }
      break;
    }
  }
}

bool Communicator::drain_locked(Clock::time_point deadline) {
  std::chrono::duration<double> nap(1e-5);
  while (!pending_.empty()) {
    const int q = ops_.event_query(pending_.front()->done);
    if (q == 0) {
      pending_.pop_front();
      continue;
    }
    if (q != 1 && ops_.shutdown_error != 0 && q == ops_.shutdown_error) unloading_ = true;
    if (q != 1 || Clock::now() >= deadline) return false;
    backoff(nap, poll_);
  }
  return true;
}

void Communicator::close(double grace_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (!comm_ || unloading_) {
    pending_.clear();
    return;
  }
  const std::chrono::duration<double> grace =
      grace_s > 0 ? std::min(timeout_, std::chrono::duration<double>(grace_s)) : timeout_;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(grace);
  // In-flight work that does not finish within the grace period means a peer is gone
  // (or stuck): a flush would wait for it, so abort instead.
  if (!drain_locked(deadline)) {
    if (unloading_) return;  // process exit: leave NCCL alone
    const std::string what = pending_.front()->what;
    pending_.clear();
    fail_locked("NCCL " + what + " was still in flight when the communicator on " + where() +
                " was closed (" + seconds(grace) +
                " grace): aborted instead of flushed (a peer may have died)");
    return;
  }
  // Flush queued collectives (finalize), bounded by what is left of the grace period.
  const int r = comm_finalize(comm_);
  if (r == kSuccess || r == kInProgress) {
    try {
      wait_ready_locked("ncclCommFinalize", false,
                        std::max(std::chrono::duration<double>(deadline - Clock::now()),
                                 std::chrono::duration<double>(poll_)),
                        "NCCL ncclCommFinalize did not finish within the " + seconds(grace) +
                            " grace of close() on " + where() +
                            " (a peer may have died): the communicator was aborted instead");
    } catch (const CommError&) {
      return;  // aborted by wait_ready_locked; nothing left to destroy
    }
    const int d = comm_destroy(comm_);
    comm_ = nullptr;
    if (d != kSuccess && d != kInProgress)
      error_ = "NCCL ncclCommDestroy failed on " + where() + ": " + error_string(d);
    if (error_.empty()) error_ = "the NCCL communicator was closed";
    return;
  }
  fail_locked("NCCL ncclCommFinalize failed on " + where() + ": " + error_string(r) +
              "; the communicator was aborted");
}

}  // namespace nccl
}  // namespace megadlm
