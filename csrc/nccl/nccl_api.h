// Run-time binding of libnccl.so.2 (dlopen): no nccl.h and no CUDA headers at build
// time, so this compiles in CPU-only builds and CI. Only the entry points the
// communicator uses are declared, with NCCL's stable C ABI:
//   ncclGetUniqueId, ncclCommInitRankConfig, ncclCommGetAsyncError, ncclCommAbort,
//   ncclCommFinalize, ncclCommDestroy, ncclAllReduce, ncclReduceScatter, ncclAllGather,
//   ncclGetErrorString, ncclGetVersion.
// A library older than kMinVersion is rejected at load with the minimum named.
#pragma once

#include <climits>
#include <cstddef>
#include <string>
#include <vector>

namespace megadlm {
namespace nccl {

struct UniqueId {
  char internal[128];
};  // ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128)
using Comm = void*;  // ncclComm_t (opaque pointer)

// ncclDataType_t / ncclRedOp_t values used here (stable since NCCL 2.10).
enum DataType : int { kFloat16 = 6, kFloat32 = 7, kBfloat16 = 9 };
enum RedOp : int { kSum = 0, kAvg = 4 };
// ncclResult_t values the communicator branches on.
enum Result : int { kSuccess = 0, kInProgress = 7 };

// 2.14: ncclCommInitRankConfig (non-blocking init, the only init that can time out),
// ncclCommGetAsyncError in non-blocking mode and ncclCommFinalize. avg and bf16 need
// 2.10, so 2.14 covers both.
constexpr int kMinVersion = 21400;
std::string version_string(int code);  // 21400 -> "2.14.0"

// ncclConfig_t with the fields of NCCL 2.14 (size/magic/version tell newer libraries
// which fields follow, so this prefix stays valid). Unset fields are INT_MIN / nullptr,
// as NCCL_CONFIG_INITIALIZER makes them.
struct Config {
  size_t size = sizeof(Config);
  unsigned int magic = 0xcafebeef;
  unsigned int version = unsigned(kMinVersion);
  int blocking = INT_MIN;
  int cga_cluster_size = INT_MIN;
  int min_ctas = INT_MIN;
  int max_ctas = INT_MIN;
  const char* net_name = nullptr;
};

// Try `paths` in order (an entry may be a file or a bare soname for the default loader
// path); the first that loads, exports every symbol and is at least kMinVersion wins.
// Thread-safe, idempotent: after a success later calls return true at once. `error`
// receives why each earlier candidate was rejected (also on success).
bool load(const std::vector<std::string>& paths, std::string* error);
bool loaded();
std::string loaded_path();
int version();  // e.g. 22703 for 2.27.3; 0 when not loaded

// Raw calls: return the ncclResult_t (kInProgress is not an error for a non-blocking
// communicator); the communicator decides what to do with it.
std::string error_string(int result);
UniqueId get_unique_id();  // throws std::runtime_error on failure
int comm_init_rank_config(Comm* comm, int nranks, const UniqueId& id, int rank, Config* config);
int get_async_error(Comm comm, int* state);
int comm_abort(Comm comm);
int comm_finalize(Comm comm);
int comm_destroy(Comm comm);
int all_reduce(const void* send, void* recv, size_t count, int dtype, int op, Comm comm,
               void* stream);
int reduce_scatter(const void* send, void* recv, size_t recv_count, int dtype, int op, Comm comm,
                   void* stream);
int all_gather(const void* send, void* recv, size_t send_count, int dtype, Comm comm, void* stream);

}  // namespace nccl
}  // namespace megadlm
