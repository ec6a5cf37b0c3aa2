#include "poolkeeper/pools/size_class_pool.hpp"
#include "poolkeeper/detail/test_seam.hpp"

#include <algorithm>
#include <bit>
#include <map>
#include <thread>

namespace poolkeeper {

namespace {
unsigned log2_exact(std::size_t x) { return static_cast<unsigned>(std::countr_zero(x)); }
unsigned floor_log2(std::size_t x) { return 63u - static_cast<unsigned>(std::countl_zero(x)); }

// Threads are numbered on first use, round robin: with as many shards as threads each thread has
// a shard of its own, and the number is stable (no migration cost when the OS moves a thread).
std::atomic<std::uint32_t> g_thread_seq{0};
__attribute__((tls_model("initial-exec"))) thread_local std::uint32_t t_index = 0;  // 0: not numbered yet
std::uint32_t thread_index() {
  std::uint32_t i = t_index;
  if (i == 0) [[unlikely]]
    t_index = i = g_thread_seq.fetch_add(1, std::memory_order_relaxed) + 1;
  return i - 1;
}
}  // namespace

std::size_t SizeClassPool::class_size_for(std::size_t nbytes, std::size_t a, std::size_t k) {
  const std::size_t s = align_up(std::max<std::size_t>(nbytes, 1), a);
  if (s <= a * k) return s;  // linear region: exact multiples of the alignment
  const unsigned e = floor_log2(s - 1);  // s in (2^e, 2^(e+1)]
  const std::size_t step = std::size_t{1} << (e - log2_exact(k));
  return align_up(s, step);
}

std::size_t SizeClassPool::class_index(std::size_t c) const {
  const std::size_t a = opt_.alignment, k = opt_.classes_per_doubling;
  if (c <= a * k) return c / a - 1;
  const unsigned e0 = log2_exact(a * k);
  const unsigned e = floor_log2(c - 1);
  const std::size_t step = std::size_t{1} << (e - shift_);
  const std::size_t j = (c - (std::size_t{1} << e)) / step;  // 1..k
  return k + (e - e0) * k + (j - 1);
}

SizeClassPool::SizeClassPool(std::shared_ptr<Upstream> upstream, SizeClassOptions opt)
    : Pool(std::move(upstream)), opt_(opt) {
  // The class table spans every size up to kMaxRequest in steps of the alignment: an alignment
  // near 2^62 overflowed its arithmetic (and a std::bad_alloc followed).
  if (!is_pow2(opt_.alignment))
    throw InvalidArgument("alignment must be a power of two; got " + std::to_string(opt_.alignment));
  if (opt_.alignment > kMaxSizeClassAlignment)
    throw InvalidArgument("alignment must be at most 1 GiB; got " + std::to_string(opt_.alignment));
  const std::size_t k = opt_.classes_per_doubling;
  if (!(k == 1 || k == 2 || k == 4 || k == 8))
    throw InvalidArgument("classes_per_doubling must be 1, 2, 4 or 8; got " + std::to_string(k));
  if (opt_.shards > 1024) throw InvalidArgument("shards must be at most 1024; got " + std::to_string(opt_.shards));
  shift_ = log2_exact(k);
  nclasses_ = class_index(class_size_for(kMaxRequest, opt_.alignment, k)) + 1;
  // Auto: one shard per hardware thread, at least 8 (a shard costs a few KiB; too few shards
  // and threads share locks again), at most 64.
  std::size_t n = opt_.shards ? opt_.shards
                              : std::min<std::size_t>(64, std::max<std::size_t>(8, std::thread::hardware_concurrency()));
  n = std::bit_ceil(n);
  shards_.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    shards_.push_back(std::make_unique<Shard>(upstream_.get(), static_cast<std::uint32_t>(i)));
    shards_.back()->free.resize(nclasses_);
  }
  shard_mask_ = static_cast<std::uint32_t>(n - 1);
  budget_.limit = opt_.limit;
  join_directory();  // last: the pool is whole now
}

SizeClassPool::AllLocks::AllLocks(SizeClassPool* pool) : p(pool) {
  for (auto& sh : p->shards_) sh->mu.lock();
  for (auto& sh : p->shards_) p->file_remote_locked(*sh);
  p->grow_mu_.lock();
}

