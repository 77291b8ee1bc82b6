// Run-time binding of libnccl.so.2 (dlopen): no nccl.h and no CUDA headers at build
// time, so this compiles in CPU-only builds and CI. Only the handful of entry points
// the communicator uses are declared, with NCCL's stable C ABI:
//   ncclGetUniqueId, ncclCommInitRank, ncclAllReduce, ncclReduceScatter,
//   ncclAllGather, ncclCommDestroy, ncclGetErrorString, ncclGetVersion.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace megadlm {
namespace nccl {

struct UniqueId { char internal[128]; };  // ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128)
using Comm = void*;                         // ncclComm_t (opaque pointer)

// ncclDataType_t / ncclRedOp_t values used here (stable since NCCL 2.10).
enum DataType : int { kFloat16 = 6, kFloat32 = 7, kBfloat16 = 9 };
enum RedOp : int { kSum = 0, kAvg = 4 };

// Try `paths` in order (an entry may be a file or a bare soname for the default loader
// path); the first that loads and exports every symbol wins. Thread-safe, idempotent:
// after a success later calls return true at once. On failure `error` lists why each
// candidate was rejected.
bool load(const std::vector<std::string>& paths, std::string* error);
bool loaded();
std::string loaded_path();
int version();  // e.g. 22703 for 2.27.3; 0 when not loaded

// Thin checked wrappers: throw std::runtime_error("NCCL <call> failed: <reason>").
UniqueId get_unique_id();
Comm comm_init_rank(int nranks, const UniqueId& id, int rank);
void all_reduce(const void* send, void* recv, size_t count, int dtype, int op, Comm comm, void* stream);
void reduce_scatter(const void* send, void* recv, size_t recv_count, int dtype, int op, Comm comm,
                    void* stream);
void all_gather(const void* send, void* recv, size_t send_count, int dtype, Comm comm, void* stream);
void comm_destroy(Comm comm);

}  // namespace nccl
}  // namespace megadlm
