// Per-device GraphPools behind the C ABI (graph_pools.hpp), beside the pool registry
// (registry.hpp): PyTorch's graph hooks name a device, and the C ABI's malloc/free route through
// that device's GraphPools while it has a capture scope open or private blocks live.
//
// - When the device's pool is replaced (registry::set), the next get() makes a new GraphPools
//   over the new pool and retires the old one. A retired GraphPools keeps serving what it still
//   has -- its graphs' blocks, its open scopes' end(), its graphs' release(), blocks its device
//   pool served -- through the *_elsewhere calls and end()/release() below, and goes once idle.
// - A C ABI call inside a GraphPools keeps it alive: Pinned publishes it in the thread's hazard
//   record (one slot per nesting level: a capture filter may call back into the C ABI), as
//   registry::Pinned does for pools; a retired GraphPools is destroyed only when it is idle (no
//   scope open, no private pool left -- every graph released and its blocks freed -- and no live
//   block of its device pool) and no hazard names it, and the rest are retried at the
//   next call that retires or serves one.
// - fork(): the child starts with no GraphPools and a fresh lock. The old ones are leaked, never
//   touched: another thread may have held this registry's lock or a GraphPools's own at the fork
//   (a capture's growth), and they sit over pools the child cannot use anyway (Pool::forked). An
//   open capture scope does not carry over either. The registry's own fork handler gives back
//   the other threads' hazard records.
// Thread-safe. Pinned is lock-free; the other calls take the registry's lock g_mu briefly and
// call into a GraphPools (which may synchronize the device, or destroy a Python filter) with it
// let go. Lock order: g_mu, then a GraphPools's own lock.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "poolkeeper/core/registry.hpp"
#include "poolkeeper/pools/graph_pools.hpp"

namespace poolkeeper::graph_registry {

// The device's current GraphPools for one C ABI call, kept alive while this object lives even if
// get() or clear() replaces it meanwhile. get() is nullptr when the device has none (or the index
// is out of range). Lock-free unless pins nest deeper than the hazard record's slots (then it
// holds a reference, taken under g_mu). Throws only std::bad_alloc. Not copyable; one thread.
class Pinned {
 public:
  explicit Pinned(int device);
  ~Pinned();
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  GraphPools* get() const { return gp_; }

 private:
  GraphPools* gp_ = nullptr;
  registry::detail::Hazard* hazard_ = nullptr;  // null: no slot taken
  int slot_ = -1;
  std::shared_ptr<GraphPools> held_;  // pins nested deeper than the slots
};

// The device's GraphPools, made over registry::get_shared(device) on first use and again when the
// device's pool has been replaced (the old one is retired). Throws what registry::get_shared
// throws (a bad index, no pool and no factory).
std::shared_ptr<GraphPools> get(int device);
// The device's current GraphPools without making one: nullptr when there is none.
std::shared_ptr<GraphPools> current(int device);
// End scope `id` on the device: in the GraphPools that has it open (a retired one when the
// capture began before the device's pool was replaced), else as get(device)->end(id) (which
// throws InvalidArgument for a scope that is not open).
void end(int device, GraphPoolId id);
// Release graph pool `id` of the device: the current GraphPools's, or the device's retired one
// that has it. An id no GraphPools of the device has is nothing to do (PyTorch releases ids that
// never allocated). Throws InvalidArgument for a device index outside [0, kMaxDevices) (as get()
// and end() do), and what GraphPools::release throws.
void release(int device, GraphPoolId id);
// For a pointer the device's current pool (`refused_by`; null when none is installed) refused:
// free it (or record a stream on it) where it lives if a GraphPools of the device (device -1: of
// any device) knows it -- a private block of a retired GraphPools, or a live block of a replaced
// device pool under one (allocations a capture scope did not claim). True when it did; false
// when none knows it. Throws what that pool throws.
bool deallocate_elsewhere(int device, void* p, Stream s, const Pool* refused_by);
bool record_stream_elsewhere(int device, void* p, Stream s, const Pool* refused_by);
// empty_cache's step: close the released graph pools that could not close earlier
// (GraphPools::close_deferred_everywhere), then let go of the retired GraphPools that are idle now.
void close_deferred();
// Retired GraphPools still kept (diagnostics): not idle yet, or named by a hazard.
std::size_t retired_count();
// Forget every GraphPools (tests, and registry clearing); those that are not idle are retired,
// and keep serving their blocks.
void clear();
// The interpreter-exit hook: retire every GraphPools, current or retired, over a pool for which
// python_made() is true (a pool made in Python, which the hook also takes out of the registry);
// that pool's live blocks then do not keep it (the program frees them through the pool it holds,
// if at all), while a scope still open or a graph not yet released still does. GraphPools over
// pools the factory made in C++ stay as they are: PyTorch's frees at shutdown still reach them.
// python_made is called with the registry's lock held. Returns how many of them stay (a scope
// open, a graph not yet released, or a C ABI call inside one).
std::size_t drop_at_exit(const std::function<bool(const Pool&)>& python_made);
// True in a forked child whose parent had GraphPools: they were left behind, never destroyed
// (see fork() above), and hold the pools they sit over.
bool left_at_fork();

}  // namespace poolkeeper::graph_registry