SizeClassPool::AllLocks::~AllLocks() {
  p->grow_mu_.unlock();
  for (auto it = p->shards_.rbegin(); it != p->shards_.rend(); ++it) (*it)->mu.unlock();
}

// inline: both hit paths ask on every call (out of line, each cost the pair ~10 instructions).
inline std::uint32_t SizeClassPool::my_shard_index() const { return thread_index() & shard_mask_; }
inline SizeClassPool::Shard& SizeClassPool::my_shard() { return *shards_[my_shard_index()]; }

bool SizeClassPool::free_remote(Block* b, std::uintptr_t a) {
  if (b->addr != a) return false;  // a record found lock-free that now describes another block
  // A capped pool reserves the bytes against the cap first, as a locked release would (so two
  // threads cannot both pass it); over the cap, the locked path retires the block instead.
  if (capped() && cached_total_.fetch_add(b->size, std::memory_order_relaxed) + b->size > opt_.max_cached_bytes) {
    cached_total_.fetch_sub(b->size, std::memory_order_relaxed);
    return false;
  }
  // Remote, not Free: until its shard files it the books count the block live, and an observation
  // that walks the blocks meanwhile (snapshot, validate) must read it as they count it. (As Free,
  // a claim landing during a snapshot's walk made the snapshot fail accounting.check.)
  if (!b->claim(ChunkState::Live, ChunkState::Remote)) {
    if (capped()) cached_total_.fetch_sub(b->size, std::memory_order_relaxed);
    return false;  // freed already (or being freed): the locked path reports it
  }
  // b is ours now and on no list: its shard cannot change until it is filed.
  POOLKEEPER_SEAM(RemoteClaimed);
  Shard& sh = *shards_[b->home()];
  Block* head = sh.remote.load(std::memory_order_relaxed);
  do {
    b->next_free = head;
  } while (!sh.remote.compare_exchange_weak(head, b, std::memory_order_release, std::memory_order_relaxed));
  return true;
}

std::size_t SizeClassPool::file_remote_locked(Shard& sh) {
  if (!sh.remote.load(std::memory_order_relaxed)) return 0;  // read only: the line stays shared
  Block* b = sh.remote.exchange(nullptr, std::memory_order_acquire);
  std::size_t n = 0;
  for (; b; ++n) {
    Block* next = b->next_free;
    sh.live -= b->requested;
    sh.overhead -= b->size - b->requested;
    --sh.live_blocks;
    make_free_locked(sh, b, true);  // (a capped pool counted the bytes at the push)
    b = next;
  }
  sh.remote_frees += n;
  return n;
}

SizeClassPool::~SizeClassPool() {
  unregister();
  if (closed()) return;  // (also in a forked child: nothing of it may be touched there)
  // Free what the pool holds; live blocks stay with their owner (never freed under them).
  Detached out;
  {
    AllLocks all(this);
    for (auto& sp : shards_) {
      Shard& sh = *sp;
      // A destructor must not throw (it runs from garbage collection, interpreter exit, a
      // registry clear): a driver error while settling (a failed event record) leaves the pending
      // blocks with the device -- never freed under work that may still use them.
      try {
        sh.order.drain([&](BlockRecord* r) { make_free_locked(sh, static_cast<Block*>(r)); }, true);
      } catch (...) {
      }
      try {
        for (std::uint32_t c = 0; c < nclasses_; ++c)
          while (Block* b = pop_free_locked(sh, c)) retire_locked(sh, b, out);
      } catch (...) {
      }
    }
  }
  for (auto& [p, n] : out) {
    try {
      upstream_->deallocate(p, n);
    } catch (...) {
    }
  }
}

// sh locked. counted: the bytes were already added to cached_total_ (a capped release reserves
// them first, so two threads cannot both pass the cap).
void SizeClassPool::make_free_locked(Shard& sh, Block* b, bool counted) {
  b->set(ChunkState::Free);
  b->drop_used_on();
  FreeList& fl = sh.free[b->cls];
  b->next_free = fl.head;
  fl.head = b;
  ++fl.count;
  sh.free_bytes += b->size;
  ++sh.free_blocks;
  if (capped() && !counted) cached_total_.fetch_add(b->size, std::memory_order_relaxed);
}

