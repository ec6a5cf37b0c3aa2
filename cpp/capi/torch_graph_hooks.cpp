// PyTorch's CUDA-graph hooks for pluggable allocators (poolkeeper_torch_hooks.h). PyTorch stores
// our function address in a std::function<void(int, MempoolId_t, std::function<bool(cudaStream_t)>)>
// and calls it with the C++ calling convention, so these take exactly those C++ types; C linkage
// only keeps the names unmangled for dlsym. The filter is PyTorch's (it asks the driver whether a
// stream belongs to the capture); it is kept, and called, until the matching end hook.
#include <functional>
#include <stdexcept>
#include <utility>

#include "poolkeeper/pools/graph_registry.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace {
using TorchMempoolId = std::pair<unsigned long long, unsigned long long>;
using TorchFilter = std::function<bool(CUstream_st*)>;

poolkeeper::GraphPoolId pool_id(TorchMempoolId id) { return {id.first, id.second}; }

template <class F>
void rethrow_as_runtime_error(const char* hook, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("poolkeeper (") + hook + "): " + e.what());
  }
}
}  // namespace

#define PK_EXPORT extern "C" __attribute__((visibility("default")))

PK_EXPORT void poolkeeper_torch_begin_allocate_to_pool(int device, TorchMempoolId id, TorchFilter filter) {
  rethrow_as_runtime_error("begin_allocate_to_pool", [&] {
    auto gp = poolkeeper::graph_registry::get(device);
    gp->begin(pool_id(id), [f = std::move(filter)](poolkeeper::Stream s) {
      return f(reinterpret_cast<CUstream_st*>(static_cast<std::uintptr_t>(s)));
    });
  });
}

PK_EXPORT void poolkeeper_torch_end_allocate_to_pool(int device, TorchMempoolId id) {
  rethrow_as_runtime_error("end_allocate_to_pool", [&] { poolkeeper::graph_registry::end(device, pool_id(id)); });
}

PK_EXPORT void poolkeeper_torch_release_pool(int device, TorchMempoolId id) {
  // Called from graph and MemPool destructors: never throw there.
  try {
    poolkeeper::graph_registry::release(device, pool_id(id));
  } catch (...) {
  }
}
