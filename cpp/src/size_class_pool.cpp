#include "poolkeeper/size_class_pool.hpp"

#include <algorithm>
#include <bit>

namespace poolkeeper {

namespace {
unsigned log2_exact(std::size_t x) { return static_cast<unsigned>(std::countr_zero(x)); }
unsigned floor_log2(std::size_t x) { return 63u - static_cast<unsigned>(std::countl_zero(x)); }
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
    : Pool(std::move(upstream)), opt_(opt), order_(upstream_.get()) {
  // The class table spans every size up to kMaxRequest in steps of the alignment: an alignment
  // near 2^62 overflowed its arithmetic (and a std::bad_alloc followed).
  if (!is_pow2(opt_.alignment))
    throw InvalidArgument("alignment must be a power of two; got " + std::to_string(opt_.alignment));
  if (opt_.alignment > kMaxSizeClassAlignment)
    throw InvalidArgument("alignment must be at most 1 GiB; got " + std::to_string(opt_.alignment));
  const std::size_t k = opt_.classes_per_doubling;
  if (!(k == 1 || k == 2 || k == 4 || k == 8))
    throw InvalidArgument("classes_per_doubling must be 1, 2, 4 or 8; got " + std::to_string(k));
  shift_ = log2_exact(k);
  free_.resize(class_index(class_size_for(kMaxRequest, opt_.alignment, k)) + 1);
  join_directory();  // last: the pool is whole now
}

SizeClassPool::~SizeClassPool() {
  unregister();
  if (closed()) return;  // (also in a forked child: nothing of it may be touched there)
  // Free what the pool holds; live blocks stay with their owner (never freed under them).
  std::vector<std::pair<void*, std::size_t>> out;
  {
    std::lock_guard<std::mutex> g(mu_);
    // A destructor must not throw (it runs from garbage collection, interpreter exit, a registry
    // clear): a driver error while settling (a failed event record) leaves the pending blocks with
    // the device -- never freed under work that may still use them -- and the free ones go back.
    try {
      order_.drain([&](BlockRecord* r) { make_free_locked(static_cast<Block*>(r)); }, true);
    } catch (...) {
    }
    try {
      for (std::size_t c = 0; c < free_.size(); ++c)
        while (Block* b = pop_free_locked(static_cast<std::uint32_t>(c))) retire_locked(b, out);
    } catch (...) {
    }
  }
  for (auto& [p, n] : out) {
    try {
      upstream_->deallocate(p, n);
    } catch (...) {
    }
  }
}

void SizeClassPool::make_free_locked(Block* b) {
  b->set(ChunkState::Free);
  b->drop_used_on();
  FreeList& fl = free_[b->cls];
  b->next_free = fl.head;
  fl.head = b;
  ++fl.count;
  free_bytes_ += b->size;
  ++free_blocks_;
}

SizeClassPool::Block* SizeClassPool::pop_free_locked(std::uint32_t cls) {
  FreeList& fl = free_[cls];
  Block* b = fl.head;
  if (!b) return nullptr;
  fl.head = b->next_free;
  --fl.count;
  b->next_free = nullptr;
  free_bytes_ -= b->size;
  --free_blocks_;
  return b;
}

void SizeClassPool::retire_locked(Block* b, std::vector<std::pair<void*, std::size_t>>& out) {
  table_.erase(b->addr);
  reserved_ -= b->size;
  out.emplace_back(reinterpret_cast<void*>(b->addr), b->size);
  nodes_.destroy(b);
  ++released_blocks_;
}

void SizeClassPool::free_detached(std::vector<std::pair<void*, std::size_t>>& v) {
  // Outside the lock. A free the upstream refuses is counted and the block comes back as a cached
  // free block of its class (retried at the next release_cached), so the books never lose bytes.
  // While a graph capture scope is open nothing goes back at all (a free may synchronize the
  // device and invalidate the capture): the blocks come back the same way, uncounted.
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
    std::lock_guard<std::mutex> g(mu_);
    if (refused) ++upstream_free_failures_;
    --released_blocks_;
    if (closed()) continue;  // nothing left to hold it: the upstream's counters show it
    Block* b = nodes_.create();
    b->addr = reinterpret_cast<std::uintptr_t>(p);
    b->size = n;
    b->cls = static_cast<std::uint32_t>(class_index(n));
    table_.insert(b->addr, b);
    reserved_ += n;
    make_free_locked(b);
  }
  v.clear();
}

OomFigures SizeClassPool::figures_locked(std::size_t requested, const char* cause) const {
  OomFigures f;
  f.requested = requested;
  f.reserved = reserved_;
  f.live = live_;
  f.free = free_bytes_;
  f.free_chunks = free_blocks_;
  f.pending = order_.pending_bytes();
  f.pending_by_stream = order_.by_stream();
  f.limit = opt_.limit;
  f.cause = cause;
  for (std::size_t c = free_.size(); c-- > 0;)
    if (free_[c].head) {
      f.largest_free = free_[c].head->size;
      break;
    }
  return f;
}

void* SizeClassPool::allocate(std::size_t nbytes, Stream s) {
  check_request(nbytes);
  check_open();
  const std::size_t csize = class_size_for(nbytes, opt_.alignment, opt_.classes_per_doubling);
  const auto cls = static_cast<std::uint32_t>(class_index(csize));
  std::vector<std::pair<void*, std::size_t>> detached;
  bool retried = false;
  for (;;) {
    std::unique_lock<std::mutex> g(mu_);
    Block* b = nullptr;
    if (s != kNoStream) b = static_cast<Block*>(order_.take_for_stream(s, csize));
    if (!b) b = pop_free_locked(cls);
    if (!b && order_.pending_blocks()) {
      // Pressure: settle completed releases, then look again.
      order_.drain([&](BlockRecord* r) { make_free_locked(static_cast<Block*>(r)); });
      b = pop_free_locked(cls);
    }
    if (b) return serve_hit_locked(b, nbytes, s);
    if (opt_.limit && reserved_ + claimed_ + csize > opt_.limit) {
      if (!retried && free_blocks_) {
        // Give cached blocks of other classes back, then retry once.
        for (std::size_t c = 0; c < free_.size(); ++c)
          while (Block* x = pop_free_locked(static_cast<std::uint32_t>(c))) retire_locked(x, detached);
        g.unlock();
        free_detached(detached);
        retried = true;
        ++oom_retries_;
        continue;
      }
      OomFigures f = figures_locked(nbytes, order_.pending_bytes() >= csize ? "pending" : "limit");
      g.unlock();
      throw_oom(std::move(f));
    }
    ++misses_;
    claimed_ += csize;  // before the upstream call, so concurrent callers respect the limit
    g.unlock();
    void* p = nullptr;
    try {
      p = upstream_alloc(csize);
    } catch (const UpstreamOutOfMemory& e) {
      std::unique_lock<std::mutex> g2(mu_);
      claimed_ -= csize;
      if (!retried) {
        order_.drain([&](BlockRecord* r) { make_free_locked(static_cast<Block*>(r)); });
        for (std::size_t c = 0; c < free_.size(); ++c)
          while (Block* x = pop_free_locked(static_cast<std::uint32_t>(c))) retire_locked(x, detached);
        g2.unlock();
        free_detached(detached);
        retried = true;
        ++oom_retries_;
        continue;
      }
      OomFigures f = figures_locked(nbytes, order_.pending_bytes() >= csize ? "pending" : "upstream");
      f.upstream_error = e.what();
      g2.unlock();
      throw_oom(std::move(f));
    } catch (...) {
      std::lock_guard<std::mutex> g2(mu_);
      claimed_ -= csize;
      throw;
    }
    std::lock_guard<std::mutex> g2(mu_);
    claimed_ -= csize;
    reserved_ += csize;
    Block* nb = nodes_.create();
    nb->addr = reinterpret_cast<std::uintptr_t>(p);
    nb->size = csize;
    nb->cls = cls;
    nb->requested = nbytes;
    nb->alloc_stream = nb->last_stream = s;
    nb->set(ChunkState::Live);
    table_.insert(nb->addr, nb);
    live_ += nbytes;
    overhead_ += csize - nbytes;
    ++live_blocks_;
    peak_reserved_ = std::max(peak_reserved_, reserved_);
    peak_live_ = std::max(peak_live_, live_);
    return p;
  }
}

void* SizeClassPool::try_allocate_fast(std::size_t nbytes, Stream s) {
  if (nbytes - 1 >= kMaxRequest || closed_.load(std::memory_order_relaxed)) return nullptr;
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock()) return nullptr;
  const std::size_t csize = class_size_for(nbytes, opt_.alignment, opt_.classes_per_doubling);
  Block* b = nullptr;
  if (s != kNoStream) b = static_cast<Block*>(order_.take_for_stream(s, csize));
  if (!b) b = pop_free_locked(static_cast<std::uint32_t>(class_index(csize)));
  if (!b) return nullptr;
  return serve_hit_locked(b, nbytes, s);
}