SizeClassPool::Block* SizeClassPool::pop_free_locked(Shard& sh, std::uint32_t cls) {
  FreeList& fl = sh.free[cls];
  Block* b = fl.head;
  if (!b) return nullptr;
  fl.head = b->next_free;
  --fl.count;
  b->next_free = nullptr;
  sh.free_bytes -= b->size;
  --sh.free_blocks;
  if (capped()) cached_total_.fetch_sub(b->size, std::memory_order_relaxed);
  return b;
}

// sh and grow_mu_ locked; b is in no list.
void SizeClassPool::retire_locked(Shard& sh, Block* b, Detached& out) {
  table_.erase(b->addr);
  budget_.release(b->size);
  sh.reserved -= b->size;
  out.emplace_back(reinterpret_cast<void*>(b->addr), b->size);
  nodes_.destroy(b);
  ++released_blocks_;
}

void SizeClassPool::free_detached(Detached& v) {
  // Outside every lock. A free the upstream refuses is counted and the block comes back as a
  // cached free block of its class (retried at the next release_cached), so the books never lose
  // bytes. While a graph capture scope is open nothing goes back at all (a free may synchronize
  // the device and invalidate the capture): the blocks come back the same way, uncounted.
  const bool hold = upstream_->captures_underway() > 0 && !closed();
  for (auto& [p, n] : v) {
    bool refused = false;
    if (!hold) {
      try {
        upstream_free(p, n);
        continue;
      } catch (...) {
        refused = true;
      }
    }
    Shard& sh = my_shard();
    Guard g(sh.mu);
    Guard g2(grow_mu_);
    if (refused) ++upstream_free_failures_;
    --released_blocks_;
    if (closed()) continue;  // nothing left to hold it: the upstream's counters show it
    Block* b = nodes_.create();
    b->addr = reinterpret_cast<std::uintptr_t>(p);
    b->size = n;
    b->cls = static_cast<std::uint32_t>(class_index(n));
    b->shard.store(sh.index, std::memory_order_relaxed);
    table_.insert(b->addr, b);
    budget_.grow(n);  // a new peak only if reset_peaks() ran while the block was out
    sh.reserved += n;
    make_free_locked(sh, b);
  }
  v.clear();
}

// Detach every shard's cached blocks (after settling completed releases when drain), one shard at
// a time: each step keeps that shard's books whole. Returns the bytes detached.
std::size_t SizeClassPool::detach_all_free(Detached& out, bool drain) {
  std::size_t bytes = 0;
  for (auto& sp : shards_) {
    Shard& sh = *sp;
    Guard g(sh.mu);
    file_remote_locked(sh);
    if (drain && sh.order.pending_blocks())
      sh.order.drain([&](BlockRecord* r) { make_free_locked(sh, static_cast<Block*>(r)); });
    if (!sh.free_blocks) continue;
    Guard g2(grow_mu_);
    for (std::uint32_t c = 0; c < nclasses_; ++c)
      while (Block* b = pop_free_locked(sh, c)) {
        bytes += b->size;
        retire_locked(sh, b, out);
      }
  }
  return bytes;
}

// The caller's shard has no block for the request: take one from another shard before the
// upstream is asked. Free blocks of the class move over in a batch (up to half of that shard's
// list, at most 8) so a thread whose blocks keep being freed into other shards does not come back
// for each one; a block released on stream s in another shard serves s at once, as in its own.
// First pass: only the shards whose lock is free at once (a busy shard's owner is working; waiting
// there would stall this thread behind it when another shard has the block). Only when that finds
// nothing and some shard was busy does a second pass wait for each lock, in index order.
SizeClassPool::Block* SizeClassPool::steal_locked(std::unique_lock<detail::SpinMutex>& g, Shard& sh,
                                                  std::uint32_t cls, std::size_t csize, Stream s) {
  bool busy = false;
  for (std::size_t k = 1; k < shards_.size(); ++k) {
    Shard& o = *shards_[(sh.index + k) & shard_mask_];
    std::unique_lock<detail::SpinMutex> go(o.mu, std::try_to_lock);  // never waits: no lock order
    if (!go.owns_lock()) {
      busy = true;
      continue;
    }
    if (Block* b = take_from_locked(sh, o, cls, csize, s)) return b;
  }
  if (!busy) return nullptr;
  for (std::size_t k = 1; k < shards_.size(); ++k) {
    Shard& o = *shards_[(sh.index + k) & shard_mask_];
    std::unique_lock<detail::SpinMutex> go(o.mu, std::defer_lock);
    if (o.index > sh.index) {
      go.lock();
    } else if (!go.try_lock()) {
      g.unlock();  // index order: o's lock before ours
      go.lock();
      g.lock();
      file_remote_locked(sh);
      if (Block* b = pop_free_locked(sh, cls)) return b;  // freed into ours meanwhile
    }
    if (Block* b = take_from_locked(sh, o, cls, csize, s)) return b;
  }
  return nullptr;
}

