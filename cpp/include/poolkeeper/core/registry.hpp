// The process-wide pool registry behind the C ABI (PyTorch's pluggable allocator calls plain C
// functions with a device index, so "which pool" must be answerable without Python).
//
// - set(device, pool) installs a pool for a device index (-1: host). get_fast() is lock-free.
// - A factory, when set, creates a device's pool lazily on its first request (per-device pools for
//   torch), under the registry mutex.
// - A pool replaced by set() or removed by clear() while a C ABI call is inside it stays alive
//   until that call returns (Pinned publishes the pool it uses as a per-thread hazard pointer;
//   set/clear destroy only pools no hazard names, and retry the rest at the next set/clear).
// - fork(): in the child the other threads are gone, so their hazard records are given back (else
//   what they name would be kept for good); and when another thread held the registry's lock at
//   the fork, the child starts with an empty registry and a fresh lock (what the old one held is
//   leaked: its state may have been half-changed, and the parent's pools are closed in the child
//   anyway, see Pool::forked).
// Thread-safe.
#pragma once
#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "poolkeeper/core/pool.hpp"

namespace poolkeeper::registry {

inline constexpr int kMaxDevices = 64;
using Factory = std::function<std::shared_ptr<Pool>(int device)>;

void set(int device, std::shared_ptr<Pool> pool);
void set_factory(Factory f);
bool has_factory();
// Lock-free lookup of an installed pool; nullptr if none (and no factory has made one yet).
Pool* get_fast(int device);
// Lookup, creating through the factory when needed. Throws InvalidArgument for a bad index or
// when no pool is installed and there is no factory. The raw pointer is valid only while the
// pool stays installed: calls that may race with set()/clear() use Pinned.
Pool* get(int device);

namespace detail {
// One per thread that calls through the C ABI: the pool it is inside right now. Records are never
// freed (a thread's record is reused by a later thread), so a scan never reads freed memory.
// alignas: every C ABI call stores into its thread's record twice; two threads' records on one
// cache line would pass that line between their cores at every call.
struct alignas(64) Hazard {
  std::atomic<Pool*> ptr{nullptr};
  // The GraphPools the call is inside (graph_registry::Pinned), one slot per nesting level: a
  // capture filter may call back into the C ABI, and the outer call must stay protected.
  static constexpr int kGraphSlots = 4;
  std::array<std::atomic<const void*>, kGraphSlots> graph{};
  int graph_depth = 0;  // this thread's pins in use (only its own thread touches it)
  std::atomic<bool> taken{false};
  Hazard* next = nullptr;
};
extern std::array<std::atomic<Pool*>, kMaxDevices + 1> g_fast;  // [0] = host (-1), [d+1] = device d
extern __attribute__((tls_model("initial-exec"))) thread_local Hazard* t_hazard;
// True once set()/clear() can force a memory barrier on every running thread of the process
// (Linux membarrier, private expedited): then a hazard store needs only a compiler barrier
// before the re-load, the heavy barrier is paid by the rare writer. False: a seq_cst store.
extern std::atomic<bool> g_asymmetric;
Hazard* claim_thread_hazard();                      // a thread's first call
Pool* pin_slow(int device, Hazard* h, Pool* saved);  // bad index, no pool yet, or replaced meanwhile
// Every GraphPools some thread's hazard names right now, after the heavy barrier (see
// g_asymmetric) has drained every reader's pending hazard store; false when that barrier failed
// (the caller then keeps everything: a leak, never a use-after-free). For graph_registry, whose
// writers call it after unpublishing, with their own lock held.
bool graph_hazards(std::vector<const void*>& out);
}  // namespace detail

// The device's pool (created through the factory when needed; throws like get()), kept alive
// for this object's lifetime even if set() or clear() replaces it meanwhile. The hit path is
// inline: a TLS read, two loads of the slot and two stores to the thread's own hazard record (the
// first seq_cst, pairing with the scan in set/clear). Not copyable; one thread.
class Pinned {
 public:
  explicit Pinned(int device) {
    detail::Hazard* h = detail::t_hazard;
    if (!h) h = detail::claim_thread_hazard();
    hazard_ = h;
    saved_ = h->ptr.load(std::memory_order_relaxed);  // a nested call restores the outer one's
    Pool* p = nullptr;
    if (static_cast<unsigned>(device + 1) < static_cast<unsigned>(kMaxDevices + 1)) {
      p = detail::g_fast[device + 1].load(std::memory_order_acquire);
      if (p) {
        if (detail::g_asymmetric.load(std::memory_order_relaxed)) {
          h->ptr.store(p, std::memory_order_relaxed);
          std::atomic_signal_fence(std::memory_order_seq_cst);
        } else {
          h->ptr.store(p, std::memory_order_seq_cst);
        }
        if (detail::g_fast[device + 1].load(std::memory_order_seq_cst) != p) p = nullptr;
      }
    }
    pool_ = p ? p : detail::pin_slow(device, h, saved_);
  }
  ~Pinned() { hazard_->ptr.store(saved_, std::memory_order_release); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  Pool* operator->() const { return pool_; }
  Pool* get() const { return pool_; }

 private:
  Pool* pool_ = nullptr;
  detail::Hazard* hazard_ = nullptr;
  Pool* saved_ = nullptr;
};

std::shared_ptr<Pool> get_shared(int device);
void clear();
// Every installed pool (for empty_cache / stats).
std::vector<std::pair<int, std::shared_ptr<Pool>>> all();
// Pools replaced or cleared that are still kept because a C ABI call was inside them at the last
// set()/clear() (diagnostics; they go at the next set()/clear() that finds them unused).
std::size_t retired_count();
// True in a forked child that started with an empty registry (another thread held its lock at the
// fork): the inherited pools were left behind, never destroyed.
bool left_at_fork();

}  // namespace poolkeeper::registry
