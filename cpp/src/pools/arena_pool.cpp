// ArenaPool: the locked paths (allocate/deallocate misses, growth, coalescing, shrink, close).
// The lock-free thread-cache paths are in arena_thread_cache.cpp; accounting, validate() and
// snapshots in arena_accounting.cpp.
#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/detail/test_seam.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <thread>

#include "poolkeeper/detail/test_seam.hpp"
#include "thread_cache_lookup.hpp"

namespace poolkeeper {

using detail::ArenaBacking;
using detail::ArenaChunk;
using detail::ThreadCache;

using detail::wholly_free;

ArenaPool::ArenaPool(std::shared_ptr<Upstream> upstream, ArenaOptions opt)
    : Pool(std::move(upstream)), opt_(opt), index_(opt.alignment), order_(upstream_.get()) {
  if (!is_pow2(opt_.alignment))
    throw InvalidArgument("alignment must be a power of two; got " + std::to_string(opt_.alignment));
  if (opt_.initial_backing == 0 || opt_.max_backing == 0)
    throw InvalidArgument("initial_backing and max_backing must be positive");
  if (opt_.initial_backing > opt_.max_backing)
    throw InvalidArgument("initial_backing (" + std::to_string(opt_.initial_backing) + ") exceeds max_backing (" +
                          std::to_string(opt_.max_backing) + ")");
  if (!(opt_.growth_factor >= 1.0) || opt_.growth_factor > 64.0)
    throw InvalidArgument("growth_factor must be in [1, 64]");
  if (opt_.shrink_hysteresis == 0) throw InvalidArgument("shrink_hysteresis must be >= 1 scan");
  opt_.initial_backing = align_up(opt_.initial_backing, opt_.alignment);
  opt_.max_backing = align_up(opt_.max_backing, opt_.alignment);
  if (opt_.oversize_threshold == 0 || opt_.oversize_threshold > opt_.max_backing) opt_.oversize_threshold = opt_.max_backing;
  cache_enabled_ = opt_.thread_cache_bytes > 0 && opt_.thread_cache_max_block > 0;
  budget_.limit = opt_.limit;
  if (opt_.shards > 64) throw InvalidArgument("shards must be at most 64; got " + std::to_string(opt_.shards));
  // Homes live in the thread caches, and a limit is one budget kept by one set of books.
  nshards_ = opt_.shards ? opt_.shards : std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 16);
  if (!cache_enabled_ || opt_.limit || opt_.single_stream) nshards_ = 1;
  single_active_.store(opt_.single_stream, std::memory_order_relaxed);
  if (nshards_ > 1) {
    shards_ = std::make_unique<std::atomic<ArenaPool*>[]>(nshards_ - 1);
    for (std::size_t i = 0; i + 1 < nshards_; ++i) shards_[i].store(nullptr, std::memory_order_relaxed);
  }
  source_ = opt_.expandable ? detail::make_virtual_range(*this) : detail::make_separate_backings(*this);
  join_directory();  // last: the pool is whole now
}

ArenaPool::ArenaPool(std::shared_ptr<Upstream> upstream, ArenaOptions opt, ShardTag, std::uint64_t parent_id)
    : Pool(std::move(upstream)), opt_(opt), index_(opt.alignment), order_(upstream_.get()) {
  id_ = parent_id;  // errors and messages name the pool the caller knows
  shard_child_ = true;
  opt_.thread_cache_bytes = 0;
  opt_.limit = 0;
  opt_.shards = 1;
  cache_enabled_ = false;
  source_ = opt_.expandable ? detail::make_virtual_range(*this) : detail::make_separate_backings(*this);
}

ArenaPool::~ArenaPool() {
  unregister();  // first: no exiting thread may fold its cache into us any more
  if (forked()) {
    // Inner shards' locks may have been held at the fork too: leave them alone (leaked).
    for (std::size_t i = 1; i < nshards_; ++i) shards_[i - 1].store(nullptr, std::memory_order_relaxed);
    return;  // its lock may have been held at the fork
  }
  try {
    close();
    for (std::size_t i = 1; i < nshards_; ++i) delete existing_shard(i);
    return;
  } catch (...) {
  }
  // Each inner shard gives back what holds nothing live, like this one below.
  for (std::size_t i = 1; i < nshards_; ++i) delete existing_shard(i);
  // Live blocks remain: their backings stay with the user (never freed under them); return the
  // backings that hold nothing live.
  Detached out;
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    try {
      reclaim_caches_locked();
      drain_locked(true);
      coalesce_locked();
      if (home_barrier_locked()) source_->release_unused(out);  // else: nothing goes back (in use)
    } catch (...) {
    }
    drop_home_fence_locked();
  }
  for (auto& [p, n] : out) {
    try {
      upstream_->deallocate(p, n);
    } catch (...) {
    }
  }
  for (ArenaBacking* b : backings_) delete b;
}

// ---------------------------------------------------------------- chunk bookkeeping

void ArenaPool::file_free_locked(ArenaChunk* c) {
  c->set(ChunkState::Free);
  c->drop_used_on();
  c->requested = 0;
  index_.insert(c);
  ArenaBacking* b = c->backing;
  if (!b->dirty && ((c->prev_addr && c->prev_addr->st() == ChunkState::Free) ||
                    (c->next_addr && c->next_addr->st() == ChunkState::Free))) {
    b->dirty = true;
    ++dirty_backings_;
  }
}

void* ArenaPool::make_live_locked(ArenaChunk* c, std::size_t nbytes, Stream s) {
  c->requested = nbytes;
  c->alloc_stream = c->last_stream = s;
  c->set(ChunkState::Live);
  c->used_epoch = scan_epoch_;
  table_.insert(c->addr, c);
  live_.store(live_.load(std::memory_order_relaxed) + nbytes, std::memory_order_relaxed);
  overhead_ += c->size - nbytes;
  ++live_blocks_;
  note_peak_locked();
  return reinterpret_cast<void*>(c->addr);
}

// Cut c down to `rounded` bytes; the rest becomes a new chunk right after it (not yet filed).
ArenaChunk* ArenaPool::split_locked(ArenaChunk* c, std::size_t rounded) {
  ArenaChunk* rest = chunk_nodes_.create();
  rest->addr = c->addr + rounded;
  rest->size = c->size - rounded;
  rest->backing = c->backing;
  rest->used_epoch = c->used_epoch;
  rest->prev_addr = c;
  rest->next_addr = c->next_addr;
  if (c->next_addr) c->next_addr->prev_addr = rest;
  else c->backing->last = rest;
  c->next_addr = rest;
  c->size = rounded;
  return rest;
}