// sh and o locked: o's block for the request, moved to sh (nullptr: o has none).
SizeClassPool::Block* SizeClassPool::take_from_locked(Shard& sh, Shard& o, std::uint32_t cls, std::size_t csize,
                                                      Stream s) {
  file_remote_locked(o);
  if (s != kNoStream && o.order.pending_blocks())
    if (auto* b = static_cast<Block*>(o.order.take_for_stream(s, csize))) {
      o.reserved -= b->size;  // pending there until now; live here from now on
      sh.reserved += b->size;
      b->shard.store(sh.index, std::memory_order_relaxed);
      ++sh.migrated;
      return b;
    }
  if (!o.free[cls].count && o.order.pending_blocks())  // pressure: settle completed releases there
    o.order.drain([&](BlockRecord* r) { make_free_locked(o, static_cast<Block*>(r)); });
  std::size_t n = std::min<std::size_t>(8, (o.free[cls].count + 1) / 2);
  if (!n) return nullptr;
  for (; n; --n) {
    Block* x = pop_free_locked(o, cls);
    o.reserved -= x->size;
    sh.reserved += x->size;
    x->shard.store(sh.index, std::memory_order_relaxed);
    make_free_locked(sh, x);
    ++sh.migrated;
  }
  return pop_free_locked(sh, cls);
}

void* SizeClassPool::serve_hit_locked(Shard& sh, Block* b, std::size_t nbytes, Stream s) {
  ++sh.hits;
  b->requested = nbytes;
  b->alloc_stream = b->last_stream = s;
  b->set(ChunkState::Live);
  sh.live += nbytes;
  sh.overhead += b->size - nbytes;
  ++sh.live_blocks;
  if (sh.live > sh.peak_live) [[unlikely]] {
    // Blocks on the remote list are freed already, though the books still count them live:
    // filed first, the shard's peak stays a figure that was true at one moment.
    file_remote_locked(sh);
    sh.peak_live = std::max(sh.peak_live, sh.live);
  }
  return reinterpret_cast<void*>(b->addr);
}

void* SizeClassPool::do_allocate(std::size_t nbytes, Stream s) {
  const std::size_t csize = class_size_for(nbytes, opt_.alignment, opt_.classes_per_doubling);
  const auto cls = static_cast<std::uint32_t>(class_index(csize));
  Shard& sh = my_shard();
  Detached detached;
  bool retried = false;
  // Recovery, once: give cached blocks of other classes back (after an upstream refusal, pending
  // ones settled too), then retry. False: nothing left to try.
  auto recover = [&](bool drain) {
    if (retried) return false;
    retried = true;
    if (!detach_all_free(detached, drain) && !drain) return false;
    free_detached(detached);
    Guard g(grow_mu_);
    ++oom_retries_;
    return true;
  };
  auto fail = [&](bool limit_hit, const char* upstream_error) {
    OomFigures f = oom_figures(stats(), nbytes);  // stats(): one observation under every lock
    if (upstream_error) f.upstream_error = upstream_error;
    throw_oom(std::move(f), csize, limit_hit, FreeFit::OwnClass);
  };
  for (;;) {
    {
      std::unique_lock<detail::SpinMutex> g(sh.mu);
      Block* b = nullptr;
      if (s != kNoStream) b = static_cast<Block*>(sh.order.take_for_stream(s, csize));
      if (!b) b = pop_free_locked(sh, cls);
      if (!b && file_remote_locked(sh)) b = pop_free_locked(sh, cls);  // freed here by other threads
      if (!b && sh.order.pending_blocks()) {
        // Pressure: settle completed releases, then look again.
        sh.order.drain([&](BlockRecord* r) { make_free_locked(sh, static_cast<Block*>(r)); });
        b = pop_free_locked(sh, cls);
      }
      if (!b && shards_.size() > 1) b = steal_locked(g, sh, cls, csize, s);
      if (b) return serve_hit_locked(sh, b, nbytes, s);
    }
    bool over = false;
    {
      Guard g(grow_mu_);
      over = !budget_.claim(csize);
      if (!over) ++misses_;
    }
    if (over) {
      if (recover(false)) continue;
      fail(true, nullptr);
    }
    void* p = nullptr;
    try {
      p = upstream_alloc(csize);
    } catch (const UpstreamOutOfMemory& e) {
      {
        Guard g(grow_mu_);
        budget_.cancel(csize);
      }
      if (recover(true)) continue;
      fail(false, e.what());
    } catch (...) {
      Guard g(grow_mu_);
      budget_.cancel(csize);
      throw;
    }
    std::unique_lock<detail::SpinMutex> g(sh.mu);
    std::unique_lock<detail::SpinMutex> g2(grow_mu_);
    if (closed()) {
      budget_.cancel(csize);
      g2.unlock();
      g.unlock();
      give_back_after_close(p, csize);
    }
    budget_.commit(csize);
    Block* nb = nodes_.create();
    nb->addr = reinterpret_cast<std::uintptr_t>(p);
    nb->size = csize;
    nb->cls = cls;
    nb->shard.store(sh.index, std::memory_order_relaxed);
    table_.insert(nb->addr, nb);
    sh.reserved += csize;
    serve_hit_locked(sh, nb, nbytes, s);
    --sh.hits;  // a miss, not a hit
    return p;
  }
}