void* SizeClassPool::serve_hit_locked(Block* b, std::size_t nbytes, Stream s) {
  ++hits_;
  b->requested = nbytes;
  b->alloc_stream = b->last_stream = s;
  b->set(ChunkState::Live);
  live_ += nbytes;
  overhead_ += b->size - nbytes;
  ++live_blocks_;
  peak_live_ = std::max(peak_live_, live_);
  return reinterpret_cast<void*>(b->addr);
}

bool SizeClassPool::try_deallocate_fast(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!a || closed_.load(std::memory_order_relaxed)) return false;
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock()) return false;
  Block* b = nullptr;
  if (!table_.find(a, b) || b->st() != ChunkState::Live) return false;  // the full path explains
  if (s == kNoStream && free_bytes_ + b->size > opt_.max_cached_bytes) return false;
  if (s != kNoStream && StreamOrder::defer_records_events(b, s)) return false;  // an upstream call
  live_ -= b->requested;
  overhead_ -= b->size - b->requested;
  --live_blocks_;
  if (s == kNoStream) make_free_locked(b);
  else order_.defer(b, s);
  return true;
}

void SizeClassPool::deallocate(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!a) throw InvalidPointer("cannot free a null pointer", 0, "null");
  std::vector<std::pair<void*, std::size_t>> detached;
  {
    std::lock_guard<std::mutex> g(mu_);
    check_open();
    Block* b = nullptr;
    if (table_.find(a, b)) {
      if (b->st() != ChunkState::Live)
        throw InvalidPointer(format_ptr(a) + " was already freed (double free; the block is " +
                                 chunk_state_name(b->st()) + ")",
                             a, "double_free");
      // First the step that can throw (recording events): then a failure changes nothing.
      if (s != kNoStream) order_.defer(b, s);
      live_ -= b->requested;
      overhead_ -= b->size - b->requested;
      --live_blocks_;
      if (s == kNoStream) {
        if (free_bytes_ + b->size > opt_.max_cached_bytes) {
          b->drop_used_on();
          retire_locked(b, detached);
        } else {
          make_free_locked(b);
        }
      }
    } else {
      std::string inside;
      table_.for_each([&](std::uintptr_t k, Block* x) {
        if (inside.empty() && a > k && a < k + x->size)
          inside = format_ptr(a) + " points inside the block at " + format_ptr(k) + " (offset " +
                   std::to_string(a - k) + "): free the block's start address";
      });
      if (!inside.empty()) throw InvalidPointer(inside, a, "interior");
      goto foreign;
    }
  }
  free_detached(detached);
  return;
