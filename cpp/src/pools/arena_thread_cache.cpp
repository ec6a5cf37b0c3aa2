// ArenaPool's thread cache: the lock-free hit paths, and moving blocks between a thread's cache
// and the pool (under the pool's lock).
#include <pthread.h>

#include <mutex>
#include <unordered_map>

#include "thread_cache_lookup.hpp"
#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/detail/test_seam.hpp"

namespace poolkeeper {

using detail::ArenaChunk;
using detail::ThreadCache;

namespace detail {
namespace {
struct TlsEntry {
  std::uint64_t id = 0;
  ThreadCache* cache = nullptr;
};

// The hot lookup reads a trivially constructed, initial-exec TLS slot: no init guard and no
// __tls_get_addr call on the fast path. The list with a destructor is touched only on first use.
__attribute__((tls_model("initial-exec"))) thread_local TlsEntry t_last;
// Set once this thread's TlsCaches is destroyed: pools destroyed later on this thread (static
// destructors at exit, after the main thread's thread_locals) must not read its freed list.
__attribute__((tls_model("initial-exec"))) thread_local bool t_caches_gone = false;

struct TlsCaches {
  std::vector<TlsEntry> entries;
  ~TlsCaches() {
    // Thread exit: give each pool that still exists its blocks back, through the pool directory
    // (which keeps the pool from being destroyed while we fold into it, and skips pools inherited
    // through fork(), whose lock may have been held at the fork). Ids are never reused, and an
    // id with a thread cache is an ArenaPool's.
    for (auto& e : entries)
      Pool::with_pool(
          e.id, [](Pool& p, void* tc) { static_cast<ArenaPool&>(p).on_thread_exit(static_cast<ThreadCache*>(tc)); },
          e.cache);
    t_caches_gone = true;
    t_last = {};  // ids start at 1: the hot lookup's first test never matches again
  }
};
thread_local TlsCaches t_caches;
}  // namespace

ThreadCache* tls_find_cache(std::uint64_t id) {
  if (t_last.id == id) return t_last.cache;
  if (t_caches_gone) return nullptr;  // the list is freed (its caches went back to their pools)
  for (auto& e : t_caches.entries)
    if (e.id == id) {
      t_last = e;
      return e.cache;
    }
  return nullptr;
}

bool tls_caches_gone() { return t_caches_gone; }

void tls_add_cache(std::uint64_t id, ThreadCache* tc) {
  TlsCaches& t = t_caches;
  t.entries.push_back({id, tc});
  t_last = t.entries.back();
}

void tls_prune() {
  if (t_caches_gone) return;
  TlsCaches& t = t_caches;
  if (t.entries.size() <= 64) return;
  std::erase_if(t.entries, [](const TlsEntry& e) { return !Pool::with_pool(e.id, [](Pool&, void*) {}, nullptr); });
  t_last = t.entries.empty() ? TlsEntry{} : t.entries.back();
}

}  // namespace detail

void* ArenaPool::try_allocate_fast(std::size_t nbytes, Stream s) {
  if (!cache_enabled_ || nbytes - 1 >= opt_.thread_cache_max_block) return nullptr;  // 0 wraps: refused
  // Single-stream mode: another stream (or none) ends the mode, which may wait: the locked path.
  if (barred_from_caches(s)) return nullptr;
  ThreadCache* tc = detail::tls_find_cache(id_);
  if (!tc || closed_.load(std::memory_order_relaxed)) return nullptr;
  if (!tc->try_enter()) return nullptr;  // a reclaim is emptying this cache: the locked path serves
  ThreadCache::Entered entered{tc};
  const std::size_t rounded = align_up(nbytes, opt_.alignment);
  ThreadCache::Bin* hit = &tc->bins[tc->hint];
  if (!(hit->count && hit->size == rounded && hit->stream == s)) {
    hit = nullptr;
    for (auto& b : tc->bins) {
      if (!b.count || b.size != rounded) continue;
      if (b.stream == s) {  // released on this very stream: preferred (otherwise pending for others)
        hit = &b;
        break;
      }
      if (b.stream == kNoStream && !hit) hit = &b;
    }
    // Dry for this size: another thread's cache may have handed a bin of it over (several
    // caches only; the locked path refills from the books otherwise).
    if (!hit && !(ncaches_.load(std::memory_order_relaxed) > 1 && (hit = take_over(tc, rounded, s)))) return nullptr;
    tc->hint = static_cast<int>(hit - tc->bins);
  }
  ArenaChunk* c = hit->items[--hit->count];
  const auto size = static_cast<std::int64_t>(c->size);
  const auto req = static_cast<std::int64_t>(nbytes);
  c->requested = nbytes;
  c->alloc_stream = c->last_stream = s;
  c->set(ChunkState::Live);
  tc->begin();
  tc->add(hit->stream == kNoStream ? tc->cached_free : tc->cached_pending, -size);
  tc->add(tc->live_delta, req);
  tc->add(tc->overhead_delta, size - req);
  tc->add(tc->blocks_delta, 1);
  tc->add(tc->hits, 1);
  tc->end();
  tc->bytes -= c->size;  // an emptied bin keeps its key: the next free of that size lands there
  // Peak estimate: exact while one thread uses the pool (the pool's own live bytes plus this
  // cache's delta); with several threads the locked paths and stats() keep the peak.
  if (ncaches_.load(std::memory_order_relaxed) != 1) return reinterpret_cast<void*>(c->addr);
  const auto est = static_cast<std::int64_t>(live_.load(std::memory_order_relaxed)) +
                   tc->live_delta.load(std::memory_order_relaxed);
  // Compared against the published value (not an owner-private copy) so reset_peaks(), which
  // zeroes it from another thread, restarts this cache's tracking as well.
  if (est > static_cast<std::int64_t>(tc->peak_live_pub.load(std::memory_order_relaxed)))
    tc->peak_live_pub.store(static_cast<std::size_t>(est), std::memory_order_relaxed);
  return reinterpret_cast<void*>(c->addr);
}

bool ArenaPool::try_deallocate_fast(void* p, Stream s) {
  if (!cache_enabled_) return false;
  ThreadCache* tc = detail::tls_find_cache(id_);
  if (!tc || closed_.load(std::memory_order_relaxed)) return false;
  if (!tc->try_enter()) return false;  // a reclaim is emptying this cache: the locked path serves
  ThreadCache::Entered entered{tc};
  ArenaChunk* c = nullptr;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!table_.find(a, c)) return false;  // the locked path explains
  POOLKEEPER_SEAM(ArenaCacheFound);
  return cache_free(tc, c, a, s, ChunkState::Live);
}

