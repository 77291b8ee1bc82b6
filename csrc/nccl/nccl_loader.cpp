// dlopen-based loader of libnccl.so.2 (see nccl_api.h). Torch-free and CUDA-free.
#include <dlfcn.h>

#include <mutex>
#include <stdexcept>

#include "nccl_api.h"

namespace megadlm {
namespace nccl {
namespace {

using Result = int;  // ncclResult_t; 0 = ncclSuccess
struct Api {
  Result (*get_unique_id)(UniqueId*) = nullptr;
  Result (*comm_init_rank)(Comm*, int, UniqueId, int) = nullptr;  // id passed by value
  Result (*all_reduce)(const void*, void*, size_t, int, int, Comm, void*) = nullptr;
  Result (*reduce_scatter)(const void*, void*, size_t, int, int, Comm, void*) = nullptr;
  Result (*all_gather)(const void*, void*, size_t, int, Comm, void*) = nullptr;
  Result (*comm_destroy)(Comm) = nullptr;
  const char* (*error_string)(Result) = nullptr;
  Result (*get_version)(int*) = nullptr;
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

const Api& api() {
  if (!g_api.handle)
    throw std::runtime_error("libnccl is not loaded: call megadlm_ext.nccl.available() first "
                             "(set MEGADLM_NCCL_LIB=/path/to/libnccl.so.2 if it is not found)");
  return g_api;
}

void check(Result r, const char* what) {
  if (r != 0) {
    const char* msg = g_api.error_string ? g_api.error_string(r) : "unknown error";
    throw std::runtime_error(std::string("NCCL ") + what + " failed: " + msg + " (ncclResult_t " +
                             std::to_string(r) + ")");
  }
}
}  // namespace

bool load(const std::vector<std::string>& paths, std::string* error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_api.handle) return true;
  std::string errors;
  for (const std::string& p : paths) {
    void* h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      errors += p + ": " + (e ? e : "dlopen failed") + "\n";
      continue;
    }
    Api a;
    std::string why;
    bool ok = sym(h, "ncclGetUniqueId", a.get_unique_id, why) &
              sym(h, "ncclCommInitRank", a.comm_init_rank, why) &
              sym(h, "ncclAllReduce", a.all_reduce, why) &
              sym(h, "ncclReduceScatter", a.reduce_scatter, why) &
              sym(h, "ncclAllGather", a.all_gather, why) &
              sym(h, "ncclCommDestroy", a.comm_destroy, why) &
              sym(h, "ncclGetErrorString", a.error_string, why) &
              sym(h, "ncclGetVersion", a.get_version, why);
    if (!ok) {
      errors += p + ":" + why + "\n";
      dlclose(h);
      continue;
    }
    a.handle = h;
    a.path = p;
    if (a.get_version(&a.version) != 0) a.version = 0;
    g_api = a;
    return true;
  }
  if (error) *error = errors;
  return false;
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

UniqueId get_unique_id() {
  UniqueId id{};
  check(api().get_unique_id(&id), "ncclGetUniqueId");
  return id;
}

Comm comm_init_rank(int nranks, const UniqueId& id, int rank) {
  Comm c = nullptr;
  check(api().comm_init_rank(&c, nranks, id, rank), "ncclCommInitRank");
  return c;
}

void all_reduce(const void* send, void* recv, size_t count, int dtype, int op, Comm comm, void* stream) {
  check(api().all_reduce(send, recv, count, dtype, op, comm, stream), "ncclAllReduce");
}

void reduce_scatter(const void* send, void* recv, size_t recv_count, int dtype, int op, Comm comm,
                    void* stream) {
  check(api().reduce_scatter(send, recv, recv_count, dtype, op, comm, stream), "ncclReduceScatter");
}

void all_gather(const void* send, void* recv, size_t send_count, int dtype, Comm comm, void* stream) {
  check(api().all_gather(send, recv, send_count, dtype, comm, stream), "ncclAllGather");
}

void comm_destroy(Comm comm) {
  if (comm) check(api().comm_destroy(comm), "ncclCommDestroy");
}

}  // namespace nccl
}  // namespace megadlm