foreign:
  throw_foreign_pointer(a, "is not a block of this pool (never allocated here)");
}

void SizeClassPool::record_stream(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> g(mu_);
  check_open();
  Block* b = nullptr;
  if (!table_.find(a, b) || b->st() != ChunkState::Live)
    throw InvalidPointer("record_stream: " + format_ptr(a) + " is not a live block of this pool", a, "unknown");
  if (s == b->alloc_stream) return;
  if (!b->used_on) b->used_on = new std::vector<Stream>();
  if (std::find(b->used_on->begin(), b->used_on->end(), s) == b->used_on->end()) b->used_on->push_back(s);
}

std::size_t SizeClassPool::process_pending() {
  std::lock_guard<std::mutex> g(mu_);
  return order_.drain([&](BlockRecord* r) { make_free_locked(static_cast<Block*>(r)); });
}

void SizeClassPool::synchronize() {
  std::lock_guard<std::mutex> g(mu_);
  order_.drain([&](BlockRecord* r) { make_free_locked(static_cast<Block*>(r)); }, true);
}

std::size_t SizeClassPool::release_cached() {
  std::vector<std::pair<void*, std::size_t>> detached;
  std::size_t bytes = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    check_open();
    for (std::size_t c = 0; c < free_.size(); ++c)
      while (Block* b = pop_free_locked(static_cast<std::uint32_t>(c))) {
        bytes += b->size;
        retire_locked(b, detached);
      }
  }
  free_detached(detached);
  return bytes;
}

