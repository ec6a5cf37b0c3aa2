#include "poolkeeper/registry.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>

namespace poolkeeper::registry {

namespace detail {
// One per thread that calls through the C ABI: the pool it is inside right now. Records are never
// freed (a thread's record is reused by a later thread), so a scan never reads freed memory.
struct Hazard {
  std::atomic<Pool*> ptr{nullptr};
  std::atomic<bool> taken{false};
  Hazard* next = nullptr;
};
}  // namespace detail

namespace {
using detail::Hazard;

std::mutex g_mu;
std::array<std::shared_ptr<Pool>, kMaxDevices + 1> g_pools;  // [0] = host (-1), [d+1] = device d
std::array<std::atomic<Pool*>, kMaxDevices + 1> g_fast{};
Factory g_factory;
// Pools replaced or cleared while a C ABI call may still be inside them (under g_mu).
std::vector<std::shared_ptr<Pool>> g_retired;
std::atomic<Hazard*> g_hazards{nullptr};

Hazard* claim_hazard() {
  for (Hazard* h = g_hazards.load(std::memory_order_acquire); h; h = h->next) {
    bool free = false;
    if (!h->taken.load(std::memory_order_relaxed) && h->taken.compare_exchange_strong(free, true)) return h;
  }
  Hazard* h = new Hazard;  // never freed: see Hazard
  h->taken.store(true, std::memory_order_relaxed);
  Hazard* head = g_hazards.load(std::memory_order_relaxed);
  do h->next = head;
  while (!g_hazards.compare_exchange_weak(head, h, std::memory_order_release, std::memory_order_relaxed));
  return h;
}

struct ThreadHazard {
  Hazard* h = claim_hazard();
  ~ThreadHazard() {
    h->ptr.store(nullptr, std::memory_order_release);
    h->taken.store(false, std::memory_order_release);
  }
};

Hazard& my_hazard() {
  thread_local ThreadHazard t;
  return *t.h;
}

// Under g_mu: keep a replaced pool until no C ABI call is inside it. The seq_cst store of the
// new g_fast value (by the caller) and the seq_cst loads here pair with Pinned's seq_cst store of
// its hazard and its re-load of g_fast: a call either sees the new pool or is seen here.
void retire_locked(std::shared_ptr<Pool> old, std::vector<std::shared_ptr<Pool>>& dead) {
  if (old) g_retired.push_back(std::move(old));
  std::vector<Pool*> busy;
  for (Hazard* h = g_hazards.load(std::memory_order_acquire); h; h = h->next)
    if (Pool* p = h->ptr.load(std::memory_order_seq_cst)) busy.push_back(p);
  for (auto it = g_retired.begin(); it != g_retired.end();) {
    if (std::find(busy.begin(), busy.end(), it->get()) == busy.end()) {
      dead.push_back(std::move(*it));
      it = g_retired.erase(it);
    } else {
      ++it;
    }
  }
}

int slot(int device) {
  if (device < -1 || device >= kMaxDevices)
    throw InvalidArgument("device index " + std::to_string(device) + " out of range [-1, " +
                          std::to_string(kMaxDevices) + ")");
  return device + 1;
}
}  // namespace

void set(int device, std::shared_ptr<Pool> pool) {
  const int i = slot(device);
  std::vector<std::shared_ptr<Pool>> dead;  // destroyed after the lock is released
  std::lock_guard<std::mutex> g(g_mu);
  g_fast[i].store(pool.get(), std::memory_order_seq_cst);
  std::shared_ptr<Pool> old = std::exchange(g_pools[i], std::move(pool));
  retire_locked(std::move(old), dead);
}

void set_factory(Factory f) {
  std::lock_guard<std::mutex> g(g_mu);
  g_factory = std::move(f);
}

bool has_factory() {
  std::lock_guard<std::mutex> g(g_mu);
  return static_cast<bool>(g_factory);
}

Pool* get_fast(int device) {
  if (device < -1 || device >= kMaxDevices) return nullptr;
  return g_fast[device + 1].load(std::memory_order_acquire);
}

std::shared_ptr<Pool> get_shared(int device) {
  const int i = slot(device);
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_pools[i]) {
    if (!g_factory)
      throw InvalidArgument("no poolkeeper pool is installed for device " + std::to_string(device) +
                            " (install one first, e.g. poolkeeper.integrations.torch.install())");
    g_pools[i] = g_factory(device);
    g_fast[i].store(g_pools[i].get(), std::memory_order_release);
  }
  return g_pools[i];
}

Pool* get(int device) {
  if (Pool* p = get_fast(device)) return p;
  return get_shared(device).get();
}

void clear() {
  std::vector<std::shared_ptr<Pool>> dead;  // destroyed after the lock is released
  Factory f;
  std::lock_guard<std::mutex> g(g_mu);
  for (int i = 0; i <= kMaxDevices; ++i) {
    g_fast[i].store(nullptr, std::memory_order_seq_cst);
    retire_locked(std::exchange(g_pools[i], nullptr), dead);
  }
  f = std::exchange(g_factory, nullptr);
}

Pinned::Pinned(int device) {
  const int i = slot(device);
  Hazard& h = my_hazard();
  hazard_ = &h;
  saved_ = h.ptr.load(std::memory_order_relaxed);  // a nested call restores the outer one's
  Pool* p = g_fast[i].load(std::memory_order_acquire);
  for (;;) {
    if (!p) {
      if (!get_shared(device))  // creates through the factory, or throws
        throw InvalidArgument("the pool factory made no pool for device " + std::to_string(device));
      p = g_fast[i].load(std::memory_order_acquire);
      continue;
    }
    h.ptr.store(p, std::memory_order_seq_cst);
    Pool* again = g_fast[i].load(std::memory_order_seq_cst);
    if (again == p) break;
    p = again;  // replaced meanwhile: protect the new one instead
  }
  pool_ = p;
}

Pinned::~Pinned() { hazard_->ptr.store(saved_, std::memory_order_release); }

std::vector<std::pair<int, std::shared_ptr<Pool>>> all() {
  std::lock_guard<std::mutex> g(g_mu);
  std::vector<std::pair<int, std::shared_ptr<Pool>>> out;
  for (int i = 0; i <= kMaxDevices; ++i)
    if (g_pools[i]) out.emplace_back(i - 1, g_pools[i]);
  return out;
}

}  // namespace poolkeeper::registry