void* SizeClassPool::try_allocate_fast(std::size_t nbytes, Stream s) {
  if (nbytes - 1 >= kMaxRequest || closed_.load(std::memory_order_relaxed)) return nullptr;
  Shard& sh = my_shard();
  std::unique_lock<detail::SpinMutex> g(sh.mu, std::try_to_lock);
  if (!g.owns_lock()) return nullptr;
  const std::size_t csize = class_size_for(nbytes, opt_.alignment, opt_.classes_per_doubling);
  Block* b = nullptr;
  if (s != kNoStream) b = static_cast<Block*>(sh.order.take_for_stream(s, csize));
  const auto cls = static_cast<std::uint32_t>(class_index(csize));
  if (!b) b = pop_free_locked(sh, cls);
  if (!b && file_remote_locked(sh)) b = pop_free_locked(sh, cls);
  if (!b) return nullptr;
  return serve_hit_locked(sh, b, nbytes, s);
}

bool SizeClassPool::try_deallocate_fast(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!a || closed_.load(std::memory_order_relaxed)) return false;
  Block* b = nullptr;
  if (!table_.find(a, b) || b->st() != ChunkState::Live) return false;  // the full path explains
  const std::uint32_t k = b->home();
  // Another thread's block (or ours while our lock is busy): the remote list, never the lock the
  // allocating thread works under. Stream releases keep to the lock (the shard's stream order).
  // (The thread's number read as is: a thread never numbered has allocated nothing, so whichever
  // shard the unset number names, either path is right for it.)
  if (s == kNoStream && k != ((t_index - 1) & shard_mask_)) return free_remote(b, a);
  Shard& sh = *shards_[k & shard_mask_];
  std::unique_lock<detail::SpinMutex> g(sh.mu, std::try_to_lock);
  if (!g.owns_lock()) return s == kNoStream && free_remote(b, a);
  // Claimed, not only checked: another thread's free_remote of b needs no lock.
  if (b->home() != k || b->addr != a || !b->claim_live()) return false;
  POOLKEEPER_SEAM(LockedFreeClaimed);
  if (s != kNoStream && StreamOrder::defer_records_events(b, s)) {  // an upstream call
    b->unclaim();
    return false;
  }
  if (s == kNoStream && capped()) {
    if (cached_total_.fetch_add(b->size, std::memory_order_relaxed) + b->size > opt_.max_cached_bytes) {
      cached_total_.fetch_sub(b->size, std::memory_order_relaxed);
      b->unclaim();
      return false;
    }
  }
  sh.live -= b->requested;
  sh.overhead -= b->size - b->requested;
  --sh.live_blocks;
  if (s == kNoStream) make_free_locked(sh, b, true);
  else sh.order.defer(b, s);
  return true;
}

