#include "poolkeeper/core/registry.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <linux/membarrier.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <mutex>
#include <new>

namespace poolkeeper::registry {

namespace detail {
std::array<std::atomic<Pool*>, kMaxDevices + 1> g_fast{};
__attribute__((tls_model("initial-exec"))) thread_local Hazard* t_hazard = nullptr;
std::atomic<bool> g_asymmetric{false};
}  // namespace detail

namespace {
using detail::g_fast;
using detail::Hazard;

// Immortal (made once, never destroyed): threads the interpreter never stops -- a framework's
// native threads, a Python thread inside a ctypes call -- may still be inside a C ABI call while
// exit() runs the C++ static destructors; destroying these under them crashed (a pool destroyed
// while a thread allocated from it). What they hold at the end goes with the process.
std::mutex& g_mu = *new std::mutex;
std::array<std::shared_ptr<Pool>, kMaxDevices + 1>& g_pools =
    *new std::array<std::shared_ptr<Pool>, kMaxDevices + 1>();  // [0] = host (-1), [d+1] = device d
Factory& g_factory = *new Factory;
// Pools replaced or cleared while a C ABI call may still be inside them (under g_mu).
std::vector<std::shared_ptr<Pool>>& g_retired = *new std::vector<std::shared_ptr<Pool>>;
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

// Gives the thread's record back at thread exit. Touched once per thread (claim_thread_hazard),
// so the hot path reads only the trivially constructed t_hazard slot.
struct ThreadHazard {
  Hazard* h = claim_hazard();
  ~ThreadHazard() {
    detail::t_hazard = nullptr;
    h->ptr.store(nullptr, std::memory_order_release);
    for (auto& g : h->graph) g.store(nullptr, std::memory_order_release);
    h->graph_depth = 0;
    h->taken.store(false, std::memory_order_release);
  }
};

// The heavy half of the asymmetric barrier (see g_asymmetric): every running thread of the
// process executes a full memory barrier before this returns.
bool heavy_barrier() {
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0) return true;
  // A forked child starts unregistered (the registration belongs to the address space): register.
  return syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 &&
         syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
}

// Once, before the first pool is published: switch readers to the light barrier if the kernel
// allows it (a container may refuse membarrier; readers then keep the seq_cst store).
void enable_asymmetric_locked() {
  static bool tried = false;
  if (tried) return;
  tried = true;
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 && heavy_barrier())
    detail::g_asymmetric.store(true, std::memory_order_seq_cst);
}

// Under g_mu: keep a replaced pool until no C ABI call is inside it. The caller's seq_cst store of
// the new g_fast value, the barrier and the loads here pair with Pinned's hazard store and its
// re-load of g_fast: a call either sees the new pool or is seen here.
void retire_locked(std::shared_ptr<Pool> old, std::vector<std::shared_ptr<Pool>>& dead) {
  if (old) g_retired.push_back(std::move(old));
  if (g_retired.empty()) return;
  // A reader on the light path may have its hazard store still in its store buffer: the heavy
  // barrier drains it (and every other thread's) before the scan.
  // Should the barrier ever fail, keep every retired pool: a leak, never a use-after-free.
  if (detail::g_asymmetric.load(std::memory_order_relaxed) && !heavy_barrier()) return;
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

// fork(): see the header. Runs in the child, where only the forking thread exists.
std::atomic<bool> g_left_at_fork{false};
void fork_child() {
  Hazard* mine = detail::t_hazard;
  for (Hazard* h = g_hazards.load(std::memory_order_acquire); h; h = h->next) {
    if (h == mine) continue;  // the forking thread's record: it may be inside a call right now
    h->ptr.store(nullptr, std::memory_order_relaxed);
    for (auto& g : h->graph) g.store(nullptr, std::memory_order_relaxed);
    h->graph_depth = 0;
    h->taken.store(false, std::memory_order_release);
  }
  if (g_mu.try_lock()) {
    g_mu.unlock();
    return;
  }
  // Held by a thread that does not exist here: every later call would wait for it forever. The
  // old objects are not destroyed (their state may be half-changed): placement new leaks them.
  g_left_at_fork.store(true, std::memory_order_relaxed);
  new (&g_mu) std::mutex;
  new (&g_pools) std::array<std::shared_ptr<Pool>, kMaxDevices + 1>();
  new (&g_retired) std::vector<std::shared_ptr<Pool>>();
  new (&g_factory) Factory();
  for (auto& f : g_fast) f.store(nullptr, std::memory_order_relaxed);
}
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, fork_child);

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
  enable_asymmetric_locked();
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
    enable_asymmetric_locked();
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

std::vector<std::pair<int, std::shared_ptr<Pool>>> all() {
  std::lock_guard<std::mutex> g(g_mu);
  std::vector<std::pair<int, std::shared_ptr<Pool>>> out;
  for (int i = 0; i <= kMaxDevices; ++i)
    if (g_pools[i]) out.emplace_back(i - 1, g_pools[i]);
  return out;
}

std::size_t retired_count() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_retired.size();
}

bool left_at_fork() { return g_left_at_fork.load(std::memory_order_relaxed); }

namespace detail {
bool graph_hazards(std::vector<const void*>& out) {
  if (g_asymmetric.load(std::memory_order_relaxed) && !heavy_barrier()) return false;
  for (Hazard* h = g_hazards.load(std::memory_order_acquire); h; h = h->next)
    for (auto& g : h->graph)
      if (const void* p = g.load(std::memory_order_seq_cst)) out.push_back(p);
  return true;
}

Hazard* claim_thread_hazard() {
  thread_local ThreadHazard t;
  t_hazard = t.h;
  return t.h;
}

Pool* pin_slow(int device, Hazard* h, Pool* saved) {
  try {
    const int i = slot(device);  // throws for a bad index
    Pool* p = g_fast[i].load(std::memory_order_acquire);
    for (;;) {
      if (!p) {
        if (!get_shared(device))  // creates through the factory, or throws
          throw InvalidArgument("the pool factory made no pool for device " + std::to_string(device));
        p = g_fast[i].load(std::memory_order_acquire);
        continue;
      }
      h->ptr.store(p, std::memory_order_seq_cst);
      Pool* again = g_fast[i].load(std::memory_order_seq_cst);
      if (again == p) return p;
      p = again;  // replaced meanwhile: protect the new one instead
    }
  } catch (...) {
    h->ptr.store(saved, std::memory_order_release);  // the Pinned is not constructed: no destructor
    throw;
  }
}
}  // namespace detail

}  // namespace poolkeeper::registry
