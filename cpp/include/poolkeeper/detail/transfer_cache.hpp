// TransferCache: batches of free exact-size chunks passed between the thread caches of one
// ArenaPool under a lock of their own, not the pool's.
//
// Why: when one thread frees what another allocates (a producer/consumer server, the "mixed,
// cross-thread frees" case of benchmarks/thread_scaling.py), the freeing thread's cache fills and
// the allocating thread's runs dry. Both then met on the pool's lock: a full cache spilled a bin
// into the books (pointer-table erases, free-index inserts) and the dry one refilled a bin from
// them (index takes, table inserts), a few microseconds under the lock every 8 blocks, for every
// thread. Here the full cache hands a bin over and the dry one takes it: a copy of up to 8
// pointers under a lock held for nothing else; the books are not touched.
//
// - Contents: up to kSlots chunk sizes at once, up to kPerSlot chunks each. Every chunk here is
//   ThreadCached, free for every stream (cache tag kNoStream), still in the pool's pointer table
//   (a free of it is a double free, explained by the locked path), and counted in `bytes`.
// - Bounded: `bytes` never passes kBudgets per-thread cache budgets (thread_cache_bytes): a
//   handover that would is refused and the cache spills into the books as before.
// - Evicted: a handover refused because every slot holds another size goes on to the locked
//   path, which first gives the least recently used slot back to the books (bursts of sizes
//   nobody asks for again took all the slots and kept every later size out until a reclaim).
// - Empty whenever fewer than two caches are left (validate()): a lone cache never takes from it.
// - Reclaimed with the thread caches (reclaim_caches_locked: before an out-of-memory error, in
//   synchronize(), trim(), close()) and at the pressure pass before a growth (settle_locked): its
//   chunks go back to the books then, free memory no thread owns.
// Locks: `mu` guards every field below. Taken by a cache's owner inside its fast-path scope
// (ThreadCache::Entered) without the pool's lock, or under the pool's lock (order: the pool's
// lock, then mu). Whoever holds mu waits for nothing else, so a reclaimer that waits for a
// cache's owner to leave its fast path never holds mu meanwhile.
// Accounting: a handover moves bytes from a cache's cached_free to `bytes` (and back) while mu is
// held, and stats() reads every cache and `bytes` under mu: no observation sees a batch in both
// places or in neither.
#pragma once
#include <cstddef>
#include <cstdint>

#include "poolkeeper/detail/spin_mutex.hpp"
#include "poolkeeper/detail/thread_cache.hpp"

namespace poolkeeper::detail {

class alignas(64) TransferCache {
 public:
  static constexpr int kSlots = 8;
  static constexpr int kPerSlot = 16 * ThreadCache::kPerBin;
  // `bytes` stays within this many per-thread cache budgets (thread_cache_bytes).
  static constexpr std::size_t kBudgets = 2;

  struct Slot {
    std::size_t size = 0;  // chunk size; meaningless while count == 0
    std::uint32_t count = 0;
    std::uint64_t used = 0;  // `clock` at its last handover or take (least recently used: evicted first)
    ArenaChunk* items[kPerSlot] = {};
  };

  // mu held. The slot holding chunks of `size`, else (want_empty) an empty one, else nullptr.
  Slot* find(std::size_t size, bool want_empty) {
    Slot* empty = nullptr;
    for (auto& s : slots)
      if (s.count && s.size == size) return &s;
      else if (!s.count && !empty) empty = &s;
    return want_empty ? empty : nullptr;
  }
  // mu held. The occupied slot used least recently (nullptr: none occupied).
  Slot* least_recent() {
    Slot* lru = nullptr;
    for (auto& s : slots)
      if (s.count && (!lru || s.used < lru->used)) lru = &s;
    return lru;
  }

  SpinMutex mu;
  Slot slots[kSlots];
  std::size_t bytes = 0;               // chunk bytes held here
  std::uint64_t handed = 0, taken = 0;  // bins handed over by full caches / taken by dry ones
  std::uint64_t clock = 0;              // handovers + takes so far (Slot::used)
  std::uint64_t evicted = 0;            // slots given back to the books to make room for a size
};

}  // namespace poolkeeper::detail
