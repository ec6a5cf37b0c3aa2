#include "poolkeeper/pools/graph_registry.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>

namespace poolkeeper::graph_registry {

namespace {
std::mutex g_mu;
std::array<std::shared_ptr<GraphPools>, registry::kMaxDevices> g_graphs;  // guarded by g_mu
std::array<std::atomic<GraphPools*>, registry::kMaxDevices> g_fast{};
// Replaced or cleared GraphPools that are not idle yet (a scope open, private blocks live) or that
// a C ABI call may still be inside (a hazard names them). Guarded by g_mu.
std::vector<std::shared_ptr<GraphPools>> g_retired;
std::atomic<std::size_t> g_retired_holding{0};  // how many of them hold private blocks

bool idle(const GraphPools& gp) { return !gp.routing() && !gp.holds_private_blocks(); }

// Under g_mu, after the caller's seq_cst store of the new g_fast value: keep `old` until it is idle
// and no hazard names it; destroy (through `dead`, after g_mu is let go) the retired ones that are
// both now. The store, the barrier in graph_hazards() and its loads pair with Pinned's hazard
// store and its re-load of g_fast: a call either sees the new value or is seen here.
void retire_locked(std::shared_ptr<GraphPools> old, std::vector<std::shared_ptr<GraphPools>>& dead) {
  if (old) g_retired.push_back(std::move(old));
  std::vector<const void*> busy;
  if (!g_retired.empty() && registry::detail::graph_hazards(busy)) {
    for (auto it = g_retired.begin(); it != g_retired.end();) {
      if (idle(**it) && std::find(busy.begin(), busy.end(), it->get()) == busy.end()) {
        dead.push_back(std::move(*it));
        it = g_retired.erase(it);
      } else {
        ++it;
      }
    }
  }
  g_retired_holding.store(static_cast<std::size_t>(std::count_if(g_retired.begin(), g_retired.end(),
                                                                 [](const auto& gp) { return gp->holds_private_blocks(); })),
                          std::memory_order_release);
}
}  // namespace

Pinned::Pinned(int device) {
  if (device < 0 || device >= registry::kMaxDevices) return;
  GraphPools* p = g_fast[device].load(std::memory_order_acquire);
  if (!p) return;  // the common case, no graph ever on the device: one load, no hazard touched
  registry::detail::Hazard* h = registry::detail::t_hazard;
  if (!h) h = registry::detail::claim_thread_hazard();
  hazard_ = h;
  saved_ = h->graph.load(std::memory_order_relaxed);
  while (p) {
    if (registry::detail::g_asymmetric.load(std::memory_order_relaxed)) {
      h->graph.store(p, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // the writer's barrier does the rest
    } else {
      h->graph.store(p, std::memory_order_seq_cst);
    }
    GraphPools* again = g_fast[device].load(std::memory_order_seq_cst);
    if (again == p) break;
    p = again;  // replaced meanwhile: protect the new one instead
  }
  gp_ = p;
}

std::shared_ptr<GraphPools> get(int device) {
  if (device < 0 || device >= registry::kMaxDevices)
    throw InvalidArgument("graph pools: device index " + std::to_string(device) + " out of range");
  std::shared_ptr<Pool> main = registry::get_shared(device);  // outside g_mu: may run the factory
  std::vector<std::shared_ptr<GraphPools>> dead;  // destroyed after g_mu is let go
  std::lock_guard<std::mutex> g(g_mu);
  auto& slot = g_graphs[device];
  if (!slot || slot->main() != main) {
    auto fresh = std::make_shared<GraphPools>(std::move(main));
    g_fast[device].store(fresh.get(), std::memory_order_seq_cst);
    retire_locked(std::exchange(slot, fresh), dead);
  }
  return slot;
}

std::shared_ptr<GraphPools> current(int device) {
  if (device < 0 || device >= registry::kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> g(g_mu);
  return g_graphs[device];
}

void release(int device, GraphPoolId id) {
  std::vector<std::shared_ptr<GraphPools>> dead;
  std::lock_guard<std::mutex> g(g_mu);
  std::shared_ptr<GraphPools> cur = device >= 0 && device < registry::kMaxDevices ? g_graphs[device] : nullptr;
  if (!cur || !cur->private_pool(id)) {
    // A graph captured before the device's pool was replaced: its GraphPools is a retired one.
    for (auto& gp : g_retired)
      if (gp->private_pool(id)) {
        gp->release(id);
        retire_locked(nullptr, dead);  // it may be idle now
        return;
      }
  }
  if (cur) cur->release(id);
}

bool retired_hold_blocks() noexcept { return g_retired_holding.load(std::memory_order_acquire) != 0; }

bool deallocate_retired(void* p, Stream s) {
  std::vector<std::shared_ptr<GraphPools>> dead;
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& gp : g_retired)
    if (gp->owns_private(reinterpret_cast<std::uintptr_t>(p))) {
      gp->deallocate(p, s);
      retire_locked(nullptr, dead);  // its last block: it (and its device pool) may go now
      return true;
    }
  return false;
}

bool record_stream_retired(void* p, Stream s) {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& gp : g_retired)
    if (gp->owns_private(reinterpret_cast<std::uintptr_t>(p))) {
      gp->record_stream(p, s);
      return true;
    }
  return false;
}

void clear() {
  std::vector<std::shared_ptr<GraphPools>> dead;
  std::lock_guard<std::mutex> g(g_mu);
  for (int d = 0; d < registry::kMaxDevices; ++d) {
    g_fast[d].store(nullptr, std::memory_order_seq_cst);
    if (g_graphs[d]) g_retired.push_back(std::exchange(g_graphs[d], nullptr));
  }
  retire_locked(nullptr, dead);
}

}  // namespace poolkeeper::graph_registry