void* ArenaPool::carve_locked(ArenaChunk* c, std::size_t rounded, std::size_t nbytes, Stream s) {
  if (c->size > rounded) {
    // Not Free before filing the remainder (c is not a merge partner), and not Live either: a
    // lock-free free holding a stale find of this record could claim a Live mark here, and the
    // hand-out below would overwrite its claim (the block live and in that thread's cache at once).
    c->set(ChunkState::Freeing);
    POOLKEEPER_SEAM(ArenaCarveMarked);
    file_free_locked(split_locked(c, rounded));
  }
  return make_live_locked(c, nbytes, s);
}

// A pending chunk released on s, taken for a request on s: carve the request, and put the rest
// back in s's lane at the block's own place in release order.
void* ArenaPool::carve_pending_locked(ArenaChunk* c, std::size_t rounded, std::size_t nbytes, Stream s) {
  if (c->size > rounded) {
    ArenaChunk* rest = split_locked(c, rounded);
    rest->alloc_stream = kNoStream;  // no other user to wait for: only s's release
    order_.defer_as(rest, s, c->pend_seq);  // keeps the block's place in release order
    note_pending_locked(rest);
  }
  c->drop_used_on();
  return make_live_locked(c, nbytes, s);
}

bool ArenaPool::stream_room_locked(const ArenaChunk* c, Stream s) const {
  return c->st() == ChunkState::Free ||
         (s != kNoStream && c->st() == ChunkState::Pending && order_.lane_stream(c) == s);
}

// A stream may use what it released itself at once (its next work is ordered after the work that
// released it), so for a request on s a free chunk and a chunk pending on s are the same kind of
// room, and neighbours of either kind are one run. Nothing merges them eagerly: a free chunk
// merged into a pending one would wait for s's fence before any other stream could use it. Used
// after an expandable growth that extended such a run (BackingSource::grow): the run becomes one
// chunk pending on s, at the latest release position of its pending parts (so the rest still
// waits for exactly what each part waited for). Tried before every growth as well, it cost the
// arena memory on the lagging Llama replay (benchmarks/stream_lag_replay.py) and gained nothing
// elsewhere: not done.
ArenaChunk* ArenaPool::take_stream_run_locked(ArenaBacking* grown, Stream s, std::size_t rounded) {
  if (s == kNoStream) return nullptr;  // no run without a stream (stream_room_locked)
  ArenaChunk* best = nullptr;
  std::size_t best_size = SIZE_MAX;
  // The run the growth joined lies in the backing it grew.
  for (ArenaChunk* c = grown->first; c;) {
    if (!stream_room_locked(c, s)) {
      c = c->next_addr;
      continue;
    }
    ArenaChunk* start = c;
    std::size_t run = 0;
    bool pending = false;
    for (; c && stream_room_locked(c, s); c = c->next_addr) {
      run += c->size;
      pending |= c->st() == ChunkState::Pending;
    }
    // A run of free chunks alone was offered by the free index already (merged by the pressure
    // pass); one pending chunk alone by take_for_stream_fit.
    if (pending && run >= rounded && run < best_size) best = start, best_size = run;
  }
  if (!best) return nullptr;
  std::uint64_t seq = 0;
  std::uint32_t lane = 0;
  std::size_t taken = 0;
  for (ArenaChunk* c = best; taken < best_size; c = c->next_addr) {
    taken += c->size;
    if (c->st() == ChunkState::Free) {
      index_.remove(c);
    } else {
      seq = std::max(seq, c->pend_seq);
      lane = c->lane;  // s's lane: every pending part is in it
      order_.remove(c);
    }
  }
  while (best->size < best_size) {
    best->size += best->next_addr->size;
    swallow_next_locked(best);
  }
  if (!best->next_addr) best->backing->last = best;
  // Pending on s like its parts (a free first part's lane field means nothing: neighbours'
  // same_lane_pending checks read it).
  best->set(ChunkState::Pending);
  best->lane = lane;
  best->pend_seq = seq;
  best->alloc_stream = kNoStream;
  ++ev_.stream_runs;
  return best;
}

void ArenaPool::coalesce_locked() {
  if (!dirty_backings_) return;
  ++ev_.coalesce_passes;
  for (ArenaBacking* b : backings_) {
    if (!b->dirty) continue;
    for (ArenaChunk* c = b->first; c; c = c->next_addr) {
      if (c->st() == ChunkState::Free && c->next_addr && c->next_addr->st() == ChunkState::Free) {
        index_.remove(c);
        while (c->next_addr && c->next_addr->st() == ChunkState::Free) {
          index_.remove(c->next_addr);
          c->size += c->next_addr->size;
          swallow_next_locked(c);
        }
        if (!c->next_addr) b->last = c;
        index_.insert(c);
      } else if (same_lane_pending(c, c->next_addr)) {
        // Neighbours released on the same stream merge too: that stream can carve the run at once
        // (a lagging device would otherwise leave it only fragments, and the pool would grow).
        while (same_lane_pending(c, c->next_addr)) {
          order_.absorb(c, c->next_addr);  // c->size grows; c keeps the later release position
          swallow_next_locked(c);
        }
        if (!c->next_addr) b->last = c;
      }
    }
    b->dirty = false;
  }
  dirty_backings_ = 0;
}

// c's next neighbour, already out of the index or lane and counted in c->size, leaves the list.
void ArenaPool::join_next_locked(ArenaChunk* c) {
  ArenaChunk* n = c->next_addr;
  c->used_epoch = std::max(c->used_epoch, n->used_epoch);  // a shrink scan must see n's last hand-out
  c->next_addr = n->next_addr;
  if (n->next_addr) n->next_addr->prev_addr = c;
  chunk_nodes_.destroy(n);
}

void ArenaPool::swallow_next_locked(ArenaChunk* c) {
  join_next_locked(c);
  ++ev_.merges;
}

bool ArenaPool::same_lane_pending(const ArenaChunk* a, const ArenaChunk* b) const {
  if (!a || !b || a->st() != ChunkState::Pending || b->st() != ChunkState::Pending) return false;
  const Stream la = order_.lane_stream(a);
  return la != kNoStream && la == order_.lane_stream(b);
}

// A chunk just released on a stream: if a neighbour was released on the same stream, a merge is
// owed (the next coalesce pass joins them).
void ArenaPool::note_pending_locked(ArenaChunk* c) {
  ArenaBacking* b = c->backing;
  if (!b->dirty && (same_lane_pending(c, c->prev_addr) || same_lane_pending(c, c->next_addr))) {
    b->dirty = true;
    ++dirty_backings_;
  }
}