// c's free into tc's bins, when they take it; false leaves c as it was. c is claimed from `from`
// by one compare-exchange: Live for a lock-free free, so that of two threads freeing one block at
// once exactly one caches it (the other takes the locked path, which reports the double free);
// Freeing for a free under the pool lock that claimed c before (spill_and_cache_locked).
bool ArenaPool::cache_free(ThreadCache* tc, ArenaChunk* c, std::uintptr_t a, Stream s, ChunkState from) {
  if (c->st() != from) return false;
  // Claimed before the checks read c: a record found lock-free may be freed, merged away and reused
  // by another thread meanwhile, so only a claimed record whose address is still a's is ours.
  if (!c->claim(from, ChunkState::ThreadCached)) return false;
  ThreadCache::Bin* slot = &tc->bins[tc->hint];
  // Released on a stream other than its own, the block must also wait for the allocating stream.
  if (c->addr != a || c->used_on || c->size > opt_.thread_cache_max_block ||
      (s != kNoStream && c->alloc_stream != kNoStream && c->alloc_stream != s))
    slot = nullptr;
  // The hinted bin (the common case: the same size as the last free) takes it without a scan;
  // the rest is out of line, so a single thread's hit costs what it did before the transfer cache.
  else if (tc->bytes + c->size > opt_.thread_cache_bytes || !slot->takes(c->size, s)) {
    if ((slot = free_bin_slow(tc, c->size, s))) tc->hint = static_cast<int>(slot - tc->bins);
  }
  if (!slot) {
    c->set(from);  // not taken: as it was
    return false;
  }
  slot->items[slot->count++] = c;
  const auto size = static_cast<std::int64_t>(c->size);
  const auto req = static_cast<std::int64_t>(c->requested);
  c->cache_tag = s;
  c->last_stream = s;
  tc->begin();
  tc->add(tc->live_delta, -req);
  tc->add(tc->overhead_delta, req - size);
  tc->add(tc->blocks_delta, -1);
  tc->add(s == kNoStream ? tc->cached_free : tc->cached_pending, size);
  tc->add(tc->frees, 1);
  tc->end();
  tc->bytes += c->size;
  return true;
}

