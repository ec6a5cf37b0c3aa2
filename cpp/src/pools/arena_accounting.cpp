// ArenaPool accounting: stats (exact at one observation point, thread caches included),
// validate() (every invariant in arena_pool.hpp), snapshots, and the figures an OOM reports.
#include <algorithm>

#include "thread_cache_lookup.hpp"
#include "poolkeeper/pools/arena_pool.hpp"

namespace poolkeeper {

using detail::ArenaBacking;
using detail::ArenaChunk;
using detail::ThreadCache;

void ArenaPool::note_peak_locked() {
  // Exact live bytes need every cache's delta, so every cache is read here, at each locked
  // allocation. Between locked calls only the fast path of a pool with a single cache
  // (ncaches_ == 1) keeps a peak estimate of its own (peak_live_pub, folded in by stats_locked);
  // with several caches a peak reached on the fast paths alone is seen at the next locked call.
  std::int64_t live = static_cast<std::int64_t>(live_.load(std::memory_order_relaxed));
  for (auto& tc : caches_) live += tc->read().live_delta;
  if (live > static_cast<std::int64_t>(peak_live_)) peak_live_ = static_cast<std::size_t>(live);
}

PoolStats ArenaPool::stats_locked() {
  drain_remote_locked();  // remote frees are counted live until filed: file them first
  PoolStats st;
  std::int64_t live = static_cast<std::int64_t>(live_.load(std::memory_order_relaxed));
  std::int64_t overhead = static_cast<std::int64_t>(overhead_), blocks = static_cast<std::int64_t>(live_blocks_);
  std::int64_t cached_free = 0, cached_pending = 0;
  std::uint64_t hits = ev_.folded_hits, fast_frees = ev_.folded_frees;
  std::size_t peak_live = peak_live_;
  // No bin moves between a cache and the transfer cache while both are read (transfer_cache.hpp).
  std::unique_lock<detail::SpinMutex> xg(xfer_.mu);
  const std::size_t transferred = xfer_.bytes;
  const std::uint64_t handed = xfer_.handed, taken = xfer_.taken, evicted = xfer_.evicted;
  for (auto& tc : caches_) {
    const auto k = tc->read();
    live += k.live_delta;
    overhead += k.overhead_delta;
    blocks += k.blocks_delta;
    cached_free += k.cached_free;
    cached_pending += k.cached_pending;
    hits += k.hits;
    fast_frees += k.frees;
    peak_live = std::max(peak_live, tc->peak_live_pub.load(std::memory_order_relaxed));
  }
  xg.unlock();
  cached_free += static_cast<std::int64_t>(transferred);
  st.reserved = budget_.reserved;
  st.live = static_cast<std::size_t>(live);
  st.overhead = static_cast<std::size_t>(overhead);
  st.thread_cached = static_cast<std::size_t>(cached_free);
  st.thread_cached_pending = static_cast<std::size_t>(cached_pending);
  st.free = index_.bytes() + st.thread_cached;
  st.pending = order_.pending_bytes() + st.thread_cached_pending;
  st.largest_free = index_.largest();
  st.peak_reserved = budget_.peak_reserved;
  st.peak_live = std::max(peak_live, st.live);
  st.live_blocks = static_cast<std::size_t>(blocks);
  st.free_chunks = index_.count();
  st.pending_blocks = order_.pending_blocks();
  st.backings = backings_.size();
  st.limit = opt_.limit;
  st.pending_by_stream = order_.by_stream();
  std::size_t oversize = 0;
  for (ArenaBacking* b : backings_) oversize += b->oversize;
  fill_upstream_counts(st);
  add_extras(st, {{"oversize_backings", oversize}, {"backings_created", ev_.backings_created},
                  {"oversize_backings_created", ev_.oversize_backings_created}, {"backings_released", ev_.backings_released},
                  {"coalesce_passes", ev_.coalesce_passes}, {"merges", ev_.merges}, {"shrink_scans", ev_.shrink_scans},
                  {"pressure_passes", ev_.pressure_passes}, {"thread_cache_hits", hits}, {"thread_cache_frees", fast_frees},
                  {"thread_caches", caches_.size()}, {"cache_flushes", ev_.cache_flushes},
                  {"cache_refills", ev_.cache_refills}, {"cache_spills", ev_.cache_spills}, {"transfer_cached", transferred},
                  {"transfer_handovers", handed}, {"transfer_takes", taken}, {"transfer_evictions", evicted},
                  {"remote_frees", ev_.remote_frees}, {"stream_runs", ev_.stream_runs}, {"shard_fallbacks", ev_.shard_fallbacks},
                  {"caches_reclaimed", ev_.caches_reclaimed}, {"slow_allocations", ev_.slow_allocs},
                  {"slow_deallocations", ev_.slow_frees}, {"nowait_allocations", ev_.nowait_allocs},
                  {"nowait_deallocations", ev_.nowait_frees},
                  {"single_stream", single_active_.load(std::memory_order_relaxed) ? 1 : 0},
                  {"home_frees", ev_.home_frees}, {"home_barriers", ev_.home_barriers},
                  {"home_settles", ev_.home_settles}});
  StreamOrderCounters so;
  so.add(order_);
  so.report(st);
  add_extras(st, {{"upstream_free_failures", ev_.upstream_free_failures + refused_after_close()},
                  {"oom_retries", ev_.oom_retries},
                  {"tree_chunks", index_.tree_size()}, {"table_capacity", table_.capacity()},
                  {"table_grows", table_.grows()}, {"chunk_nodes", chunk_nodes_.live()}});
  source_->stats(st);
  return st;
}

void ArenaPool::reset_peaks() {
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i)) sh->reset_peaks();
  std::lock_guard<detail::SpinMutex> g(mu_);
  std::int64_t live = static_cast<std::int64_t>(live_.load(std::memory_order_relaxed));
  for (auto& tc : caches_) {
    live += tc->read().live_delta;
    // The owner compares its estimate against the published peak, so zeroing it restarts the
    // owner's tracking too (no owner-private copy survives the reset).
    tc->peak_live_pub.store(0, std::memory_order_relaxed);
  }
  peak_live_ = static_cast<std::size_t>(std::max<std::int64_t>(live, 0));
  budget_.reset_peak();
}