void ArenaPool::drain_locked(bool wait) {
  order_.drain([&](BlockRecord* r) { file_free_locked(static_cast<ArenaChunk*>(r)); }, wait);
}

// Settle everything this thread can settle without waiting: own cache back, completed pending
// releases to free, merges owed.
void ArenaPool::settle_locked() {
  drain_remote_locked();
  if (cache_enabled_) {
    if (ThreadCache* tc = detail::tls_find_cache(id_); tc && tc->bytes) flush_cache_locked(tc);
    // Free memory no thread owns, up to two caches' budgets of sizes nobody may ask for again:
    // left out, a burst freed by one thread followed by other sizes grew the pool by all of it.
    flush_transfer_locked();
  }
  if (order_.pending_blocks()) drain_locked(false);
  coalesce_locked();
}

// ---------------------------------------------------------------- backings

ArenaBacking* ArenaPool::adopt_locked(std::uintptr_t addr, std::size_t size, bool oversize, bool resident) {
  auto* b = new ArenaBacking();
  b->addr = addr;
  b->size = size;
  b->oversize = oversize;
  b->resident = resident;
  ArenaChunk* c = chunk_nodes_.create();
  c->addr = addr;
  c->size = size;
  c->backing = b;
  b->first = b->last = c;
  backings_.insert(std::upper_bound(backings_.begin(), backings_.end(), b,
                                    [](const ArenaBacking* x, const ArenaBacking* y) { return x->addr < y->addr; }),
                   b);
  budget_.grow(size);
    return b;
}

void ArenaPool::release_backing_locked(ArenaBacking* b, Detached& out) {
  // Every chunk is free (not necessarily merged: a shrink scan does not coalesce, so it never
  // destroys the exact-size chunks a steady workload is reusing).
  for (ArenaChunk* c = b->first; c;) {
    ArenaChunk* n = c->next_addr;
    index_.remove(c);
    chunk_nodes_.destroy(c);
    c = n;
  }
  backings_.erase(std::find(backings_.begin(), backings_.end(), b));
  if (b->dirty) --dirty_backings_;
  ++ev_.backings_released;
  budget_.start_release(b->size);  // still counts against the limit until the upstream takes it back
  out.emplace_back(reinterpret_cast<void*>(b->addr), b->size);
  delete b;
}

// Release wholly free, non-resident backings: all of them (trim) or those wholly free for
// shrink_hysteresis consecutive scans (automatic shrink). Returns bytes detached.
std::size_t ArenaPool::release_free_backings_locked(Detached& out, bool hysteresis, bool* counted) {
  if (counted) *counted = false;
  // Never during a graph capture scope: a free or unmap may synchronize the device, which would
  // invalidate the capture (capture.hpp). The scan simply finds nothing to release.
  if (upstream_->captures_underway() > 0) return 0;
  // Single-stream mode: memory filed free at a home release may still be in use by the device.
  // Trim waits for the home stream first. Automatic scans never wait: they still count free scans
  // (a skipped count would let the next scan take memory freed after its predecessor for memory
  // free since then), and release only what scan_may_release() allows.
  if (home_dirty_ && !hysteresis && !home_barrier_locked()) return 0;
  if (counted) *counted = true;
  return source_->release_free(out, hysteresis);
}

void ArenaPool::free_detached(Detached& d) {
  // Outside the lock: freeing device memory synchronizes the device. A free the upstream refuses
  // is re-adopted as a wholly free backing (retried at the next trim or scan) and counted, so the
  // books never lose the bytes.
  for (auto& [p, n] : d) {
    try {
      upstream_free(p, n);
      std::lock_guard<detail::SpinMutex> g(mu_);
      budget_.end_release(n);
    } catch (...) {
      std::lock_guard<detail::SpinMutex> g(mu_);
      budget_.end_release(n);
      ++ev_.upstream_free_failures;
      --ev_.backings_released;  // it was not released after all
      file_free_locked(source_->readopt(p, n));
    }
  }
  d.clear();
}

void ArenaPool::tick_locked(Detached& out) {
  if (!opt_.shrink_interval || ++ops_since_scan_ < opt_.shrink_interval) return;
  ops_since_scan_ = 0;
  scan_locked(out);
}

std::size_t ArenaPool::scan_locked(Detached& out) {
  ++ev_.shrink_scans;
  fence_passed_ = home_dirty_ && poll_home_fence_locked();
  std::size_t bytes = 0;
  bool counted = false;
  try {
    bytes = release_free_backings_locked(out, true, &counted);
  } catch (...) {
    fence_passed_ = false;
    throw;
  }
  fence_passed_ = false;
  // A scan that counted nothing (a capture scope was open) is no scan: it records no settle point
  // and keeps the epoch. (Asking the scope again here would let one that closed in between advance
  // the epoch over uncounted memory, and the next scan give back a block handed out before this
  // one as if it had stayed free.)
  if (!counted) return bytes;
  if (home_dirty_) fence_home_locked();
  ++scan_epoch_;  // chunks handed out from now on were used since this scan
  return bytes;
}

bool ArenaPool::poll_home_fence_locked() {
  if (!home_fence_set_ || upstream_->captures_underway() > 0) return false;
  bool done = false;
  try {
    done = upstream_->query_event(home_fence_);
  } catch (const UpstreamFailure&) {
    return false;  // unknown: treated as not yet (trim and synchronize still wait for home)
  }
  if (done && ev_.home_frees == fence_home_frees_) {
    // Home has run past every release filed free so far: settled, as after a barrier.
    drop_home_fence_locked();
    home_dirty_ = false;
    ++ev_.home_settles;
  }
  return done;
}

void ArenaPool::fence_home_locked() {
  drop_home_fence_locked();
  if (upstream_->captures_underway() > 0) return;
  try {
    home_fence_ = upstream_->record_event(home_.load(std::memory_order_relaxed));
  } catch (const UpstreamFailure&) {
    return;  // a destroyed home stream: no settle point; trim and synchronize still wait
  }
  home_fence_set_ = true;
  fence_home_frees_ = ev_.home_frees;
}

void ArenaPool::drop_home_fence_locked() {
  if (!home_fence_set_) return;
  home_fence_set_ = false;
  try {
    upstream_->release_event(home_fence_);
  } catch (...) {
  }
  home_fence_ = kNullEvent;
}

// ---------------------------------------------------------------- single-stream mode