// Out of line on purpose: written inline in try_deallocate_fast, this search cost every cache-hit
// free about 14 instructions (callgrind), though a single thread's free almost always takes the
// hinted bin.
#if defined(__GNUC__)
__attribute__((noinline))
#endif
ThreadCache::Bin* ArenaPool::free_bin_slow(ThreadCache* tc, std::size_t size, Stream s) {
  // With several caches, blocks of one size may flow in here from a thread that allocates them
  // faster than this one does: past kFullBinsPerSize full bins of it they go on to the transfer
  // cache, or they would take every bin and the cache could hold no other size.
  const bool several = s == kNoStream && ncaches_.load(std::memory_order_relaxed) > 1;
  // The hinted bin, a bin of this size and stream with room, or an empty one (keyed for it). The
  // hinted bin is looked at again after a hand-over: the bin handed over may have been it.
  auto find = [&]() -> ThreadCache::Bin* {
    if (tc->bytes + size > opt_.thread_cache_bytes) return nullptr;
    if (tc->bins[tc->hint].takes(size, s)) return &tc->bins[tc->hint];
    ThreadCache::Bin* empty = nullptr;
    int full = 0;
    for (auto& b : tc->bins) {
      if (b.count) {
        if (b.size == size && b.stream == s) {
          if (b.count < ThreadCache::kPerBin) return &b;
          ++full;
        }
      } else if (!empty) {
        empty = &b;
      }
    }
    if (several && full >= ThreadCache::kFullBinsPerSize) return nullptr;
    if (empty) {
      empty->size = size;
      empty->stream = s;
    }
    return empty;
  };
  ThreadCache::Bin* slot = find();
  // Full: with several caches, hand a bin of this size over to the thread that will allocate it
  // (the locked path spills into the books otherwise).
  if (several)
    while (!slot && hand_over(tc, size)) slot = find();
  return slot;
}

bool ArenaPool::hand_over(ThreadCache* tc, std::size_t size) {
  // The fullest bin of this size that every stream may reuse; without one, the bin of most bytes
  // (the cache is full of other sizes: they make room).
  ThreadCache::Bin *bin = nullptr, *largest = nullptr;
  for (auto& b : tc->bins) {
    if (!b.count || b.stream != kNoStream) continue;
    if (b.size == size && (!bin || b.count > bin->count)) bin = &b;
    if (!largest || b.size * b.count > largest->size * largest->count) largest = &b;
  }
  if (!bin) bin = largest;
  if (!bin) return false;
  size = bin->size;
  const std::size_t bytes = size * bin->count;
  std::lock_guard<detail::SpinMutex> g(xfer_.mu);
  // Again under mu: the other cache may have exited since the caller looked, and its exit flushed
  // the transfer cache under this lock after storing the count; a lone cache never takes, so a
  // bin handed over now would stay until the next reclaim.
  if (ncaches_.load(std::memory_order_relaxed) < 2) return false;
  if (xfer_.bytes + bytes > detail::TransferCache::kBudgets * opt_.thread_cache_bytes) return false;
  detail::TransferCache::Slot* slot = xfer_.find(size, true);
  if (!slot || slot->count + bin->count > detail::TransferCache::kPerSlot) return false;
  for (std::uint32_t i = 0; i < bin->count; ++i) slot->items[slot->count++] = bin->items[i];
  slot->size = size;
  slot->used = ++xfer_.clock;
  bin->count = 0;
  // Both sides move under xfer_.mu, which stats() holds while it reads them.
  tc->begin();
  tc->add(tc->cached_free, -static_cast<std::int64_t>(bytes));
  tc->end();
  tc->bytes -= bytes;
  xfer_.bytes += bytes;
  ++xfer_.handed;
  return true;
}