namespace {
// Adds one shard's books to another's. Each shard balances on its own, so the sum does too; the
// peaks add up to an upper bound of the pool's (the shards peak at different moments).
void add_shard_stats(PoolStats& to, const PoolStats& from) {
  for (std::size_t PoolStats::*m : {&PoolStats::reserved, &PoolStats::live, &PoolStats::free, &PoolStats::pending,
                                     &PoolStats::overhead, &PoolStats::thread_cached, &PoolStats::thread_cached_pending,
                                     &PoolStats::peak_reserved, &PoolStats::peak_live, &PoolStats::live_blocks,
                                     &PoolStats::free_chunks, &PoolStats::pending_blocks, &PoolStats::backings})
    to.*m += from.*m;
  to.largest_free = std::max(to.largest_free, from.largest_free);
  for (auto& [st, b] : from.pending_by_stream) {
    auto it = std::find_if(to.pending_by_stream.begin(), to.pending_by_stream.end(),
                           [st = st](const auto& e) { return e.first == st; });
    if (it == to.pending_by_stream.end()) to.pending_by_stream.emplace_back(st, b);
    else it->second += b;
  }
  for (auto& [k, v] : from.extra) {
    auto it = std::find_if(to.extra.begin(), to.extra.end(), [&k = k](const auto& e) { return e.first == k; });
    if (it == to.extra.end()) to.extra.emplace_back(k, v);
    else it->second += v;
  }
}
}  // namespace

PoolStats ArenaPool::stats() {
  PoolStats st;
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    st = stats_locked();
  }
  if (nshards_ > 1) {
    for (std::size_t i = 1; i < nshards_; ++i)
      if (ArenaPool* sh = existing_shard(i)) add_shard_stats(st, sh->stats());
  }
  if (!shard_child_) st.extra.emplace_back("shards", shards_in_use());  // 1 with a limit or without a cache
  return st;
}

OomFigures ArenaPool::figures_locked(std::size_t requested) { return oom_figures(stats_locked(), requested); }