// sh locked, b claimed (Freeing) in sh. First the step that can throw (recording events): then a failure
// changes nothing.
void SizeClassPool::release_block_locked(Shard& sh, Block* b, Stream s, Detached& out) {
  if (s != kNoStream) sh.order.defer(b, s);
  sh.live -= b->requested;
  sh.overhead -= b->size - b->requested;
  --sh.live_blocks;
  if (s != kNoStream) return;
  if (capped()) {
    if (cached_total_.fetch_add(b->size, std::memory_order_relaxed) + b->size > opt_.max_cached_bytes) {
      cached_total_.fetch_sub(b->size, std::memory_order_relaxed);
      b->drop_used_on();
      Guard g(grow_mu_);
      retire_locked(sh, b, out);
      return;
    }
    make_free_locked(sh, b, true);
    return;
  }
  make_free_locked(sh, b);
}

Refusal SizeClassPool::do_deallocate(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  Detached detached;
  Block* b = nullptr;
  bool done = false;
  if (table_.find(a, b)) {
    // The block's own shard lock is all a free takes. Recheck under it: a Free block may have
    // moved to another shard, and a record found lock-free may have been retired and reused.
    const std::uint32_t k = b->home();
    Shard& sh = *shards_[k & shard_mask_];
    Guard g(sh.mu);
    if (b->home() == k && b->addr == a) {
      // Claimed, not only checked: another thread's free_remote of b needs no lock.
      if (!b->claim_live()) return {Refusal::DoubleFree, b->st()};
      POOLKEEPER_SEAM(LockedFreeClaimed);
      try {
        release_block_locked(sh, b, s, detached);
      } catch (...) {
        b->unclaim();  // recording events failed before b changed hands: still live
        throw;
      }
      done = true;
    }
  }
  if (!done) {
    // Not found lock-free (an error, or the table was being rewritten): decide under every lock.
    AllLocks all(this);
    if (!table_.find(a, b)) {
      Refusal r{Refusal::Unknown};
      table_.for_each([&](std::uintptr_t k, Block* x) {
        if (r.kind != Refusal::Interior && a > k && a < k + x->size) r = {Refusal::Interior, x->st(), k};
      });
      return r;
    }
    if (!b->claim_live()) return {Refusal::DoubleFree, b->st()};
    grow_mu_.unlock();  // release_block_locked may take it (a capped release retires)
    try {
      release_block_locked(*shards_[b->home() & shard_mask_], b, s, detached);
    } catch (...) {
      b->unclaim();
      grow_mu_.lock();
      throw;
    }
    grow_mu_.lock();
  }
  free_detached(detached);
  return {};
}

bool SizeClassPool::do_record_stream(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  Block* b = nullptr;
  if (table_.find(a, b) && b->st() == ChunkState::Live) {
    const std::uint32_t k = b->home();
    Shard& sh = *shards_[k & shard_mask_];
    Guard g(sh.mu);
    if (b->home() == k && b->addr == a && b->st() == ChunkState::Live) {
      b->add_use(s);
      return true;
    }
  }
  // Not found lock-free (bad input, or the table was being rewritten): decide under every lock.
  AllLocks all(this);
  if (!table_.find(a, b) || b->st() != ChunkState::Live) return false;
  b->add_use(s);
  return true;
}

std::size_t SizeClassPool::process_pending() {
  std::size_t bytes = 0;
  for (auto& sp : shards_) {
    Shard& sh = *sp;
    Guard g(sh.mu);
    file_remote_locked(sh);
    bytes += sh.order.drain([&](BlockRecord* r) { make_free_locked(sh, static_cast<Block*>(r)); });
  }
  return bytes;
}

void SizeClassPool::synchronize() {
  for (auto& sp : shards_) {
    Shard& sh = *sp;
    Guard g(sh.mu);
    file_remote_locked(sh);
    sh.order.drain([&](BlockRecord* r) { make_free_locked(sh, static_cast<Block*>(r)); }, true);
  }
}

std::size_t SizeClassPool::release_cached() {
  check_open();
  Detached detached;
  const std::size_t bytes = detach_all_free(detached, false);
  free_detached(detached);
  return bytes;
}

PoolStats SizeClassPool::stats() { return stats_impl(nullptr); }

