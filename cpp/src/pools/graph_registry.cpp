#include "poolkeeper/pools/graph_registry.hpp"

#include <array>
#include <atomic>
#include <mutex>

#include "poolkeeper/core/registry.hpp"

namespace poolkeeper::graph_registry {

namespace {
std::mutex g_mu;
std::array<std::shared_ptr<GraphPools>, registry::kMaxDevices> g_graphs;  // guarded by g_mu
std::array<std::atomic<GraphPools*>, registry::kMaxDevices> g_fast{};
// Cleared GraphPools whose private pools still own live blocks (or have a scope open) are kept:
// those blocks will still be freed through them. The others go, with their device pool.
std::vector<std::shared_ptr<GraphPools>> g_retired;  // guarded by g_mu

void retire_locked(std::shared_ptr<GraphPools> gp) {
  if (gp->routing() || gp->holds_private_blocks()) g_retired.push_back(std::move(gp));
}
}  // namespace

GraphPools* find(int device) noexcept {
  if (device < 0 || device >= registry::kMaxDevices) return nullptr;
  return g_fast[device].load(std::memory_order_acquire);
}

std::shared_ptr<GraphPools> get(int device) {
  if (device < 0 || device >= registry::kMaxDevices)
    throw InvalidArgument("graph pools: device index " + std::to_string(device) + " out of range");
  std::shared_ptr<Pool> main = registry::get_shared(device);  // outside g_mu: may run the factory
  std::lock_guard<std::mutex> g(g_mu);
  auto& slot = g_graphs[device];
  if (!slot || slot->main() != main) {
    if (slot) retire_locked(slot);
    slot = std::make_shared<GraphPools>(std::move(main));
    g_fast[device].store(slot.get(), std::memory_order_release);
  }
  return slot;
}

void clear() {
  std::lock_guard<std::mutex> g(g_mu);
  for (int d = 0; d < registry::kMaxDevices; ++d) {
    g_fast[d].store(nullptr, std::memory_order_release);
    if (g_graphs[d]) retire_locked(std::move(g_graphs[d]));
    g_graphs[d].reset();
  }
  for (auto it = g_retired.begin(); it != g_retired.end();)
    it = (*it)->routing() || (*it)->holds_private_blocks() ? std::next(it) : g_retired.erase(it);
}

}  // namespace poolkeeper::graph_registry