void SizeClassPool::reset_peaks() {
  std::lock_guard<std::mutex> g(mu_);
  peak_reserved_ = reserved_;
  peak_live_ = live_;
}

PoolStats SizeClassPool::stats() {
  std::lock_guard<std::mutex> g(mu_);
  PoolStats st;
  st.reserved = reserved_;
  st.live = live_;
  st.free = free_bytes_;
  st.pending = order_.pending_bytes();
  st.overhead = overhead_;
  st.peak_reserved = peak_reserved_;
  st.peak_live = peak_live_;
  st.live_blocks = live_blocks_;
  st.free_chunks = free_blocks_;
  st.pending_blocks = order_.pending_blocks();
  st.backings = table_.size();
  st.limit = opt_.limit;
  st.pending_by_stream = order_.by_stream();
  for (std::size_t c = free_.size(); c-- > 0;)
    if (free_[c].head) {
      st.largest_free = free_[c].head->size;
      break;
    }
  std::size_t classes = 0;
  for (auto& fl : free_) classes += fl.count ? 1 : 0;
  fill_upstream_counts(st);
  st.extra.emplace_back("hits", hits_);
  st.extra.emplace_back("misses", misses_);
  st.extra.emplace_back("cached_classes", classes);
  st.extra.emplace_back("released_blocks", released_blocks_);
  st.extra.emplace_back("same_stream_reuses", order_.same_stream_reuses());
  st.extra.emplace_back("fences_recorded", order_.fences_recorded());
  st.extra.emplace_back("fences_outstanding", order_.fences_outstanding());
  st.extra.emplace_back("stream_lanes", order_.lanes());
  st.extra.emplace_back("stream_lanes_retired", order_.lanes_retired());
  st.extra.emplace_back("dead_stream_settles", order_.dead_stream_settles());
  st.extra.emplace_back("upstream_free_failures", upstream_free_failures_);
  st.extra.emplace_back("oom_retries", oom_retries_);
  st.extra.emplace_back("table_capacity", table_.capacity());
  return st;
}

