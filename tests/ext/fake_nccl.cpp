// A fake libnccl.so.2 for the communicator tests (tests/ext/test_nccl_fake.py): the
// NCCL entry points megadlm_ext's loader binds, with behaviour the test controls
// through fake_* functions (ctypes), plus host "streams" and "events" exported as
// megadlm_test_stream_ops. Lets CPU-only CI run the real dlopen loader, the
// non-blocking init with its timeout, the watchdog, abort and the stream/event
// ordering of every collective, CUDA-graph capture (a captured event cannot be queried,
// as in CUDA), the runtime's "unloading" code at exit and the watchdog thread's device
// binding. Not part of the package. Build:
//   g++ -std=c++17 -shared -fPIC -DFAKE_VERSION=22703 fake_nccl.cpp -o libnccl.so.2
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#ifndef FAKE_VERSION
#define FAKE_VERSION 22703
#endif

namespace {
enum { kSuccess = 0, kInternalError = 3, kInvalidUsage = 5, kInProgress = 7 };

// A host stream: ops enqueued count up; unless held, each completes at once.
struct Stream {
  uint64_t enqueued = 0, completed = 0;
  bool held = false;
  bool capturing = false;  // being captured into a graph (spreads through stream waits)
  void push() {
    ++enqueued;
    if (!held) completed = enqueued;
  }
};
struct Event {
  Stream* stream = nullptr;
  uint64_t target = 0;
  bool captured = false;  // recorded on a capturing stream: a query is an error
};
enum {
  kCaptureQueryError = 900,
  kUnloading = 4
};  // cudaErrorStreamCaptureUnsupported, ...Unloading
struct UniqueId {
  char internal[128];
};  // passed by value, as ncclUniqueId
struct Comm {
  int polls_left = 0;  // init: ncclInProgress for this many polls (-1: forever)
  int rank = 0;
};

std::mutex g_mu;
std::string g_log;             // "op:arg;" entries, read by fake_log()
int g_init_polls = 0;          // polls before init completes (-1: never)
int g_async_error = kSuccess;  // returned by ncclCommGetAsyncError once init is done
int g_aborts = 0, g_destroys = 0, g_finalizes = 0, g_events_live = 0;
int g_block_destroy = 0;  // 1: ncclCommDestroy waits for fake_unblock_destroy()
int g_destroy_timed_out = 0;
int g_finalize_polls = 0;  // ncclCommGetAsyncError reports in-progress this often after finalize
int g_query_error = 0;     // returned by every event query when set (e.g. kUnloading)
std::thread::id g_init_thread;

void log(const std::string& s) {
  g_log += s + ";";
}
std::string id(const void* p) {
  return std::to_string(reinterpret_cast<uintptr_t>(p) % 100000);
}
}  // namespace

extern "C" {
// ---- control (ctypes) ----------------------------------------------------------------
void fake_reset() {
  std::lock_guard<std::mutex> l(g_mu);
  g_log.clear();
  g_init_polls = 0;
  g_async_error = kSuccess;
  g_aborts = g_destroys = g_finalizes = 0;
  g_block_destroy = 0;
  g_destroy_timed_out = 0;
  g_finalize_polls = 0;
  g_query_error = 0;
}
void fake_set_finalize_polls(int n) {  // -1: the flush never finishes (a dead peer)
  std::lock_guard<std::mutex> l(g_mu);
  g_finalize_polls = n;
}
void fake_set_query_error(int code) {
  std::lock_guard<std::mutex> l(g_mu);
  g_query_error = code;
}
void fake_stream_capture(void* s, int on) {
  std::lock_guard<std::mutex> l(g_mu);
  static_cast<Stream*>(s)->capturing = on != 0;
}
void fake_set_init_polls(int n) {
  std::lock_guard<std::mutex> l(g_mu);
  g_init_polls = n;
}
void fake_set_async_error(int code) {
  std::lock_guard<std::mutex> l(g_mu);
  g_async_error = code;
}
void fake_set_block_destroy(int on) {
  std::lock_guard<std::mutex> l(g_mu);
  g_block_destroy = on;
}
void fake_unblock_destroy() {
  std::lock_guard<std::mutex> l(g_mu);
  g_block_destroy = 0;
}
int fake_aborts() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_aborts;
}
int fake_destroys() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_destroys;
}
int fake_finalizes() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_finalizes;
}
int fake_destroy_timed_out() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_destroy_timed_out;
}
int fake_events_live() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_events_live;
}
const char* fake_log() {
  static std::string copy;
  std::lock_guard<std::mutex> l(g_mu);
  copy = g_log;
  return copy.c_str();
}
void* fake_stream_create() {
  return new Stream();
}
void fake_stream_hold(void* s, int held) {
  std::lock_guard<std::mutex> l(g_mu);
  auto* st = static_cast<Stream*>(s);
  st->held = held != 0;
  if (!st->held) st->completed = st->enqueued;
}

