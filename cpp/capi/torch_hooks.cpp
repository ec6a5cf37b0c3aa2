// PyTorch pluggable-allocator hooks (see poolkeeper_torch_hooks.h). They sit beside the C ABI
// rather than in it because PyTorch fixes their signatures: record_stream carries no device, and
// empty_cache returns nothing.
#include "poolkeeper_torch_hooks.h"

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "poolkeeper_capi.h"
#include "poolkeeper/pools/graph_registry.hpp"
#include "poolkeeper/core/registry.hpp"

#define PK_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
std::atomic<std::uint64_t> g_record_served{0}, g_record_unowned{0}, g_empty_cache{0};
}

PK_EXPORT void* poolkeeper_torch_malloc_raising(size_t size, int device, void* stream) {
  void* p = poolkeeper_torch_malloc(size, device, stream);
  if (!p && size != 0)
    // PyTorch's pluggable allocator does not check for NULL; an exception reaches Python as a
    // RuntimeError carrying the pool's diagnosis (PyTorch converts std::exception at its boundary).
    throw std::runtime_error(std::string("poolkeeper: cannot allocate ") + std::to_string(size) +
                             " bytes on device " + std::to_string(device) + ": " + poolkeeper_last_error());
  return p;
}

PK_EXPORT void poolkeeper_torch_record_stream_hook(void* ptr, void* stream) {
  if (!ptr) return;
  const auto s = static_cast<poolkeeper::Stream>(reinterpret_cast<std::uintptr_t>(stream));
  try {
    for (auto& [device, pool] : poolkeeper::registry::all()) {
      const poolkeeper::graph_registry::Pinned g(device);
      if (g.get() && g.get()->record_stream_private(ptr, s)) {  // a graph's block
        g_record_served.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      // An inherited pool in a forked child: asking it takes its lock, which a thread the fork
      // left behind may hold (the hook waited forever). It owns nothing usable there anyway.
      if (pool->forked()) continue;
      if (pool->owns_live(reinterpret_cast<std::uintptr_t>(ptr))) {
        pool->record_stream(ptr, s);
        g_record_served.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    if (poolkeeper::graph_registry::record_stream_elsewhere(-1, ptr, s, nullptr)) {
      g_record_served.fetch_add(1, std::memory_order_relaxed);  // a graph's block from before a pool swap
      return;
    }
  } catch (...) {
    // A hook must not throw into PyTorch; an unowned/failed call is counted below.
  }
  g_record_unowned.fetch_add(1, std::memory_order_relaxed);
}

PK_EXPORT void poolkeeper_torch_empty_cache_hook(void) {
  g_empty_cache.fetch_add(1, std::memory_order_relaxed);
  std::vector<std::pair<int, std::shared_ptr<poolkeeper::Pool>>> pools;
  try {
    poolkeeper::graph_registry::close_deferred();  // as poolkeeper_empty_cache does
  } catch (...) {
  }
  try {
    pools = poolkeeper::registry::all();
  } catch (...) {
    return;
  }
  for (auto& [device, pool] : pools) {
    // A closed pool is skipped, not asked: its trim() refused and ended the loop, so one closed
    // device kept every later one from trimming; an inherited pool in a forked child (closed too)
    // is never touched, its lock may be held by a thread the fork left behind.
    if (pool->closed()) continue;
    try {
      // Like PyTorch's own empty_cache, wait for outstanding events first so blocks released on
      // streams count as free, then return every wholly free backing.
      pool->synchronize();
      pool->trim();
    } catch (...) {
      // Each pool on its own, as poolkeeper_empty_cache does: one failing pool does not keep the
      // others from trimming.
    }
  }
}

PK_EXPORT void poolkeeper_torch_hook_counters(std::uint64_t* out3) {
  if (!out3) return;
  out3[0] = g_record_served.load(std::memory_order_relaxed);
  out3[1] = g_record_unowned.load(std::memory_order_relaxed);
  out3[2] = g_empty_cache.load(std::memory_order_relaxed);
}