bool ArenaPool::note_stream_locked(Stream s) {
  if (!single_active_.load(std::memory_order_relaxed)) return true;
  const Stream h = home_.load(std::memory_order_relaxed);
  if (h == s) return true;
  if (h == kNoStream) {
    // No home yet, so nothing was filed free at a home release: a request without a stream is
    // harmless, and the first stream becomes the home.
    if (s != kNoStream) home_.store(s, std::memory_order_release);
    return true;
  }
  return false;
}

bool ArenaPool::home_release_locked(const ArenaChunk* c, Stream s) const {
  if (!opt_.single_stream || !single_active_.load(std::memory_order_relaxed) || s == kNoStream || c->used_on)
    return false;
  if (c->alloc_stream != s) return false;  // allocated elsewhere (or without a stream): the usual rules
  // Inside a capture scope the capture's rules decide (a block freed during a capture stays with
  // what the capture may replay).
  return home_.load(std::memory_order_relaxed) == s && upstream_->captures_underway() == 0;
}

void ArenaPool::file_home_free_locked(ArenaChunk* c) {
  // The home stream's later work is ordered after this release, and no other stream can take
  // memory while the mode lasts: free at once, for best fit and merging.
  ++ev_.home_frees;
  file_free_locked(c);
  home_dirty_ = true;
}

bool ArenaPool::home_barrier_locked() {
  if (!home_dirty_) return true;
  const Stream h = home_.load(std::memory_order_relaxed);
  if (upstream_->captures_underway() > 0) {
    RelaxedCapture relaxed(*upstream_);
    if (upstream_->stream_capturing(h)) return false;
    try {
      order_.wait_for_stream(h);
    } catch (const UpstreamFailure&) {
      return false;  // a destroyed home stream: no device synchronize while a capture scope is open
    }
  } else {
    order_.wait_for_stream(h);
  }
  drop_home_fence_locked();
  home_dirty_ = false;
  ++ev_.home_barriers;
  return true;
}

void ArenaPool::end_single_locked() {
  if (home_barrier_locked()) {
    single_active_.store(false, std::memory_order_release);
    return;
  }
  // The home stream is being captured (or is gone while a capture scope is open), so nothing can
  // wait for it now. Everything free may hold a home release it has not run past: all of it
  // becomes pending on home (reusable there at once, elsewhere once the lane is fenced after the
  // capture). Thread caches first, while the mode still keeps other streams off their fast path:
  // blocks cached for any stream may come from such memory too.
  const Stream h = home_.load(std::memory_order_relaxed);
  reclaim_caches_locked();
  single_active_.store(false, std::memory_order_release);
  for (ArenaBacking* b : backings_)
    for (ArenaChunk* c = b->first; c; c = c->next_addr) {
      if (c->st() != ChunkState::Free) continue;
      index_.remove(c);
      c->alloc_stream = kNoStream;  // the release waits for home alone
      order_.defer(c, h);
      note_pending_locked(c);
    }
  drop_home_fence_locked();
  home_dirty_ = false;
}

// ---------------------------------------------------------------- shards

ArenaPool* ArenaPool::shard(std::size_t i) {
  if (ArenaPool* sh = existing_shard(i)) return sh;
  std::lock_guard<std::mutex> g(shard_mu_);  // never under a shard lock: making one may reserve a range
  if (ArenaPool* sh = existing_shard(i)) return sh;
  auto* sh = new ArenaPool(upstream_, opt_, ShardTag{}, id_);
  sh->shard_index_ = static_cast<std::uint32_t>(i);
  shards_[i - 1].store(sh, std::memory_order_release);
  inner_shards_.fetch_add(1, std::memory_order_release);
  return sh;
}

std::size_t ArenaPool::shards_in_use() const {
  std::size_t n = 1;
  for (std::size_t i = 1; i < nshards_; ++i) n += existing_shard(i) != nullptr;
  return n;
}

ArenaPool* ArenaPool::home_shard() {
  ThreadCache* tc = detail::tls_find_cache(id_);
  if (!tc) {  // first visit: the cache (and the home) is made under the lock, once
    detail::tls_prune();
    std::lock_guard<detail::SpinMutex> g(mu_);
    check_open();
    tc = cache_locked();
  }
  if (!tc || !tc->home) return nullptr;  // (no cache: after this thread's thread_locals)
  try {
    return shard(tc->home);
  } catch (const UpstreamFailure&) {
    // The shard could not be made (an expandable shard reserves a range of its own, and the
    // upstream's address space may hold only a few: Simulated's 1 TiB held three of 280 GiB).
    // This thread lives in shard 0 from now on: a request must not fail for want of a shard.
    std::lock_guard<detail::SpinMutex> g(mu_);
    tc->home = 0;
    ++ev_.shard_fallbacks;
    return nullptr;
  }
}

ArenaPool* ArenaPool::owner_shard(std::uintptr_t a) {
  ArenaChunk* c = nullptr;
  if (table_.find(a, c)) return nullptr;
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i); sh && sh->table_.find(a, c)) return sh;
  return nullptr;
}

// Home first (its lock, reuse only); then what another shard can give at once (its lock free,
// no growth): sharding must not grow the footprint while a fitting chunk sits elsewhere. Only
// then may home grow; if the upstream refuses, the other shards give back their wholly free
// backings and home tries once more.
void* ArenaPool::allocate_in_shard(ArenaPool* home, std::size_t nbytes, Stream s) {
  {
    std::lock_guard<detail::SpinMutex> g(home->mu_);
    home->check_open();
    if (void* r = home->reuse_locked(align_up(nbytes, opt_.alignment), nbytes, s)) {
      ++home->ev_.slow_allocs;
      return r;
    }
  }
  for (std::size_t i = 0; i < nshards_; ++i) {
    ArenaPool* sh = i ? existing_shard(i) : this;
    if (sh && sh != home)
      if (void* r = sh->try_reuse_nowait(nbytes, s)) return r;
  }
  try {
    return home->allocate(nbytes, s);
  } catch (const OutOfMemory&) {
    if (!trim_shards(home)) oom_of_pool(home, nbytes);
    home->ooms_.fetch_sub(1, std::memory_order_relaxed);  // recovered: not an error yet
  }
  try {
    return home->allocate(nbytes, s);
  } catch (const OutOfMemory&) {
    oom_of_pool(home, nbytes);
  }
}

