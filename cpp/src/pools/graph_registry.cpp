#include "poolkeeper/pools/graph_registry.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <functional>
#include <mutex>
#include <new>

#include <pthread.h>

namespace poolkeeper::graph_registry {

namespace {
// Immortal, as the pool registry's books are (registry.cpp): C ABI calls on threads the
// interpreter never stops may still be inside a GraphPools while exit() runs.
std::mutex& g_mu = *new std::mutex;
std::array<std::shared_ptr<GraphPools>, registry::kMaxDevices>& g_graphs =
    *new std::array<std::shared_ptr<GraphPools>, registry::kMaxDevices>();  // guarded by g_mu
std::array<std::atomic<GraphPools*>, registry::kMaxDevices> g_fast{};
// Replaced or cleared GraphPools that are not idle yet (a scope open, private blocks live) or that
// a C ABI call may still be inside (a hazard names them), with their device. Guarded by g_mu.
struct Retired {
  int device;
  std::shared_ptr<GraphPools> gp;
  bool at_exit = false;  // dropped by the exit hook (drop_at_exit): its device pool's blocks do not keep it
};
std::vector<Retired>& g_retired = *new std::vector<Retired>;
using Dead = std::vector<std::shared_ptr<GraphPools>>;  // destroyed after g_mu is let go

// Nothing left for it to serve: no scope open, no private pool (a graph not yet released keeps
// its pool, and its release must find it; its blocks live in that pool), and no live block of
// its device pool (one served while a scope stayed open across the swap is freed through it).
// One the exit hook dropped does not count its device pool's live blocks: they are the program's
// own, and keeping that pool alive past the exit is what the hook is for.
bool idle(const Retired& r) {
  GraphPools& gp = *r.gp;
  // Over a pool inherited through fork() (made in a child over one): it serves nothing there, and
  // asking it would throw (GraphPools refuses every call then); its destructor touches nothing.
  if (gp.main()->forked()) return true;
  return !gp.routing() && !gp.holds_private_blocks() && !gp.has_private_pools() &&
         (r.at_exit || gp.main()->stats().live_blocks == 0);
}
bool on(int device, int d) { return device < 0 || device == d; }

// Under g_mu, after the caller's seq_cst store of any new g_fast value: destroy (through `dead`)
// the retired GraphPools that are idle and that no hazard names. The store, the barrier in
// graph_hazards() and its loads pair with Pinned's hazard store and its re-load of g_fast: a call
// either sees the new value or is seen here.
void collect_locked(Dead& dead) {
  if (g_retired.empty() || std::none_of(g_retired.begin(), g_retired.end(), [](const Retired& r) { return idle(r); }))
    return;
  std::vector<const void*> busy;
  if (!registry::detail::graph_hazards(busy)) return;  // no barrier: keep them (a leak, never a use-after-free)
  for (auto it = g_retired.begin(); it != g_retired.end();) {
    if (idle(*it) && std::find(busy.begin(), busy.end(), it->gp.get()) == busy.end()) {
      dead.push_back(std::move(it->gp));
      it = g_retired.erase(it);
    } else {
      ++it;
    }
  }
}

// Under g_mu: take device d's GraphPools off the fast path, and retire it (it keeps serving what
// it has until idle; see collect_locked).
void retire_current_locked(int d, bool at_exit = false) {
  g_fast[d].store(nullptr, std::memory_order_seq_cst);
  if (g_graphs[d]) g_retired.push_back({d, std::exchange(g_graphs[d], nullptr), at_exit});
}

void collect() {
  Dead dead;
  std::lock_guard<std::mutex> g(g_mu);
  collect_locked(dead);
}

// The GraphPools of the device (current first, then retired) for which pick() is true.
// Never one over a pool inherited through fork(), which refuses every question.
template <class F>
std::shared_ptr<GraphPools> find_locked(int device, F&& pick) {
  const auto ask = [&](GraphPools& x) { return !x.main()->forked() && pick(x); };
  for (int d = 0; d < registry::kMaxDevices; ++d)
    if (on(device, d) && g_graphs[d] && ask(*g_graphs[d])) return g_graphs[d];
  for (auto& r : g_retired)
    if (on(device, r.device) && ask(*r.gp)) return r.gp;
  return nullptr;
}

// The GraphPools that knows p, and whether p is one of its private blocks (else a live block of
// its device pool). Never a device-pool block of `refused_by`: that pool has just refused p (a
// block that is live there now was handed out again since: a double free, not ours to free).
std::pair<std::shared_ptr<GraphPools>, bool> owner_of(int device, void* p, const Pool* refused_by) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> g(g_mu);
  if (auto gp = find_locked(device, [&](GraphPools& x) { return x.owns_private(a); })) return {gp, true};
  return {find_locked(device, [&](GraphPools& x) { return x.main().get() != refused_by && x.main()->owns_live(a); }),
          false};
}
// fork(): see the header. Runs in the child, where only the forking thread exists. Always, not
// only when g_mu was held: a GraphPools's own lock may be held by a vanished thread too (a
// capture's growth), and every GraphPools sits over pools the child cannot use anyway.
std::atomic<bool> g_left_at_fork{false};
void fork_child() {
  for (auto& f : g_fast)
    if (f.load(std::memory_order_relaxed)) g_left_at_fork.store(true, std::memory_order_relaxed);
  if (!g_retired.empty()) g_left_at_fork.store(true, std::memory_order_relaxed);
  new (&g_mu) std::mutex;  // the old objects leak (placement new): their state may be half-changed
  new (&g_graphs) std::array<std::shared_ptr<GraphPools>, registry::kMaxDevices>();
  new (&g_retired) std::vector<Retired>();
  for (auto& f : g_fast) f.store(nullptr, std::memory_order_relaxed);
}
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, fork_child);
}  // namespace