// ---- NCCL ABI ------------------------------------------------------------------------
int ncclGetVersion(int* v) {
  *v = FAKE_VERSION;
  return kSuccess;
}
const char* ncclGetErrorString(int r) {
  switch (r) {
    case kSuccess: return "no error";
    case kInternalError: return "internal error - please report this issue to the NCCL developers";
    case kInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case kInProgress: return "NCCL operation in progress";
    default: return "fake error";
  }
}
int ncclGetUniqueId(void* uid) {
  std::memset(uid, 7, 128);
  return kSuccess;
}
int ncclCommInitRankConfig(void** comm, int nranks, UniqueId uid, int rank, void* config) {
  (void)uid;
  std::lock_guard<std::mutex> l(g_mu);
  const int blocking =
      *reinterpret_cast<int*>(static_cast<char*>(config) + 16);  // after size/magic/version
  if (nranks < 1 || rank < 0 || rank >= nranks) return kInvalidUsage;
  auto* c = new Comm();
  c->polls_left = g_init_polls;
  c->rank = rank;
  *comm = c;
  g_init_thread = std::this_thread::get_id();
  log("init:blocking=" + std::to_string(blocking));
  return c->polls_left == 0 ? kSuccess : kInProgress;
}
int ncclCommGetAsyncError(void* comm, int* state) {
  std::lock_guard<std::mutex> l(g_mu);
  auto* c = static_cast<Comm*>(comm);
  if (c->polls_left != 0) {
    if (c->polls_left > 0) --c->polls_left;
    *state = kInProgress;
    return kSuccess;
  }
  *state = g_async_error;
  return kSuccess;
}
int ncclCommAbort(void* comm) {
  std::lock_guard<std::mutex> l(g_mu);
  ++g_aborts;
  log("abort");
  delete static_cast<Comm*>(comm);
  return kSuccess;
}
int ncclCommFinalize(void* comm) {
  std::lock_guard<std::mutex> l(g_mu);
  ++g_finalizes;
  static_cast<Comm*>(comm)->polls_left = g_finalize_polls;
  log("finalize");
  return kSuccess;
}
int ncclCommDestroy(void* comm) {
  // Blocks (like a real destroy waiting for the device) until the test's other Python
  // thread unblocks it -- which it can only do if the caller released the GIL.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    {
      std::lock_guard<std::mutex> l(g_mu);
      if (!g_block_destroy) break;
      if (std::chrono::steady_clock::now() > until) {
        g_destroy_timed_out = 1;
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::lock_guard<std::mutex> l(g_mu);
  ++g_destroys;
  log("destroy");
  delete static_cast<Comm*>(comm);
  return kSuccess;
}
static int collective(const char* name, const void* send, void* recv, size_t bytes, void* stream) {
  std::lock_guard<std::mutex> l(g_mu);
  if (send != recv) std::memmove(recv, send, bytes);  // one rank: the identity
  static_cast<Stream*>(stream)->push();
  log(std::string(name) + ":" + id(stream));
  return kSuccess;
}
static size_t esize(int dtype) {
  return dtype == 7 ? 4 : 2;
}
int ncclAllReduce(const void* s, void* r, size_t n, int dt, int, void*, void* st) {
  return collective("allreduce", s, r, n * esize(dt), st);
}
int ncclReduceScatter(const void* s, void* r, size_t n, int dt, int, void*, void* st) {
  return collective("reducescatter", s, r, n * esize(dt), st);
}
int ncclAllGather(const void* s, void* r, size_t n, int dt, void*, void* st) {
  return collective("allgather", s, r, n * esize(dt), st);
}

// ---- host streams/events, with the layout of megadlm::nccl::StreamOps ------------------
static int ev_create(void** e) {
  std::lock_guard<std::mutex> l(g_mu);
  ++g_events_live;
  *e = new Event();
  return 0;
}
static int ev_destroy(void* e) {
  std::lock_guard<std::mutex> l(g_mu);
  --g_events_live;
  delete static_cast<Event*>(e);
  return 0;
}
static int ev_record(void* e, void* s) {
  std::lock_guard<std::mutex> l(g_mu);
  auto* ev = static_cast<Event*>(e);
  ev->stream = static_cast<Stream*>(s);
  ev->target = ev->stream->enqueued;
  ev->captured = ev->stream->capturing;
  log("record:" + id(s));
  return 0;
}
static int stream_wait(void* s, void* e) {
  std::lock_guard<std::mutex> l(g_mu);
  // Waiting on a captured event pulls the waiting stream into the capture (as in CUDA).
  if (static_cast<Event*>(e)->captured) static_cast<Stream*>(s)->capturing = true;
  log("wait:" + id(s) + "<-" + id(static_cast<Event*>(e)->stream));
  return 0;
}
static int ev_query(void* e) {
  std::lock_guard<std::mutex> l(g_mu);
  auto* ev = static_cast<Event*>(e);
  if (g_query_error) return g_query_error;
  if (ev->captured) return kCaptureQueryError;
  return ev->stream && ev->stream->completed < ev->target ? 1 : 0;
}
static const char* err_string(int) {
  return "fake stream error";
}
static int thread_init(int device) {
  std::lock_guard<std::mutex> l(g_mu);
  const bool other = std::this_thread::get_id() != g_init_thread;
  log("thread_init:" + std::to_string(device) + (other ? ":other-thread" : ":init-thread"));
  return 0;
}
static int stream_capturing(void* s, int* capturing) {
  std::lock_guard<std::mutex> l(g_mu);
  *capturing = static_cast<Stream*>(s)->capturing ? 1 : 0;
  return 0;
}
struct Ops {
  int (*c)(void**);
  int (*d)(void*);
  int (*r)(void*, void*);
  int (*w)(void*, void*);
  int (*q)(void*);
  const char* (*s)(int);
  int (*ti)(int);
  int (*sc)(void*, int*);
  int shutdown_error;
};
Ops megadlm_test_stream_ops = {ev_create,  ev_destroy,  ev_record,        stream_wait, ev_query,
                               err_string, thread_init, stream_capturing, kUnloading};
}