// A shard's out-of-memory error, told with the whole pool's figures: the shard's own ("8 MiB
// reserved by this pool, 8 MiB live" while 72 MiB were live in the pool) misled (found by hostile
// probing). Called with no lock held, from the shard's catch block.
void ArenaPool::oom_of_pool(ArenaPool* home, std::size_t nbytes) {
  OomFigures f;
  try {
    throw;
  } catch (const OutOfMemory& e) {
    f = e.figures;
  }
  home->ooms_.fetch_sub(1, std::memory_order_relaxed);  // counted once, by the pool, below
  const std::string upstream_error = f.upstream_error;
  f = oom_figures(stats(), nbytes);
  f.upstream_error = upstream_error;
  throw_oom(std::move(f), align_up(nbytes, opt_.alignment), false, FreeFit::AnyPiece);
}

std::size_t ArenaPool::trim_shards(const ArenaPool* except) {
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < nshards_; ++i) {
    ArenaPool* sh = i ? existing_shard(i) : this;
    if (!sh || sh == except) continue;
    try {
      bytes += i ? sh->trim() : sh->trim_own();
    } catch (const PoolClosed&) {
    }
  }
  return bytes;
}

// ---------------------------------------------------------------- allocate / deallocate

void* ArenaPool::do_allocate(std::size_t nbytes, Stream s) {
  const std::size_t rounded = align_up(nbytes, opt_.alignment);
  if (nshards_ > 1 && rounded > opt_.thread_cache_max_block)
    if (ArenaPool* home = home_shard()) return allocate_in_shard(home, nbytes, s);
  Detached detached;
  struct FreeAfter {
    ArenaPool* self;
    Detached& d;
    ~FreeAfter() {
      if (!d.empty()) self->free_detached(d);
    }
  } free_after{this, detached};

  if (cache_enabled_ && !detail::tls_find_cache(id_)) detail::tls_prune();  // before the pool lock
  std::unique_lock<detail::SpinMutex> g(mu_);
  check_open();  // again under the lock: close() may have run since Pool::allocate looked
  if (!note_stream_locked(s)) end_single_locked();
  ++ev_.slow_allocs;
  if (cache_enabled_) cache_locked();
  // No shrink tick here: a scan inside an allocation could return the very backing that would
  // have served it (then grow again). Scans run on locked releases, when backings become free.

  if (void* r = reuse_locked(rounded, nbytes, s)) {
    refill_cache_locked(rounded);
    return r;
  }
  ++ev_.pressure_passes;
  settle_locked();  // drains completed releases and merges owed runs, pending ones included
  if (void* r = carve_best_locked(index_.take_best_fit(rounded), rounded, nbytes, s)) {
    refill_cache_locked(rounded);
    return r;
  }

  // Another thread's growth is in the upstream (with the lock let go) and its step could serve this
  // request too: wait for it to land and look again before growing beside it. Growing beside it
  // gave every thread that missed at once a backing of its own and ran the ramp up to max_backing
  // (8 threads: 68 MiB reserved for 6 MiB live), and with a limit the bytes claimed in flight
  // refused the second thread outright though the first one's backing would have served it (both
  // found by hostile probing).
  while (source_->wait_for_growth(g, rounded)) {
    check_open();
    if (void* r = reuse_locked(rounded, nbytes, s)) {
      refill_cache_locked(rounded);
      return r;
    }
  }

  // Grow; on failure recover what can be recovered (every thread's cache, completed releases,
  // wholly free backings) and try once more before explaining the failure.
  std::string upstream_error;
  // The last attempt's refusal by the limit. Checking the limit again afterwards for the rounded
  // request alone missed an expandable range's: it maps whole granules, so limit=4096 refused
  // every growth while a 256-byte request fit under it, and the OOM blamed the upstream.
  std::optional<LimitHit> limit_refusal;
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      ArenaChunk* grown = source_->grow(rounded, g, s);
      if (grown->size >= rounded) return carve_locked(grown, rounded, nbytes, s);
      // The growth joined a run of chunks pending on s (BackingSource::grow): merge and carve.
      ArenaBacking* backing = grown->backing;  // (grown itself may merge away below)
      file_free_locked(grown);
      coalesce_locked();
      if (ArenaChunk* f = index_.take_best_fit(rounded)) return carve_locked(f, rounded, nbytes, s);
      if (ArenaChunk* p = take_stream_run_locked(backing, s, rounded)) return carve_pending_locked(p, rounded, nbytes, s);
      throw InvariantViolation("ArenaPool #" + std::to_string(id_) + ": a growth of " + format_bytes(grown->size) +
                               " for a request of " + format_bytes(rounded) + " joined no run that holds it");
    } catch (const LimitHit& h) {
      limit_refusal = h;
    } catch (const UpstreamOutOfMemory& e) {
      limit_refusal.reset();
      upstream_error = e.what();
    }
    if (attempt == 1) break;
    ++ev_.oom_retries;
    // Other threads' caches are emptied now, not when their owners next run: an idle thread's
    // cache once held 1.88 MiB of a 2 MiB limit while this request failed as "fragmentation".
    if (reclaim_caches_locked()) {
      settle_locked();  // the reclaimed blocks merge with their free neighbours
      if (ArenaChunk* c = index_.take_best_fit(rounded)) return carve_locked(c, rounded, nbytes, s);
    }
    // What the source can give back that would let the retry succeed; never in a capture scope.
    if (upstream_->captures_underway() == 0 && home_barrier_locked()) source_->release_for_oom(detached);
    const bool others = shards_in_use() > 1;  // their wholly free backings, from the same upstream
    if (!detached.empty() || others) {
      g.unlock();
      free_detached(detached);
      if (others) trim_shards(this);
      g.lock();
    }
    if (ArenaChunk* c = index_.take_best_fit(rounded)) return carve_locked(c, rounded, nbytes, s);
  }
  OomFigures f = figures_locked(nbytes);
  f.upstream_error = upstream_error;
  if (limit_refusal && limit_refusal->need > rounded) {
    f.refused_growth = limit_refusal->need;
    f.growth_unit = limit_refusal->unit;
  }
  const bool limit_hit = limit_refusal || !budget_.grant(rounded, rounded, opt_.alignment);
  g.unlock();
  throw_oom(std::move(f), rounded, limit_hit, FreeFit::AnyPiece);
}