void ArenaPool::validate() {
  // Every shard's books must balance on their own (the pool's totals are their sums).
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i)) sh->validate();
  std::lock_guard<detail::SpinMutex> g(mu_);
  drain_remote_locked();
  auto fail = [&](const std::string& m) { throw InvariantViolation("ArenaPool #" + std::to_string(id_) + ": " + m); };
  // Single-stream mode: home releases are filed free only while it lasts, and only with a home.
  if (home_dirty_ && (!single_active_.load() || home_.load() == kNoStream))
    fail("home releases unsettled outside single-stream mode");
  if (single_active_.load() && nshards_ != 1) fail("single-stream mode with several shards");
  if (home_fence_set_ && !home_dirty_) fail("a shrink scan's settle event kept with nothing unsettled");
  if (fence_passed_) fail("a shrink scan's settle point left set outside the scan");
  std::size_t reserved = 0, live = 0, overhead = 0, free_b = 0, pending = 0, cached = 0, nlive = 0, ncached = 0;
  std::uintptr_t prev_end = 0;
  std::size_t dirty = 0;
  bool resident_seen = false;
  for (ArenaBacking* b : backings_) {
    if (b->addr < prev_end) fail("backings overlap or are out of address order");
    prev_end = b->addr + b->size;
    reserved += b->size;
    dirty += b->dirty;
    if (b->resident) {
      if (resident_seen || b->oversize) fail("more than one resident backing, or an oversize one");
      resident_seen = true;
    }
    std::uintptr_t at = b->addr;
    const ArenaChunk* prev = nullptr;
    for (ArenaChunk* c = b->first; c; c = c->next_addr) {
      if (c->addr != at) fail("chunks do not tile backing " + format_ptr(b->addr) + " at " + format_ptr(at));
      if (c->prev_addr != prev || c->backing != b) fail("broken chunk links in backing " + format_ptr(b->addr));
      if (c->size == 0 || c->size % opt_.alignment || c->addr % opt_.alignment) fail("misaligned chunk " + format_ptr(c->addr));
      at += c->size;
      ArenaChunk* found = nullptr;
      const bool in_table = table_.find(c->addr, found) && found == c;
      switch (c->st()) {
        case ChunkState::Live:
        case ChunkState::Remote:  // pushed by another thread since the drain above: the books count it live
          if (!in_table) fail("live chunk " + format_ptr(c->addr) + " missing from the pointer table");
          if (c->requested == 0 || c->requested > c->size) fail("live chunk requested size out of range");
          live += c->requested;
          overhead += c->size - c->requested;
          ++nlive;
          break;
        case ChunkState::ThreadCached:
          if (!in_table) fail("thread-cached chunk missing from the pointer table");
          cached += c->size;
          ++ncached;
          break;
        case ChunkState::Free:
          if (in_table || c->where == ArenaChunk::kNowhere) fail("free chunk " + format_ptr(c->addr) + " not indexed (or in the table)");
          if (!b->dirty && prev && prev->st() == ChunkState::Free)
            fail("adjacent free chunks at " + format_ptr(prev->addr) + " after a coalesce pass");
          free_b += c->size;
          break;
        case ChunkState::Pending:
          if (in_table) fail("pending chunk still in the pointer table");
          pending += c->size;
          break;
        case ChunkState::Freeing:  // only inside the free or carve that holds the lock we hold now
          fail("chunk " + format_ptr(c->addr) + " left claimed (freeing) outside the lock hold that claimed it");
      }
      prev = c;
    }
    if (b->last != prev) fail("backing " + format_ptr(b->addr) + " does not know its last chunk");
    if (at != b->addr + b->size) fail("chunks cover " + std::to_string(at - b->addr) + " of " + std::to_string(b->size) + " bytes in backing " + format_ptr(b->addr));
  }
  if (dirty != dirty_backings_) fail("dirty-backing count is off");
  source_->validate(fail);
  index_.check(fail);
  order_.validate();
  if (free_b != index_.bytes()) fail("free index bytes disagree with the free chunks");
  if (pending != order_.pending_bytes()) fail("pending bytes disagree with the stream-order lanes");
  if (table_.size() != nlive + ncached || !table_.consistent()) fail("pointer table does not match live + cached chunks");
  std::size_t cache_bins_bytes = 0;
  std::int64_t cached_counted = 0;
  for (auto& tc : caches_) {
    std::size_t own = 0;
    for (auto& bin : tc->bins) {
      if (bin.count > ThreadCache::kPerBin) fail("thread-cache bin overflow");
      for (std::uint32_t i = 0; i < bin.count; ++i) {
        ArenaChunk* c = bin.items[i];
        if (c->st() != ChunkState::ThreadCached || c->size != bin.size || c->cache_tag != bin.stream)
          fail("thread-cache bin holds a chunk that is not cached there");
        own += c->size;
      }
    }
    if (own != tc->bytes) fail("thread cache byte count is off");
    const auto k = tc->read();
    cached_counted += k.cached_free + k.cached_pending;
    cache_bins_bytes += own;
  }
  {
    std::lock_guard<detail::SpinMutex> xg(xfer_.mu);
    std::size_t own = 0;
    for (const auto& slot : xfer_.slots) {
      if (slot.count > detail::TransferCache::kPerSlot) fail("transfer-cache slot overflow");
      for (std::uint32_t i = 0; i < slot.count; ++i) {
        const ArenaChunk* c = slot.items[i];
        if (c->st() != ChunkState::ThreadCached || c->size != slot.size || c->cache_tag != kNoStream)
          fail("transfer-cache slot holds a chunk that is not cached there");
        own += c->size;
      }
    }
    if (own != xfer_.bytes) fail("transfer cache byte count is off");
    if (xfer_.bytes > detail::TransferCache::kBudgets * opt_.thread_cache_bytes) fail("transfer cache holds more than its budget");
    if (own && caches_.size() < 2) fail("transfer cache holds blocks with fewer than two thread caches left");
    cached_counted += static_cast<std::int64_t>(own);
    cache_bins_bytes += own;
  }
  if (cache_bins_bytes != cached || cached_counted != static_cast<std::int64_t>(cached))
    fail("thread-cached bytes disagree with the caches");
  if (reserved != budget_.reserved) fail("reserved " + std::to_string(budget_.reserved) + " but backings add to " + std::to_string(reserved));
  const PoolStats st = stats_locked();
  if (st.live != live || st.overhead != overhead || st.live_blocks != nlive)
    fail("live/overhead totals (" + std::to_string(st.live) + "/" + std::to_string(st.overhead) + ") disagree with the chunks (" +
         std::to_string(live) + "/" + std::to_string(overhead) + ")");
  if (st.reserved != st.live + st.free + st.pending + st.overhead)
    fail("reserved " + std::to_string(st.reserved) + " != live " + std::to_string(st.live) + " + free " +
         std::to_string(st.free) + " + pending " + std::to_string(st.pending) + " + overhead " + std::to_string(st.overhead));
}

