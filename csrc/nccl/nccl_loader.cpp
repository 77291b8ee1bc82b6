// dlopen-based loader of libnccl.so.2 (see nccl_api.h). Torch-free and CUDA-free.
#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

#include "nccl_api.h"

namespace megadlm {
namespace nccl {
namespace {

using R = int;  // ncclResult_t
struct Api {
  R (*get_unique_id)(UniqueId*) = nullptr;
  R (*comm_init_rank_config)(Comm*, int, UniqueId, int, Config*) = nullptr;  // id by value
  R (*get_async_error)(Comm, R*) = nullptr;
  R (*comm_abort)(Comm) = nullptr;
  R (*comm_finalize)(Comm) = nullptr;
  R (*comm_destroy)(Comm) = nullptr;
  R (*all_reduce)(const void*, void*, size_t, int, int, Comm, void*) = nullptr;
  R (*reduce_scatter)(const void*, void*, size_t, int, int, Comm, void*) = nullptr;
  R (*all_gather)(const void*, void*, size_t, int, Comm, void*) = nullptr;
  const char* (*error_string)(R) = nullptr;
  R (*get_version)(int*) = nullptr;
  void* handle = nullptr;
  std::string path;
  int version = 0;
};

std::mutex g_mutex;
Api g_api;

template <typename F>
bool sym(void* h, const char* name, F& out, std::string& why) {
  out = reinterpret_cast<F>(dlsym(h, name));
  if (!out) why += std::string(" missing symbol ") + name + ";";
  return out != nullptr;
}

bool bind_all(void* h, Api& a, std::string& why) {
  // `&` (not `&&`): every missing symbol is listed, not just the first.
  return sym(h, "ncclGetUniqueId", a.get_unique_id, why) &
         sym(h, "ncclCommInitRankConfig", a.comm_init_rank_config, why) &
         sym(h, "ncclCommGetAsyncError", a.get_async_error, why) &
         sym(h, "ncclCommAbort", a.comm_abort, why) &
         sym(h, "ncclCommFinalize", a.comm_finalize, why) &
         sym(h, "ncclCommDestroy", a.comm_destroy, why) &
         sym(h, "ncclAllReduce", a.all_reduce, why) &
         sym(h, "ncclReduceScatter", a.reduce_scatter, why) &
         sym(h, "ncclAllGather", a.all_gather, why) &
         sym(h, "ncclGetErrorString", a.error_string, why) &
         sym(h, "ncclGetVersion", a.get_version, why);
}

const Api& api() {
  if (!g_api.handle)
    throw std::runtime_error(
        "libnccl is not loaded: call megadlm_ext.nccl.available() first "
        "(set MEGADLM_NCCL_LIB=/path/to/libnccl.so.2 if it is not found)");
  return g_api;
}
}  // namespace

std::string version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
         std::to_string(code % 100);
}

bool load(const std::vector<std::string>& paths, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_api.handle) return true;
  std::string errors;
  bool ok = false;
  for (const std::string& p : paths) {
    void* h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      errors += p + ": " + (e ? e : "dlopen failed") + "\n";
      continue;
    }
    Api a;
    std::string why;
    if (bind_all(h, a, why)) {
      if (a.get_version(&a.version) != 0)
        why = " ncclGetVersion failed";
      else if (a.version < kMinVersion)
        why = " NCCL " + version_string(a.version) +
              " is too old: megadlm_ext needs NCCL >= " + version_string(kMinVersion) +
              " (non-blocking init with a timeout; avg and bf16 need 2.10)";
    }
    if (!why.empty()) {
      errors += p + ":" + why + "\n";
      dlclose(h);
      continue;
    }
    a.handle = h;
    a.path = p;
    g_api = a;
    ok = true;
    break;
  }
  if (error) *error = errors;
  return ok;
}

bool loaded() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_api.handle != nullptr;
}

std::string loaded_path() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_api.path;
}

int version() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_api.version;
}

std::string error_string(int result) {
  const char* msg = g_api.error_string ? g_api.error_string(result) : nullptr;
  return std::string(msg ? msg : "unknown error") + " (ncclResult_t " + std::to_string(result) +
         ")";
}

UniqueId get_unique_id() {
  UniqueId id{};
  const int r = api().get_unique_id(&id);
  if (r != kSuccess) throw std::runtime_error("NCCL ncclGetUniqueId failed: " + error_string(r));
  return id;
}

int comm_init_rank_config(Comm* comm, int nranks, const UniqueId& id, int rank, Config* config) {
  return api().comm_init_rank_config(comm, nranks, id, rank, config);
}
int get_async_error(Comm comm, int* state) {
  return api().get_async_error(comm, state);
}
int comm_abort(Comm comm) {
  return api().comm_abort(comm);
}
int comm_finalize(Comm comm) {
  return api().comm_finalize(comm);
}
int comm_destroy(Comm comm) {
  return api().comm_destroy(comm);
}

int all_reduce(const void* send, void* recv, size_t count, int dtype, int op, Comm comm,
               void* stream) {
  return api().all_reduce(send, recv, count, dtype, op, comm, stream);
}
int reduce_scatter(const void* send, void* recv, size_t recv_count, int dtype, int op, Comm comm,
                   void* stream) {
  return api().reduce_scatter(send, recv, recv_count, dtype, op, comm, stream);
}
int all_gather(const void* send, void* recv, size_t send_count, int dtype, Comm comm,
               void* stream) {
  return api().all_gather(send, recv, send_count, dtype, comm, stream);
}

}  // namespace nccl
}  // namespace megadlm