// The reuse steps of an allocation, none of which waits or calls the upstream: a block this
// stream released, the best indexed fit (after owed merges when it would split), a pending block
// of this stream to split. nullptr: only settling, growth or recovery can serve the request.
void* ArenaPool::reuse_locked(std::size_t rounded, std::size_t nbytes, Stream s) {
  drain_remote_locked();
  if (s != kNoStream)
    if (auto* c = static_cast<ArenaChunk*>(order_.take_for_stream(s, rounded))) return make_live_locked(c, nbytes, s);
  ArenaChunk* c = index_.take_best_fit(rounded);
  // Not with several thread caches: there exact-size chunks are what the caches trade (a merge
  // pass before every split destroyed the chunks one thread had just given back for the next,
  // 16,564 passes in 0.4 s under 2 threads of cross-thread frees on the H200); the pressure pass
  // still merges before any growth.
  if (c && dirty_backings_ && c->size > rounded && ncaches_.load(std::memory_order_relaxed) < 2) {
    // The best indexed fit would split a chunk while merges are owed: a merged hole may fit
    // exactly. Without this a large free tail keeps absorbing requests while freed neighbours
    // never merge, and the address range spreads (measured on the bench's random-lifetime
    // workload, 20k steps, 3 seeds: peak reserved / peak live 1.27-1.37 without, 1.21-1.23 with,
    // and no slower: fewer unmerged chunks in the tree). Exact fits -- a steady cycle of sizes --
    // never come here, so such a loop still never merges.
    index_.insert(c);
    coalesce_locked();
    c = index_.take_best_fit(rounded);
  }
  // Blocks this stream released are pending only for other streams: split one for this request
  // rather than grow while the device catches up (a framework frees on the stream it allocates
  // on; without this its memory ran ~3x ahead of PyTorch's own allocator on a real model).
  return carve_best_locked(c, rounded, nbytes, s);
}

// For a request on s, a chunk pending on s is as good as a free one: the arena carves the smaller
// of the best free fit c (taken from the index, or nullptr) and the best fit pending on s, and
// leaves the other where it was. Taking the free fit whenever there was one split large free
// chunks (a freed 989 MiB logits block) while pending chunks that fit better waited, and the pool
// grew: the Llama trace replayed on stream 0 held 2.07x its peak live, 1.44x with this (PyTorch's
// own allocator: 1.44x). The expandable arena keeps the free fit first: there the smaller pending
// fit lost memory on the same replay (1.25x -> 1.75x), its free chunks being the ones a growth
// extends (benchmarks/stream_lag_replay.py).
void* ArenaPool::carve_best_locked(ArenaChunk* c, std::size_t rounded, std::size_t nbytes, Stream s) {
  if (s != kNoStream)
    if (auto* p = static_cast<ArenaChunk*>(order_.peek_for_stream_fit(s, rounded));
        p && (!c || (p->size < c->size && !opt_.expandable))) {
      if (c) index_.insert(c);
      order_.take_peeked(p);
      return carve_pending_locked(p, rounded, nbytes, s);
    }
  return c ? carve_locked(c, rounded, nbytes, s) : nullptr;
}

void* ArenaPool::try_allocate_locked_nowait(std::size_t nbytes, Stream s) {
  if (nbytes == 0 || nbytes > kMaxRequest) return nullptr;  // the blocking path explains
  if (nshards_ > 1 && align_up(nbytes, opt_.alignment) > opt_.thread_cache_max_block) {
    ThreadCache* tc = detail::tls_find_cache(id_);
    if (tc && tc->home) {
      ArenaPool* home = existing_shard(tc->home);
      return home ? home->try_reuse_nowait(nbytes, s) : nullptr;
    }
  }
  return try_reuse_nowait(nbytes, s);
}

// This shard's own books only (no routing): reuse if its lock is free at once.
void* ArenaPool::try_reuse_nowait(std::size_t nbytes, Stream s) {
  std::unique_lock<detail::SpinMutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock() || closed()) return nullptr;
  if (cache_enabled_ && !detail::tls_find_cache(id_)) return nullptr;  // a first visit prunes caches, unlocked
  if (!note_stream_locked(s)) return nullptr;  // ending single-stream mode waits: the blocking path does
  if (cache_enabled_) cache_locked();
  const std::size_t rounded = align_up(nbytes, opt_.alignment);
  void* r = reuse_locked(rounded, nbytes, s);
  if (r) ++ev_.slow_allocs, ++ev_.nowait_allocs, refill_cache_locked(rounded);  // a refusal is counted by the blocking path, once
  return r;
}

Refusal ArenaPool::do_deallocate(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (inner_shards_.load(std::memory_order_acquire)) {  // none yet: every block is shard 0's
    const std::uint32_t home = caller_home();
    if (ArenaPool* sh = owner_shard(a)) return sh->push_remote(a, s, home) ? Refusal{} : sh->deallocate_here(a, s);
    if (push_remote(a, s, home)) return {};
  }
  const Refusal r = deallocate_here(a, s);
  if (r.kind != Refusal::Unknown) return r;
  // A lock-free probe may miss (a table sweep): the inner shards decide under their locks.
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i))
      if (const Refusal ri = sh->deallocate_here(a, s); ri.kind != Refusal::Unknown) return ri;
  return r;
}

Refusal ArenaPool::deallocate_here(std::uintptr_t a, Stream s) {
  Detached detached;
  if (cache_enabled_ && !detail::tls_find_cache(id_)) detail::tls_prune();  // before the pool lock
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    check_open();  // again under the lock: close() may have run since Pool::deallocate looked
    ArenaChunk* c = nullptr;
    drain_remote_locked();
    if (!table_.find(a, c)) return locate_locked(a);
    // Not Live, or a lock-free free on another thread took it since that thread's check.
    if (!c->claim_live()) return {Refusal::DoubleFree, c->st()};
    POOLKEEPER_SEAM(LockedFreeClaimed);
    try {
      // A thread that only frees (the consumer of a producer/consumer server) gets a cache too,
      // so its frees reach the pool in batches (arena_thread_cache.cpp).
      if (cache_enabled_) cache_locked();
      if (spill_and_cache_locked(c, s)) return {};  // the cache was full: a batch goes back instead
      const std::uintptr_t backing = c->backing->addr;  // c may be gone after the release's scan
      release_live_locked(c, s, detached);
      if (s == kNoStream) source_->released(backing);  // (skips a teardown while home releases are unsettled)
    } catch (...) {
      c->unclaim();  // the free failed before c changed hands (recording events): still live
      throw;
    }
  }
  free_detached(detached);
  return {};
}

// A live (or remote-freed) chunk leaves the live books and the pointer table.
void ArenaPool::unlive_locked(ArenaChunk* c) {
  live_.store(live_.load(std::memory_order_relaxed) - c->requested, std::memory_order_relaxed);
  overhead_ -= c->size - c->requested;
  --live_blocks_;
  table_.erase(c->addr);
}