PoolStats SizeClassPool::stats_impl(std::vector<BackingInfo>* blocks) {
  PoolStats st;
  std::map<Stream, std::size_t> by_stream;
  std::vector<bool> cached(nclasses_, false);
  std::uint64_t hits = 0, migrated = 0, remote = 0;
  std::size_t peak_shard = 0;
  StreamOrderCounters so;
  {
    AllLocks all(this);
    if (blocks)
      table_.for_each([&](std::uintptr_t, Block* b) {
        BackingInfo& bi = blocks->emplace_back(block_backing(*b));
        // One read of the state: a claim may turn Live into Remote between two reads.
        const ChunkState s = bi.chunks[0].state;
        if (s == ChunkState::Remote) bi.chunks[0].state = ChunkState::Live;
        if (s == ChunkState::Pending) shards_[b->home()]->order.describe(b, bi.chunks[0].waits_on, bi.chunks[0].event);
      });
    for (auto& sp : shards_) {
      Shard& sh = *sp;
      st.live += sh.live;
      st.free += sh.free_bytes;
      st.pending += sh.order.pending_bytes();
      st.overhead += sh.overhead;
      st.live_blocks += sh.live_blocks;
      st.free_chunks += sh.free_blocks;
      st.pending_blocks += sh.order.pending_blocks();
      for (auto& [s, n] : sh.order.by_stream()) by_stream[s] += n;
      for (std::size_t c = nclasses_; c-- > 0;)
        if (sh.free[c].head) {
          st.largest_free = std::max(st.largest_free, sh.free[c].head->size);
          break;
        }
      for (std::size_t c = 0; c < nclasses_; ++c)
        if (sh.free[c].count) cached[c] = true;
      hits += sh.hits;
      migrated += sh.migrated;
      remote += sh.remote_frees;
      so.add(sh.order);
      peak_shard = std::max(peak_shard, sh.peak_live);
    }
    st.reserved = budget_.reserved;
    peak_live_ = std::max({peak_live_, st.live, peak_shard});
    st.peak_reserved = budget_.peak_reserved;
    st.peak_live = peak_live_;
    st.backings = table_.size();
    add_extras(st, {{"hits", hits}, {"misses", misses_},
                    {"cached_classes", static_cast<std::uint64_t>(std::count(cached.begin(), cached.end(), true))},
                    {"released_blocks", released_blocks_}});
    so.report(st);
    add_extras(st, {{"upstream_free_failures", upstream_free_failures_ + refused_after_close()},
                    {"oom_retries", oom_retries_},
                    {"table_capacity", table_.capacity()}, {"shards", shards_.size()},
                    {"shard_migrations", migrated}, {"remote_frees", remote}});
  }
  st.limit = opt_.limit;
  st.pending_by_stream.assign(by_stream.begin(), by_stream.end());
  fill_upstream_counts(st);
  return st;
}