ThreadCache::Bin* ArenaPool::take_over(ThreadCache* tc, std::size_t size, Stream s) {
  ThreadCache::Bin* bin = nullptr;
  for (auto& b : tc->bins)
    if (!b.count) {
      bin = &b;
      break;
    }
  if (!bin) return nullptr;
  std::lock_guard<detail::SpinMutex> g(xfer_.mu);
  // Single-stream mode, checked again under xfer_.mu: a bin handed over after the home stream was
  // set (a hand-over happens under this lock, after the home was stored) may hold home releases,
  // which no other stream may take before the mode ends. try_allocate_fast's check may have read
  // the home before it was set.
  if (barred_from_caches(s)) return nullptr;
  detail::TransferCache::Slot* slot = xfer_.find(size, false);
  if (!slot) return nullptr;
  std::uint32_t n = 0;
  while (n < ThreadCache::kPerBin && slot->count && tc->bytes + (n + 1) * size <= opt_.thread_cache_bytes)
    bin->items[n++] = slot->items[--slot->count];
  if (!n) return nullptr;
  slot->used = ++xfer_.clock;
  bin->size = size;
  bin->stream = kNoStream;
  bin->count = n;
  const std::size_t bytes = size * n;
  tc->begin();
  tc->add(tc->cached_free, static_cast<std::int64_t>(bytes));
  tc->end();
  tc->bytes += bytes;
  xfer_.bytes -= bytes;
  ++xfer_.taken;
  return bin;
}

std::size_t ArenaPool::file_transfer_slot_locked(detail::TransferCache::Slot& slot) {
  std::size_t bytes = 0;
  for (std::uint32_t i = 0; i < slot.count; ++i) {
    uncache_locked(slot.items[i]);  // (tagged kNoStream: filed free)
    bytes += slot.items[i]->size;
  }
  slot.count = 0;
  xfer_.bytes -= bytes;
  return bytes;
}

std::size_t ArenaPool::flush_transfer_locked() {
  std::lock_guard<detail::SpinMutex> g(xfer_.mu);
  std::size_t bytes = 0;
  for (auto& slot : xfer_.slots) bytes += file_transfer_slot_locked(slot);
  return bytes;
}

bool ArenaPool::evict_transfer_locked(std::size_t size) {
  std::lock_guard<detail::SpinMutex> g(xfer_.mu);
  if (xfer_.find(size, true)) return false;
  detail::TransferCache::Slot* lru = xfer_.least_recent();
  if (!lru) return false;
  file_transfer_slot_locked(*lru);
  ++xfer_.evicted;
  return true;
}

ThreadCache* ArenaPool::cache_locked() {
  if (ThreadCache* tc = detail::tls_find_cache(id_)) return tc;
  // This thread's thread_locals are gone (a static destructor at exit): it runs without a cache.
  // (Each call made one that no lookup found again: 40,000 caches for 20,000 pairs.)
  if (detail::tls_caches_gone()) return nullptr;
  caches_.push_back(std::make_unique<ThreadCache>());
  ncaches_.store(caches_.size(), std::memory_order_relaxed);
  ThreadCache* tc = caches_.back().get();
  // Round robin in order of first visit: the first thread (a single-threaded pool) stays home.
  tc->home = static_cast<std::uint32_t>(homes_assigned_++ % nshards_);
  detail::tls_add_cache(id_, tc);
  return tc;
}

void ArenaPool::flush_cache_locked(ThreadCache* tc) {
  flush_bins_locked(tc, 0);
  ++ev_.cache_flushes;
}

// A chunk a thread cache or the transfer cache held, back into the books: free, or pending on the
// stream it was released on (then reusable at once by that stream only; single-stream mode files
// a home release free). True when it was cached free for every stream (the caches' books).
bool ArenaPool::uncache_locked(ArenaChunk* c) {
  table_.erase(c->addr);
  c->used_epoch = scan_epoch_;  // in use through the caches until now: not idle memory
  if (c->cache_tag == kNoStream) {
    file_free_locked(c);
    return true;
  }
  if (home_release_locked(c, c->cache_tag)) {
    file_home_free_locked(c);
    return false;  // (counted as pending while cached: tagged with a stream)
  }
  order_.defer(c, c->cache_tag);
  note_pending_locked(c);
  return false;
}