void ArenaPool::release_live_locked(ArenaChunk* c, Stream s, Detached& out) {
  if (home_release_locked(c, s)) {
    ++ev_.slow_frees;
    unlive_locked(c);
    file_home_free_locked(c);
    tick_locked(out);
    return;
  }
  // First the step that can throw (recording events): if it does, the block is still live and
  // nothing was counted, so the caller's error leaves the pool as it was.
  if (s != kNoStream) order_.defer(c, s);
  ++ev_.slow_frees;
  unlive_locked(c);
  if (s == kNoStream) file_free_locked(c);
  else note_pending_locked(c);
  tick_locked(out);
}

bool ArenaPool::try_deallocate_locked_nowait(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!a) return false;
  if (inner_shards_.load(std::memory_order_acquire)) {  // none yet: every block is shard 0's
    const std::uint32_t home = caller_home();  // a push never waits or calls the upstream
    if (ArenaPool* sh = owner_shard(a)) return sh->push_remote(a, s, home) || sh->try_deallocate_locked_nowait(p, s);
    if (push_remote(a, s, home)) return true;
  }
  if (cache_enabled_ && !detail::tls_find_cache(id_)) return false;  // a first visit prunes caches, unlocked
  std::unique_lock<detail::SpinMutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock() || closed()) return false;
  ArenaChunk* c = nullptr;
  if (!table_.find(a, c) || !c->claim_live()) return false;  // the blocking path explains
  if (spill_and_cache_locked(c, s, true)) {  // the cache was full: a batch goes back instead
    ++ev_.nowait_frees;
    return true;
  }
  // Releases that would record events (another stream used the block) call the upstream; one
  // that would unmap (a stitched range's last block); one that would run a shrink scan, which
  // may hand backings to the upstream: the blocking path, not here.
  if ((s != kNoStream && StreamOrder::defer_records_events(c, s)) || (s == kNoStream && source_->wants_release(c)) ||
      (opt_.shrink_interval && ops_since_scan_ + 1 >= opt_.shrink_interval)) {
    c->unclaim();
    return false;
  }
  Detached none;
  release_live_locked(c, s, none);
  ++ev_.nowait_frees;
  return true;
}

// Why a pointer the table does not hold is refused: inside a chunk of a backing, or unknown.
ArenaChunk* ArenaPool::chunk_at_locked(std::uintptr_t a) const {
  auto it = std::upper_bound(backings_.begin(), backings_.end(), a,
                             [](std::uintptr_t x, const ArenaBacking* b) { return x < b->addr; });
  if (it == backings_.begin() || a >= (*(it - 1))->addr + (*(it - 1))->size) return nullptr;
  ArenaChunk* c = (*(it - 1))->first;
  while (c && !(a >= c->addr && a < c->addr + c->size)) c = c->next_addr;
  return c;
}

Refusal ArenaPool::locate_locked(std::uintptr_t a) {
  if (const ArenaChunk* c = chunk_at_locked(a)) {
    // Not live: a block freed before (its chunk may have merged with neighbours since) or
    // an address this pool never handed out. Either way nothing live is there.
    const ChunkState st = c->st();
    return {st == ChunkState::Live ? Refusal::Interior : Refusal::FreedMemory, st, c->addr};
  }
  return {Refusal::Unknown};
}

bool ArenaPool::do_record_stream(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (inner_shards_.load(std::memory_order_acquire))  // none yet: every block is shard 0's
    if (ArenaPool* sh = owner_shard(a)) return sh->record_here(a, s);
  if (record_here(a, s)) return true;
  // A lock-free probe may miss (a table sweep): the inner shards decide under their locks.
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i); sh && sh->record_here(a, s)) return true;
  return false;
}

bool ArenaPool::record_here(std::uintptr_t a, Stream s) {
  std::lock_guard<detail::SpinMutex> g(mu_);
  ArenaChunk* c = nullptr;
  if (!table_.find(a, c) || c->st() != ChunkState::Live) return false;
  c->add_use(s);
  return true;
}

// ---------------------------------------------------------------- remote frees

std::uint32_t ArenaPool::caller_home() const {
  const ThreadCache* tc = detail::tls_find_cache(id_);  // inner shards share the pool's id
  return tc ? tc->home : ~0u;
}

// Why: a block freed by another thread used to take its owner shard's lock from that thread, so
// the shard's index, table and chunk records moved to the freeing CPU and back to the owner's at
// its next allocation, at every block (16 threads freeing each other's 32 MiB blocks ran below one
// thread's rate, benchmarks/results/thread_scaling_h200.txt). A push moves one chunk record and
// one list head; the owner files a whole list under one lock hold.
// Only plain frees (no stream: a stream-ordered release records events under the lock), of
// blocks the thread caches do not take, of a Live block whose state this CAS claims (a concurrent
// second free of the same pointer loses it and is explained by the locked path).
// The record is read only once claimed: before, a locked free of the same block on another thread
// could be writing it (TSan: used_on, read here, dropped by file_free_locked).
bool ArenaPool::push_remote(std::uintptr_t a, Stream s, std::uint32_t caller_home) {
  if (s != kNoStream || caller_home == shard_index_) return false;
  ArenaChunk* c = nullptr;
  if (!table_.find(a, c)) return false;
  POOLKEEPER_SEAM(ArenaRemoteFound);
  if (!c->claim(ChunkState::Live, ChunkState::Remote)) return false;
  // The record was found lock-free: the block may have been freed since, its record merged away
  // and reused for another live block (a double free racing the first free). Only a claimed record
  // whose address is still a's is ours; another block's record gets its state back at once.
  if (c->addr != a || c->used_on || (cache_enabled_ && c->size <= opt_.thread_cache_max_block)) {
    c->set(ChunkState::Live);
    return false;
  }
  ArenaChunk* head = remote_head_.load(std::memory_order_relaxed);
  do {
    c->bin_next = head;
  } while (!remote_head_.compare_exchange_weak(head, c, std::memory_order_release, std::memory_order_relaxed));
  return true;
}

// Every remote free into the books, as a plain locked free files it (no shrink scan here: the
// count goes on, and the next locked release scans).
void ArenaPool::drain_remote_locked() {
  if (!remote_head_.load(std::memory_order_relaxed)) return;
  ArenaChunk* c = remote_head_.exchange(nullptr, std::memory_order_acquire);
  while (c) {
    ArenaChunk* next = c->bin_next;
    c->bin_next = nullptr;
    const std::uintptr_t backing = c->backing->addr;
    ++ev_.slow_frees;
    ++ev_.remote_frees;
    unlive_locked(c);
    file_free_locked(c);
    ++ops_since_scan_;
    source_->released(backing);
    c = next;
  }
}

