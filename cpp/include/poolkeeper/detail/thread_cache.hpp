// ThreadCache: one thread's exact-size blocks for one ArenaPool, in front of the pool's lock.
//
// - Owner-only contents: bins of (chunk size, stream tag) holding up to kPerBin chunks each. A tag
//   of kNoStream means "free for every stream"; a stream tag means the block was released on that
//   stream and may be reused at once only by it (for other streams it is pending).
// - Counters other threads read (stats at any time) are written by the owner inside a seqlock:
//   every fast-path operation is balanced within one cache (cached <-> live + overhead), so the
//   sum over caches of consistent snapshots keeps reserved == live + free + pending + overhead
//   exact without any atomic read-modify-write on the hot path.
// - Reclaim: another thread holding the pool's lock may empty the bins (before an out-of-memory
//   error, in synchronize() and trim(): memory must not stay stranded in the cache of a thread
//   that is idle and may never run again). `busy` excludes the two: the owner holds it around each
//   lock-free fast-path operation (try_enter fails only while a reclaim runs: the owner then takes
//   the locked path, which waits on the pool's lock), and the reclaimer spins on it for at most one
//   fast-path operation. The owner's locked paths touch the bins only under the pool's lock, which
//   the reclaimer holds too.
// Lifetime: owned by the pool; the thread-exit hook returns the blocks to the pool if it is alive.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>

#include "poolkeeper/core/types.hpp"

namespace poolkeeper::detail {

struct ArenaChunk;

// alignas: caches of different threads are written at once and must not share a cache line.
class alignas(64) ThreadCache {
 public:
  static constexpr int kBins = 16;
  static constexpr int kPerBin = 8;
  // With several caches, full bins of one size a cache keeps before it hands one over
  // (transfer_cache.hpp).
  static constexpr int kFullBinsPerSize = 2;

  struct Bin {
    std::size_t size = 0;
    Stream stream = kNoStream;
    std::uint32_t count = 0;
    ArenaChunk* items[kPerBin] = {};
    // A chunk of `sz` released on `st` may go here now (the bin may be emptied and still keyed).
    bool takes(std::size_t sz, Stream st) const { return size == sz && stream == st && count < kPerBin; }
  };

  struct Counters {
    std::int64_t live_delta = 0, overhead_delta = 0, blocks_delta = 0;
    std::int64_t cached_free = 0, cached_pending = 0;
    std::uint64_t hits = 0, frees = 0;
  };

  // --- owner only ---
  Bin bins[kBins];
  int hint = 0;                   // the bin the last hit used: a steady loop skips the scan
  // The arena shard serving this thread's requests above the cache (set once, under the pool's
  // lock, before the owner can read it; 0: the pool's own books).
  std::uint32_t home = 0;
  std::size_t bytes = 0;          // cached bytes (owner's view of cached_free + cached_pending)
  void begin() {
    seq_.store(seq_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
  }
  void end() { seq_.store(seq_.load(std::memory_order_relaxed) + 1, std::memory_order_release); }
  // Fields are atomics written with relaxed stores by the owner (no read-modify-write).
  void add(std::atomic<std::int64_t>& f, std::int64_t d) { f.store(f.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); }
  void add(std::atomic<std::uint64_t>& f, std::uint64_t d) { f.store(f.load(std::memory_order_relaxed) + d, std::memory_order_relaxed); }

  std::atomic<std::int64_t> live_delta{0}, overhead_delta{0}, blocks_delta{0}, cached_free{0}, cached_pending{0};
  std::atomic<std::uint64_t> hits{0}, frees{0};
  std::atomic<std::size_t> peak_live_pub{0};  // the owner's estimate of the pool's live peak

  // --- owner (fast paths) and reclaimer (under the pool's lock) ---
  bool try_enter() { return !busy_.exchange(true, std::memory_order_acquire); }
  void leave() { busy_.store(false, std::memory_order_release); }
  // The owner's fast-path scope: leave() when it ends.
  struct Entered {
    ThreadCache* tc;
    ~Entered() { tc->leave(); }
  };
  void enter() {  // the reclaimer: the owner leaves within one fast-path operation
    for (unsigned spins = 0; !try_enter(); ++spins)
      if (spins > 64) std::this_thread::yield();
  }

  Counters read() const {
    Counters c;
    for (;;) {
      const auto s1 = seq_.load(std::memory_order_acquire);
      if (s1 & 1) continue;
      c.live_delta = live_delta.load(std::memory_order_relaxed);
      c.overhead_delta = overhead_delta.load(std::memory_order_relaxed);
      c.blocks_delta = blocks_delta.load(std::memory_order_relaxed);
      c.cached_free = cached_free.load(std::memory_order_relaxed);
      c.cached_pending = cached_pending.load(std::memory_order_relaxed);
      c.hits = hits.load(std::memory_order_relaxed);
      c.frees = frees.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seq_.load(std::memory_order_relaxed) == s1) return c;
    }
  }

 private:
  std::atomic<std::uint32_t> seq_{0};
  std::atomic<bool> busy_{false};
};

}  // namespace poolkeeper::detail
