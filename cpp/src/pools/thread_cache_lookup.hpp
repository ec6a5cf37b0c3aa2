// Internal to ArenaPool: the per-thread lookup of a thread's cache for a pool. The thread-exit
// hook finds live arenas through the pool directory (Pool::with_pool), so a dying thread never
// touches a dead pool.
#pragma once
#include <cstdint>

namespace poolkeeper {
class ArenaPool;
namespace detail {
class ThreadCache;

// Lock-free: this thread's cache for pool `id`, or nullptr.
ThreadCache* tls_find_cache(std::uint64_t id);
// Record this thread's cache for pool `id` (called under the pool's lock, first use only).
void tls_add_cache(std::uint64_t id, ThreadCache* tc);
// True once this thread's cache list was destroyed (thread exit, or static destructors after
// the main thread's thread_locals): no cache may be made for it any more.
bool tls_caches_gone();
// Forget this thread's entries for pools that no longer exist, when there are many. Takes the
// directory lock, so it must be called while holding no pool lock (lock order: directory, pool).
void tls_prune();

}  // namespace detail
}  // namespace poolkeeper