// ---------------------------------------------------------------- maintenance

std::size_t ArenaPool::process_pending() {
  std::size_t inner = 0;
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i)) inner += sh->process_pending();
  std::lock_guard<detail::SpinMutex> g(mu_);
  const std::size_t before = order_.pending_bytes();
  if (ThreadCache* tc = cache_enabled_ ? detail::tls_find_cache(id_) : nullptr) {
    // Own stream-tagged cached blocks count as pending: settle them too.
    bool tagged = false;
    for (auto& b : tc->bins) tagged |= b.count && b.stream != kNoStream;
    if (tagged) flush_cache_locked(tc);
  }
  drain_locked(false);
  return inner + (before >= order_.pending_bytes() ? before - order_.pending_bytes() : 0);
}

void* ArenaPool::allocate_at(void* p, std::size_t nbytes, Stream s) {
  check_request(nbytes);
  check_open();
  if (nshards_ > 1) throw InvalidArgument("ArenaPool #" + std::to_string(id_) + ": allocate_at needs a pool of one shard");
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::size_t rounded = align_up(nbytes, opt_.alignment);
  std::lock_guard<detail::SpinMutex> g(mu_);
  check_open();
  // As in do_allocate: home's releases were filed free at once, so memory home may still be using
  // must not reach another stream while the mode lasts (during a capture it becomes pending on
  // home, and the range is refused below if it lies there).
  if (!note_stream_locked(s)) end_single_locked();
  const bool quiet = upstream_->captures_underway() == 0;
  reclaim_caches_locked();
  drain_locked(quiet);
  if (quiet) home_barrier_locked();
  coalesce_locked();
  ArenaChunk* c = chunk_at_locked(a);
  if (!c || c->st() != ChunkState::Free || a % opt_.alignment || rounded > c->addr + c->size - a)
    throw InvalidPointer("ArenaPool #" + std::to_string(id_) + ": " + format_ptr(a) + " + " + format_bytes(rounded) +
                         " is not free memory of this pool (allocate_at)",
                         a, "unknown");
  index_.remove(c);
  if (a > c->addr) {  // the part before the range stays free
    ArenaChunk* at = split_locked(c, a - c->addr);
    void* out = carve_locked(at, rounded, nbytes, s);
    file_free_locked(c);
    return out;
  }
  return carve_locked(c, rounded, nbytes, s);
}

void ArenaPool::synchronize() {
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i)) sh->synchronize();
  std::lock_guard<detail::SpinMutex> g(mu_);
  // Every thread's cache: stream-tagged blocks in an idle thread's cache are pending too, and
  // "nothing stays pending" must hold whoever freed them.
  reclaim_caches_locked();
  drain_locked(true);
  home_barrier_locked();  // single-stream mode: home releases are settled too (shrink may run again)
}

std::size_t ArenaPool::trim() {
  check_open();
  return trim_own() + trim_shards(this);
}

std::size_t ArenaPool::trim_own() {
  Detached d;
  std::size_t bytes;
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    check_open();
    reclaim_caches_locked();  // an idle thread's cached blocks would keep their backings alive
    settle_locked();
    bytes = release_free_backings_locked(d, false);
  }
  free_detached(d);
  return bytes;
}

std::size_t ArenaPool::shrink_scan() {
  Detached d;
  std::size_t bytes = 0;
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i)) bytes += sh->shrink_scan();
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    check_open();
    bytes += scan_locked(d);
  }
  free_detached(d);
  return bytes;
}

bool ArenaPool::do_close(LiveAtClose& live) {
  Detached d;
  // Inner shards' live blocks count too; they close only once every shard is empty (close needs
  // quiescence, so nothing refills one meanwhile).
  std::int64_t inner_blocks = 0, inner_live = 0;
  std::vector<std::uintptr_t> inner_sample;
  for (std::size_t i = 1; i < nshards_; ++i) {
    ArenaPool* sh = existing_shard(i);
    if (!sh) continue;
    std::lock_guard<detail::SpinMutex> g(sh->mu_);
    sh->drain_remote_locked();
    inner_blocks += static_cast<std::int64_t>(sh->live_blocks_);
    inner_live += static_cast<std::int64_t>(sh->live_.load());
    sh->table_.for_each([&](std::uintptr_t a, ArenaChunk* c) {
      if (c->st() == ChunkState::Live && inner_sample.size() < 8) inner_sample.push_back(a);
    });
  }
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    if (closed()) return true;
    drain_remote_locked();
    std::int64_t blocks = static_cast<std::int64_t>(live_blocks_) + inner_blocks;
    std::int64_t live_bytes = static_cast<std::int64_t>(live_.load()) + inner_live;
    for (auto& tc : caches_) {
      const auto k = tc->read();
      blocks += k.blocks_delta;
      live_bytes += k.live_delta;
    }
    if (blocks > 0) {
      live.blocks = static_cast<std::size_t>(blocks);
      live.bytes = static_cast<std::size_t>(live_bytes);
      table_.for_each([&](std::uintptr_t a, ArenaChunk* c) {
        if (c->st() == ChunkState::Live) live.note(a);
      });
      for (std::uintptr_t a : inner_sample) live.note(a);
      return false;
    }
    for (std::size_t i = 1; i < nshards_; ++i)
      if (ArenaPool* sh = existing_shard(i)) sh->close();  // empty: cannot throw LiveBlocksAtClose
    reclaim_caches_locked();
    drain_locked(true);
    if (!home_barrier_locked()) throw InvalidArgument("cannot close a single-stream pool while its stream is being captured");
    coalesce_locked();  // nothing is live, cached or pending now: each backing merges to one chunk
    for (auto& tc : caches_) fold_cache_locked(tc.get());
    source_->close(d);
    table_.clear();
    mark_closed();
  }
  for (auto& [p, n] : d) {
    try {
      upstream_free(p, n);
    } catch (...) {
      std::lock_guard<detail::SpinMutex> g(mu_);
      ++ev_.upstream_free_failures;
    }
    std::lock_guard<detail::SpinMutex> g(mu_);
    budget_.end_release(n);
  }
  return true;
}

bool ArenaPool::find_live(std::uintptr_t p) {
  {
    std::lock_guard<detail::SpinMutex> g(mu_);
    ArenaChunk* c;
    if (table_.find(p, c) && c->st() == ChunkState::Live) return true;
  }
  for (std::size_t i = 1; i < nshards_; ++i)
    if (ArenaPool* sh = existing_shard(i); sh && sh->find_live(p)) return true;
  return false;
}

}  // namespace poolkeeper