Snapshot ArenaPool::snapshot() {
  Snapshot snap;
  if (nshards_ > 1) {
    // The inner shards' backings join shard 0's, by address; the stats are the pool's.
    {
      std::lock_guard<detail::SpinMutex> g(mu_);
      snap = snapshot_locked();
    }
    for (std::size_t i = 1; i < nshards_; ++i) {
      ArenaPool* sh = existing_shard(i);
      if (!sh) continue;
      Snapshot inner = sh->snapshot();
      for (auto& b : inner.backings) snap.backings.push_back(std::move(b));
    }
    sort_backings(snap);
    snap.stats = stats();
    return snap;
  }
  std::lock_guard<detail::SpinMutex> g(mu_);
  return snapshot_locked();
}

Snapshot ArenaPool::snapshot_locked() {
  Snapshot snap = snapshot_head(stats_locked());
  for (ArenaBacking* b : backings_) {
    BackingInfo bi;
    bi.address = b->addr;
    bi.size = b->size;
    bi.resident = b->resident;
    bi.oversize = b->oversize;
    for (ArenaChunk* c = b->first; c; c = c->next_addr) {
      ChunkInfo ci;
      ci.offset = c->addr - b->addr;
      ci.size = c->size;
      ci.state = c->st();
      ci.requested = c->requested;
      ci.alloc_stream = c->alloc_stream;
      ci.last_stream = c->last_stream;
      if (ci.state == ChunkState::Pending) {
        order_.describe(c, ci.waits_on, ci.event);
      } else if (ci.state == ChunkState::ThreadCached && c->cache_tag != kNoStream) {
        // Cached for reuse on its own stream only: for every other stream it is pending.
        ci.state = ChunkState::Pending;
        ci.waits_on.push_back(c->cache_tag);
      }
      bi.chunks.push_back(std::move(ci));
    }
    snap.backings.push_back(std::move(bi));
  }
  return snap;
}

}  // namespace poolkeeper