void SizeClassPool::validate() {
  std::lock_guard<std::mutex> g(mu_);
  std::size_t r = 0, l = 0, o = 0, f = 0, fb = 0, p = 0, lb = 0;
  table_.for_each([&](std::uintptr_t a, Block* b) {
    if (b->addr != a) throw InvariantViolation("SizeClassPool: table key != block address");
    if (b->size != class_size_for(b->size, opt_.alignment, opt_.classes_per_doubling) ||
        class_index(b->size) != b->cls)
      throw InvariantViolation("SizeClassPool: block size is not its class size");
    if (a % opt_.alignment) throw InvariantViolation("SizeClassPool: misaligned block");
    r += b->size;
    switch (b->st()) {
      case ChunkState::Live:
        if (b->requested > b->size) throw InvariantViolation("SizeClassPool: requested above class size");
        l += b->requested;
        o += b->size - b->requested;
        ++lb;
        break;
      case ChunkState::Free: f += b->size; ++fb; break;
      case ChunkState::Pending: p += b->size; break;
      default: throw InvariantViolation("SizeClassPool: block in an impossible state");
    }
  });
  std::size_t listed = 0, listed_bytes = 0;
  for (std::size_t c = 0; c < free_.size(); ++c) {
    std::size_t n = 0;
    for (Block* b = free_[c].head; b; b = b->next_free, ++n) {
      if (b->cls != c || b->st() != ChunkState::Free) throw InvariantViolation("SizeClassPool: bad free-list entry");
      listed_bytes += b->size;
    }
    if (n != free_[c].count) throw InvariantViolation("SizeClassPool: free-list count mismatch");
    listed += n;
  }
  order_.validate();
  if (r != reserved_) throw InvariantViolation("SizeClassPool: reserved " + std::to_string(reserved_) + " but blocks add to " + std::to_string(r));
  if (l != live_ || o != overhead_ || lb != live_blocks_) throw InvariantViolation("SizeClassPool: live/overhead totals mismatch");
  if (f != free_bytes_ || fb != free_blocks_ || listed != fb || listed_bytes != f)
    throw InvariantViolation("SizeClassPool: free totals mismatch");
  if (p != order_.pending_bytes()) throw InvariantViolation("SizeClassPool: pending totals mismatch");
  if (reserved_ != live_ + free_bytes_ + order_.pending_bytes() + overhead_)
    throw InvariantViolation("SizeClassPool: reserved != live + free + pending + overhead");
  if (table_.size() != nodes_.live() || !table_.consistent())
    throw InvariantViolation("SizeClassPool: pointer table does not match the blocks");
}

void SizeClassPool::close() {
  std::vector<std::pair<void*, std::size_t>> detached;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed()) return;
    if (live_blocks_) {
      std::vector<std::uintptr_t> sample;
      table_.for_each([&](std::uintptr_t a, Block* b) {
        if (b->st() == ChunkState::Live && sample.size() < 8) sample.push_back(a);
      });
      throw LiveBlocksAtClose("cannot close SizeClassPool #" + std::to_string(id_) + ": " +
                                  std::to_string(live_blocks_) + " block(s), " + format_bytes(live_) +
                                  " still live; free them first",
                              live_blocks_, live_, sample);
    }
    order_.drain([&](BlockRecord* r) { make_free_locked(static_cast<Block*>(r)); }, true);
    for (std::size_t c = 0; c < free_.size(); ++c)
      while (Block* b = pop_free_locked(static_cast<std::uint32_t>(c))) retire_locked(b, detached);
    closed_.store(true, std::memory_order_release);
  }
  free_detached(detached);
}

Snapshot SizeClassPool::snapshot() {
  Snapshot snap;
  snap.pool = name();
  snap.upstream = upstream_->name();
  snap.alignment = opt_.alignment;
  snap.stats = stats();
  std::lock_guard<std::mutex> g(mu_);
  table_.for_each([&](std::uintptr_t a, Block* b) {
    BackingInfo bi;
    bi.address = a;
    bi.size = b->size;
    ChunkInfo c;
    c.size = b->size;
    c.state = b->st();
    c.requested = b->requested;
    c.alloc_stream = b->alloc_stream;
    c.last_stream = b->last_stream;
    if (c.state == ChunkState::Pending) order_.describe(b, c.waits_on, c.event);
    bi.chunks.push_back(std::move(c));
    snap.backings.push_back(std::move(bi));
  });
  std::sort(snap.backings.begin(), snap.backings.end(),
            [](const BackingInfo& x, const BackingInfo& y) { return x.address < y.address; });
  return snap;
}

bool SizeClassPool::owns_live(std::uintptr_t p) {
  std::lock_guard<std::mutex> g(mu_);
  Block* b;
  return table_.find(p, b) && b->st() == ChunkState::Live;
}

}  // namespace poolkeeper