// The cache's bins of chunk size `size` (0: every bin) back into the books.
void ArenaPool::flush_bins_locked(ThreadCache* tc, std::size_t size) {
  std::int64_t freed = 0, pending = 0;
  for (auto& b : tc->bins) {
    if (!b.count || (size && b.size != size)) continue;
    for (std::uint32_t i = 0; i < b.count; ++i) {
      ArenaChunk* c = b.items[i];
      (uncache_locked(c) ? freed : pending) += static_cast<std::int64_t>(c->size);
    }
    b.count = 0;
    b.size = 0;
    b.stream = kNoStream;
  }
  tc->begin();
  tc->add(tc->cached_free, -freed);
  tc->add(tc->cached_pending, -pending);
  tc->end();
  tc->bytes -= static_cast<std::size_t>(freed + pending);
}

// Batches between a thread's cache and the books (docs/threads.md). With several threads, blocks
// flow from the threads that free them to the threads that allocate them (a producer/consumer
// server): the freeing thread's cache fills, the allocating thread's runs dry, and each block then
// crossed over alone through the pool lock, where every thread met (the "mixed, cross-thread
// frees" case of benchmarks/thread_scaling.py collapsed below one thread's rate). So, under the
// lock, a bin's worth moves at once: a full cache gives back its blocks of the size being freed,
// and an allocation the cache missed takes the books' free chunks of exactly that size along.
// Only with several caches: a single-threaded pool keeps its free chunks in the index, where they
// can merge, as before.

// An allocation of `rounded` bytes the cache missed: fill a bin with exact-size free chunks.
void ArenaPool::refill_cache_locked(std::size_t rounded) {
  if (!cache_enabled_ || rounded > opt_.thread_cache_max_block || ncaches_.load(std::memory_order_relaxed) < 2) return;
  ThreadCache* tc = detail::tls_find_cache(id_);
  if (!tc || tc->bytes + rounded > opt_.thread_cache_bytes) return;
  ThreadCache::Bin* bin = nullptr;
  for (auto& b : tc->bins) {
    if (b.count && b.size == rounded && b.stream == kNoStream && b.count < ThreadCache::kPerBin) {
      bin = &b;
      break;
    }
    if (!b.count && !bin) bin = &b;
  }
  if (!bin) return;
  std::int64_t moved = 0;
  while (bin->count < ThreadCache::kPerBin && tc->bytes + rounded <= opt_.thread_cache_bytes) {
    // Exact-size chunks only: cutting more from a larger chunk was tried and measured (H200,
    // `poolkeeper bench --workloads threads` and thread_scaling.py side by side): no faster, and
    // it held up to twice the memory under 16-32 threads.
    ArenaChunk* c = index_.take_exact(rounded);
    if (!c) break;
    c->set(ChunkState::ThreadCached);
    c->cache_tag = kNoStream;
    c->used_epoch = scan_epoch_;
    table_.insert(c->addr, c);
    bin->size = rounded;
    bin->stream = kNoStream;
    bin->items[bin->count++] = c;
    tc->bytes += rounded;
    moved += static_cast<std::int64_t>(rounded);
  }
  if (!moved) return;
  tc->begin();
  tc->add(tc->cached_free, moved);
  tc->end();
  ++ev_.cache_refills;
}