Pinned::Pinned(int device) {
  if (device < 0 || device >= registry::kMaxDevices) return;
  GraphPools* p = g_fast[device].load(std::memory_order_acquire);
  if (!p) return;  // the common case, no graph ever on the device: one load, no hazard touched
  registry::detail::Hazard* h = registry::detail::t_hazard;
  if (!h) h = registry::detail::claim_thread_hazard();
  if (h->graph_depth >= registry::detail::Hazard::kGraphSlots) {
    held_ = current(device);  // nested deeper than the slots: a reference instead
    gp_ = held_.get();
    return;
  }
  hazard_ = h;
  slot_ = h->graph_depth++;
  auto& slot = h->graph[static_cast<std::size_t>(slot_)];
  while (p) {
    if (registry::detail::g_asymmetric.load(std::memory_order_relaxed)) {
      slot.store(p, std::memory_order_relaxed);
      std::atomic_signal_fence(std::memory_order_seq_cst);  // the writer's barrier does the rest
    } else {
      slot.store(p, std::memory_order_seq_cst);
    }
    GraphPools* again = g_fast[device].load(std::memory_order_seq_cst);
    if (again == p) break;
    p = again;  // replaced meanwhile: protect the new one instead
  }
  gp_ = p;
}

Pinned::~Pinned() {
  if (!hazard_) return;
  hazard_->graph[static_cast<std::size_t>(slot_)].store(nullptr, std::memory_order_release);
  --hazard_->graph_depth;
}

namespace {
void check_device(int device) {
  if (device < 0 || device >= registry::kMaxDevices)
    throw InvalidArgument("graph pools: device index " + std::to_string(device) + " out of range");
}
}  // namespace

std::shared_ptr<GraphPools> get(int device) {
  check_device(device);
  std::shared_ptr<Pool> main = registry::get_shared(device);  // outside g_mu: may run the factory
  Dead dead;
  std::lock_guard<std::mutex> g(g_mu);
  auto& slot = g_graphs[device];
  if (!slot || slot->main() != main) {
    auto fresh = std::make_shared<GraphPools>(std::move(main));
    g_fast[device].store(fresh.get(), std::memory_order_seq_cst);
    if (slot) g_retired.push_back({device, std::exchange(slot, fresh)});
    else slot = std::move(fresh);
    collect_locked(dead);
  }
  return slot;
}

std::shared_ptr<GraphPools> current(int device) {
  if (device < 0 || device >= registry::kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> g(g_mu);
  return g_graphs[device];
}

void end(int device, GraphPoolId id) {
  std::shared_ptr<GraphPools> gp;
  if (device >= 0 && device < registry::kMaxDevices) {
    std::lock_guard<std::mutex> g(g_mu);
    gp = find_locked(device, [&](GraphPools& x) { return x.has_open_scope(id); });
  }
  if (!gp) gp = get(device);  // throws for a bad index; its end() for a scope that is not open
  gp->end(id);                // (with g_mu let go: ending a scope destroys its filter)
  collect();
}

void release(int device, GraphPoolId id) {
  // A device that cannot exist is the caller's error, as for get() and end(): "nothing to do" is
  // for an id a real device never allocated (PyTorch releases those).
  check_device(device);
  std::shared_ptr<GraphPools> gp;
  {
    std::lock_guard<std::mutex> g(g_mu);
    gp = find_locked(device, [&](GraphPools& x) { return x.private_pool(id) != nullptr; });
    if (!gp) gp = g_graphs[device];
  }
  if (!gp) return;
  gp->release(id);  // (with g_mu let go: closing a private pool synchronizes the device)
  collect();
}

bool deallocate_elsewhere(int device, void* p, Stream s, const Pool* refused_by) {
  auto [gp, is_private] = owner_of(device, p, refused_by);
  if (!gp) return false;
  if (is_private) {
    if (!gp->deallocate_private(p, s)) return false;  // freed by another thread meanwhile: the caller reports
  } else {
    gp->main()->deallocate(p, s);
  }
  collect();  // its last block: it (and the pool under it) may go now
  return true;
}

bool record_stream_elsewhere(int device, void* p, Stream s, const Pool* refused_by) {
  auto [gp, is_private] = owner_of(device, p, refused_by);
  if (!gp) return false;
  if (is_private) return gp->record_stream_private(p, s);
  gp->main()->record_stream(p, s);
  return true;
}

void close_deferred() {
  GraphPools::close_deferred_everywhere();
  collect();  // a retired GraphPools whose last pool closed may go now
}

std::size_t retired_count() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_retired.size();
}

void clear() {
  Dead dead;
  std::lock_guard<std::mutex> g(g_mu);
  for (int d = 0; d < registry::kMaxDevices; ++d) retire_current_locked(d);
  collect_locked(dead);
}

std::size_t drop_at_exit(const std::function<bool(const Pool&)>& python_made) {
  Dead dead;
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& r : g_retired)
    if (python_made(*r.gp->main())) r.at_exit = true;
  for (int d = 0; d < registry::kMaxDevices; ++d)
    if (g_graphs[d] && python_made(*g_graphs[d]->main())) retire_current_locked(d, true);
  collect_locked(dead);
  return static_cast<std::size_t>(std::count_if(g_retired.begin(), g_retired.end(), [](const Retired& r) { return r.at_exit; }));
}

bool left_at_fork() { return g_left_at_fork.load(std::memory_order_relaxed); }

}  // namespace poolkeeper::graph_registry