void SizeClassPool::validate() {
  AllLocks all(this);
  const std::size_t ns = shards_.size();
  std::vector<std::size_t> r(ns), l(ns), o(ns), f(ns), fb(ns), p(ns), lb(ns);
  table_.for_each([&](std::uintptr_t a, Block* b) {
    if (b->addr != a) throw InvariantViolation("SizeClassPool: table key != block address");
    if (b->size != class_size_for(b->size, opt_.alignment, opt_.classes_per_doubling) ||
        class_index(b->size) != b->cls)
      throw InvariantViolation("SizeClassPool: block size is not its class size");
    if (a % opt_.alignment) throw InvariantViolation("SizeClassPool: misaligned block");
    const std::uint32_t k = b->home();
    if (k >= ns) throw InvariantViolation("SizeClassPool: block of no shard");
    r[k] += b->size;
    switch (b->st()) {
      case ChunkState::Live:
      case ChunkState::Remote:  // claimed by a lock-free free not yet filed: the books count it live
        if (b->requested > b->size) throw InvariantViolation("SizeClassPool: requested above class size");
        l[k] += b->requested;
        o[k] += b->size - b->requested;
        ++lb[k];
        break;
      case ChunkState::Free: f[k] += b->size; ++fb[k]; break;
      case ChunkState::Pending: p[k] += b->size; break;
      default: throw InvariantViolation("SizeClassPool: block in an impossible state");
    }
  });
  std::size_t total_reserved = 0, total_free = 0, claimed = 0;
  table_.for_each([&](std::uintptr_t, Block* b) {
    if (b->st() == ChunkState::Remote) claimed += b->size;
  });
  for (std::size_t k = 0; k < ns; ++k) {
    Shard& sh = *shards_[k];
    std::size_t listed = 0, listed_bytes = 0;
    for (std::size_t c = 0; c < nclasses_; ++c) {
      std::size_t n = 0;
      for (Block* b = sh.free[c].head; b; b = b->next_free, ++n) {
        if (b->cls != c || b->st() != ChunkState::Free || b->home() != k)
          throw InvariantViolation("SizeClassPool: bad free-list entry");
        listed_bytes += b->size;
      }
      if (n != sh.free[c].count) throw InvariantViolation("SizeClassPool: free-list count mismatch");
      listed += n;
    }
    sh.order.validate();
    const std::string where = "SizeClassPool shard " + std::to_string(k) + ": ";
    if (r[k] != sh.reserved)
      throw InvariantViolation(where + "reserved " + std::to_string(sh.reserved) + " but blocks add to " + std::to_string(r[k]));
    if (l[k] != sh.live || o[k] != sh.overhead || lb[k] != sh.live_blocks)
      throw InvariantViolation(where + "live/overhead totals mismatch");
    if (f[k] != sh.free_bytes || fb[k] != sh.free_blocks || listed != fb[k] || listed_bytes != f[k])
      throw InvariantViolation(where + "free totals mismatch");
    if (p[k] != sh.order.pending_bytes()) throw InvariantViolation(where + "pending totals mismatch");
    if (sh.reserved != sh.live + sh.free_bytes + sh.order.pending_bytes() + sh.overhead)
      throw InvariantViolation(where + "reserved != live + free + pending + overhead");
    total_reserved += sh.reserved;
    total_free += sh.free_bytes;
  }
  if (total_reserved != budget_.reserved)
    throw InvariantViolation("SizeClassPool: reserved " + std::to_string(budget_.reserved) + " but the shards hold " +
                             std::to_string(total_reserved));
  // A capped lock-free free counts its block's bytes as cached from just before its claim until
  // its shard files it (the moment between the two is outside a quiet pool).
  if (capped() && cached_total_.load() != total_free + claimed)
    throw InvariantViolation("SizeClassPool: cached-bytes counter does not match the free lists");
  if (table_.size() != nodes_.live() || !table_.consistent())
    throw InvariantViolation("SizeClassPool: pointer table does not match the blocks");
}

bool SizeClassPool::do_close(LiveAtClose& live) {
  Detached detached;
  {
    AllLocks all(this);
    for (auto& sh : shards_) live.blocks += sh->live_blocks, live.bytes += sh->live;
    if (live.blocks) {
      table_.for_each([&](std::uintptr_t a, Block* b) {
        if (b->st() == ChunkState::Live || b->st() == ChunkState::Remote) live.note(a);
      });
      return false;
    }
    for (auto& sp : shards_) {
      Shard& sh = *sp;
      sh.order.drain([&](BlockRecord* r) { make_free_locked(sh, static_cast<Block*>(r)); }, true);
      for (std::uint32_t c = 0; c < nclasses_; ++c)
        while (Block* b = pop_free_locked(sh, c)) retire_locked(sh, b, detached);
    }
    mark_closed();
  }
  free_detached(detached);
  return true;
}

Snapshot SizeClassPool::snapshot() {
  std::vector<BackingInfo> blocks;
  PoolStats st = stats_impl(&blocks);
  Snapshot snap = snapshot_head(std::move(st));
  snap.backings = std::move(blocks);
  sort_backings(snap);
  return snap;
}

bool SizeClassPool::find_live(std::uintptr_t p) {
  Guard g(grow_mu_);  // the table is written only under it
  Block* b;
  return table_.find(p, b) && b->st() == ChunkState::Live;
}

// Peaks restart from now: each shard's peak from its live bytes, the pool's from their sum and the
// reserved bytes (all locks: one consistent observation).
void SizeClassPool::reset_peaks() {
  AllLocks all(this);
  std::size_t live = 0;
  for (auto& sp : shards_) {
    sp->peak_live = sp->live;
    live += sp->live;
  }
  peak_live_ = live;
  budget_.reset_peak();
}

}  // namespace poolkeeper
