// The C ABI (see poolkeeper_capi.h). Exceptions stop here: each becomes a return code plus a
// thread-local message.
#include "poolkeeper_capi.h"

#include <chrono>
#include <string>
#include <vector>

#include "poolkeeper/pools/graph_registry.hpp"
#include "poolkeeper/core/registry.hpp"

#define PK_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string t_last_error;
constexpr int kOk = 0, kInvalidArgument = 1, kInvalidPointer = 2, kOutOfMemory = 3, kUpstream = 4, kClosed = 5,
              kOther = 9;

int record(const std::exception& e, int code) {
  t_last_error = e.what();
  return code;
}

template <class F>
int guarded(F&& f) {
  using namespace poolkeeper;
  try {
    f();
    return kOk;
  } catch (const OutOfMemory& e) {
    return record(e, kOutOfMemory);
  } catch (const InvalidPointer& e) {
    return record(e, kInvalidPointer);
  } catch (const InvalidArgument& e) {
    return record(e, kInvalidArgument);
  } catch (const PoolClosed& e) {
    return record(e, kClosed);
  } catch (const UpstreamFailure& e) {
    return record(e, kUpstream);
  } catch (const std::exception& e) {
    return record(e, kOther);
  } catch (...) {
    t_last_error = "unknown error";
    return kOther;
  }
}

poolkeeper::Stream torch_stream(void* s) { return static_cast<poolkeeper::Stream>(reinterpret_cast<std::uintptr_t>(s)); }
}  // namespace

PK_EXPORT void* poolkeeper_malloc(size_t size, int device, uint64_t stream) {
  void* out = nullptr;
  guarded([&] {
    // While a CUDA-graph scope is open on the device, its GraphPools decides (graph_pools.hpp).
    if (poolkeeper::GraphPools* gp = poolkeeper::graph_registry::find(device); gp && gp->routing()) {
      out = gp->allocate(size, stream);
      return;
    }
    const poolkeeper::registry::Pinned p(device);  // stays alive even if replaced meanwhile
    p->check_not_forked();
    out = p->try_allocate_fast(size, stream);
    if (!out) out = p->allocate(size, stream);
  });
  return out;
}

PK_EXPORT int poolkeeper_free(void* ptr, int device, uint64_t stream) {
  return guarded([&] {
    if (poolkeeper::GraphPools* gp = poolkeeper::graph_registry::find(device); gp && gp->holds_private_blocks()) {
      gp->deallocate(ptr, stream);  // a graph's block goes back to its private pool
      return;
    }
    const poolkeeper::registry::Pinned p(device);
    p->check_not_forked();
    if (!p->try_deallocate_fast(ptr, stream)) p->deallocate(ptr, stream);
  });
}

PK_EXPORT void* poolkeeper_torch_malloc(size_t size, int device, void* stream) {
  if (size == 0) return nullptr;
  return poolkeeper_malloc(size, device, torch_stream(stream));
}

PK_EXPORT void poolkeeper_torch_free(void* ptr, size_t, int device, void* stream) {
  if (!ptr) return;
  poolkeeper_free(ptr, device, torch_stream(stream));
}

PK_EXPORT int poolkeeper_torch_record_stream(void* ptr, int device, void* stream) {
  return guarded([&] {
    if (poolkeeper::GraphPools* gp = poolkeeper::graph_registry::find(device); gp && gp->holds_private_blocks()) {
      gp->record_stream(ptr, torch_stream(stream));
      return;
    }
    const poolkeeper::registry::Pinned p(device);
    p->check_not_forked();
    p->record_stream(ptr, torch_stream(stream));
  });
}

PK_EXPORT int64_t poolkeeper_empty_cache(void) {
  std::size_t total = 0;
  // Each pool on its own: a closed (or failing) pool must not keep the others from trimming. The
  // last failure stays readable through poolkeeper_last_error().
  std::vector<std::pair<int, std::shared_ptr<poolkeeper::Pool>>> pools;
  guarded([&] { pools = poolkeeper::registry::all(); });
  for (auto& [d, p] : pools) {
    if (p->closed()) continue;  // (a forked pool is closed too)
    guarded([&] { total += p->trim(); });
  }
  return total > static_cast<std::size_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(total);
}

PK_EXPORT const char* poolkeeper_last_error(void) { return t_last_error.c_str(); }

// ---- CUDA-graph private pools (graph_pools.hpp), plain C for callers other than PyTorch ----

PK_EXPORT int poolkeeper_graph_begin(int device, uint64_t id0, uint64_t id1, uint64_t stream) {
  return guarded([&] {
    const poolkeeper::Stream s = stream;
    poolkeeper::graph_registry::get(device)->begin({id0, id1}, [s](poolkeeper::Stream x) { return x == s; });
  });
}

PK_EXPORT int poolkeeper_graph_end(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] { poolkeeper::graph_registry::get(device)->end({id0, id1}); });
}

PK_EXPORT int poolkeeper_graph_release(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] {
    if (poolkeeper::GraphPools* gp = poolkeeper::graph_registry::find(device)) gp->release({id0, id1});
  });
}
