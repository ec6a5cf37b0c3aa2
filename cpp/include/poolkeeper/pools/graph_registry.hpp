// Per-device GraphPools behind the C ABI (graph_pools.hpp), beside the pool registry
// (registry.hpp): PyTorch's graph hooks name a device, and the C ABI's malloc/free route through
// that device's GraphPools while it has a capture scope open or private blocks live.
// Thread-safe; find() is lock-free.
#pragma once
#include <memory>
#include <vector>

#include "poolkeeper/pools/graph_pools.hpp"

namespace poolkeeper::graph_registry {

// The device's GraphPools, or nullptr when none was made (lock-free; never throws).
GraphPools* find(int device) noexcept;
// The device's GraphPools, made over registry::get_shared(device) on first use. Throws what
// registry::get_shared throws (a bad index, no pool and no factory).
std::shared_ptr<GraphPools> get(int device);
// Forget every GraphPools (tests, and registry clearing); private pools with live blocks stay
// alive until those blocks' owners are gone.
void clear();

}  // namespace poolkeeper::graph_registry
