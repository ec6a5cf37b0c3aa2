// Per-device GraphPools behind the C ABI (graph_pools.hpp), beside the pool registry
// (registry.hpp): PyTorch's graph hooks name a device, and the C ABI's malloc/free route through
// that device's GraphPools while it has a capture scope open or private blocks live.
//
// - When the device's pool is replaced (registry::set), the next get() makes a new GraphPools
//   over the new pool; the old one is retired. A retired GraphPools whose private pools still
//   hold live blocks (a graph's static outputs) keeps serving their frees (deallocate_retired)
//   and the release of its graphs (release()), and goes once it is idle.
// - A C ABI call inside a GraphPools keeps it alive (Pinned publishes it as the thread's graph
//   hazard, as registry::Pinned does for pools): get() and clear() destroy a retired GraphPools
//   only when it is idle and no hazard names it, and retry the rest at their next call.
// Thread-safe. Pinned is lock-free; the other calls take the registry's lock.
#pragma once
#include <memory>
#include <vector>

#include "poolkeeper/core/registry.hpp"
#include "poolkeeper/pools/graph_pools.hpp"

namespace poolkeeper::graph_registry {

// The device's current GraphPools for one C ABI call, kept alive while this object lives even if
// get() or clear() replaces it meanwhile. get() is nullptr when the device has none (or the index
// is out of range). Lock-free; throws only std::bad_alloc (a thread's first call claims its
// hazard record). Not copyable; one thread.
class Pinned {
 public:
  explicit Pinned(int device);
  ~Pinned() {
    if (hazard_) hazard_->graph.store(saved_, std::memory_order_release);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  GraphPools* get() const { return gp_; }

 private:
  GraphPools* gp_ = nullptr;
  registry::detail::Hazard* hazard_ = nullptr;  // null: nothing pinned (the device had none)
  const void* saved_ = nullptr;                  // a nested pin restores the outer one's
};

// The device's GraphPools, made over registry::get_shared(device) on first use and again when the
// device's pool has been replaced (the old one is retired). Throws what registry::get_shared
// throws (a bad index, no pool and no factory).
std::shared_ptr<GraphPools> get(int device);
// The device's current GraphPools without making one: nullptr when there is none.
std::shared_ptr<GraphPools> current(int device);
// Release graph pool `id` of the device: the current GraphPools's, or a retired one's that still
// has it (a graph captured before the device's pool was replaced). An id no GraphPools has is
// nothing to do (PyTorch releases ids that never allocated). Throws what GraphPools::release
// throws.
void release(int device, GraphPoolId id);
// Is any retired GraphPools still holding live private blocks? (Lock-free; the C ABI's free asks
// before it looks through them.)
bool retired_hold_blocks() noexcept;
// Free (or record a stream on) p if a retired GraphPools's private pool holds it: true when it
// did. Throws what the private pool throws.
bool deallocate_retired(void* p, Stream s);
bool record_stream_retired(void* p, Stream s);
// Forget every GraphPools (tests, and registry clearing); those whose private pools still hold
// live blocks are retired, and keep serving those blocks' frees.
void clear();

}  // namespace poolkeeper::graph_registry