// A free of c (claimed by the caller: Freeing; this thread's cache refused it): if only room was
// missing, give back the cache's blocks of c's size (all of them if the byte budget still has no
// room) and cache c. Returns true when c is cached now. nowait: refuse rather than give back
// stream-tagged blocks (filing those as pending may record events, an upstream call).
bool ArenaPool::spill_and_cache_locked(ArenaChunk* c, Stream s, bool nowait) {
  if (!cache_enabled_ || ncaches_.load(std::memory_order_relaxed) < 2) return false;
  ThreadCache* tc = detail::tls_find_cache(id_);
  if (!tc || c->used_on || c->size > opt_.thread_cache_max_block) return false;
  if (s != kNoStream && c->alloc_stream != kNoStream && c->alloc_stream != s) return false;
  bool bin = false, tagged = false;
  for (const auto& b : tc->bins) {
    bin |= !b.count || (b.size == c->size && b.stream == s && b.count < ThreadCache::kPerBin);
    tagged |= b.count && b.stream != kNoStream;
  }
  if (!bin || tc->bytes + c->size > opt_.thread_cache_bytes) {
    // The transfer cache may have had no slot for this size: make one (the slot nobody has used
    // for longest goes back to the books) and hand a bin over after all.
    if (s == kNoStream && evict_transfer_locked(c->size) && cache_free(tc, c, c->addr, s, ChunkState::Freeing)) {
      ++ev_.slow_frees;
      return true;
    }
    if (nowait && tagged) return false;
    flush_bins_locked(tc, c->size);
    if (tc->bytes + c->size > opt_.thread_cache_bytes) flush_bins_locked(tc, 0);
    ++ev_.cache_spills;
  }
  // The owner is this thread, inside no fast-path operation, and reclaimers need the lock we hold:
  // no try_enter needed.
  if (!cache_free(tc, c, c->addr, s, ChunkState::Freeing)) return false;
  ++ev_.slow_frees;  // a locked call all the same
  return true;
}

// Every cache's blocks back into the pool now, the idle threads' included: they may never run
// again, and their bytes must not be missing from an allocation, synchronize() or trim().
std::size_t ArenaPool::reclaim_caches_locked() {
  if (!cache_enabled_) return 0;
  ThreadCache* own = detail::tls_find_cache(id_);
  std::size_t bytes = flush_transfer_locked();
  for (auto& p : caches_) {
    ThreadCache* tc = p.get();
    if (tc == own) {  // this thread's fast paths are not running: no exclusion needed
      bytes += tc->bytes;
      if (tc->bytes) flush_cache_locked(tc);
      continue;
    }
    tc->enter();
    if (tc->bytes) {
      bytes += tc->bytes;
      flush_cache_locked(tc);
      ++ev_.caches_reclaimed;
    }
    tc->leave();
  }
  return bytes;
}

// Move a cache's balances into the pool's own counters (its owner is gone or idle).
void ArenaPool::fold_cache_locked(ThreadCache* tc) {
  const auto k = tc->read();
  live_.store(static_cast<std::size_t>(static_cast<std::int64_t>(live_.load()) + k.live_delta));
  overhead_ = static_cast<std::size_t>(static_cast<std::int64_t>(overhead_) + k.overhead_delta);
  live_blocks_ = static_cast<std::size_t>(static_cast<std::int64_t>(live_blocks_) + k.blocks_delta);
  peak_live_ = std::max(peak_live_, tc->peak_live_pub.load(std::memory_order_relaxed));
  ev_.folded_hits += k.hits;
  ev_.folded_frees += k.frees;
  tc->begin();
  tc->live_delta.store(0, std::memory_order_relaxed);
  tc->overhead_delta.store(0, std::memory_order_relaxed);
  tc->blocks_delta.store(0, std::memory_order_relaxed);
  tc->hits.store(0, std::memory_order_relaxed);
  tc->frees.store(0, std::memory_order_relaxed);
  tc->end();
}

void ArenaPool::on_thread_exit(ThreadCache* tc) {
  std::lock_guard<detail::SpinMutex> g(mu_);
  if (closed()) return;
  flush_cache_locked(tc);
  fold_cache_locked(tc);
  std::erase_if(caches_, [tc](const std::unique_ptr<ThreadCache>& p) { return p.get() == tc; });
  ncaches_.store(caches_.size(), std::memory_order_relaxed);
  // A lone cache never takes from the transfer cache (it is a bridge between caches): what is
  // there would be stranded until the next reclaim.
  if (caches_.size() < 2) flush_transfer_locked();
}

void ArenaPool::flush_thread_cache() {
  std::lock_guard<detail::SpinMutex> g(mu_);
  if (ThreadCache* tc = cache_enabled_ ? detail::tls_find_cache(id_) : nullptr) flush_cache_locked(tc);
}

}  // namespace poolkeeper
