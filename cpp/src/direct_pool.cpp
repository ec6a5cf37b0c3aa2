#include "poolkeeper/direct_pool.hpp"

#include <algorithm>

namespace poolkeeper {

DirectPool::DirectPool(std::shared_ptr<Upstream> upstream, DirectOptions opt) : Pool(std::move(upstream)), opt_(opt) {
  if (!is_pow2(opt_.alignment))
    throw InvalidArgument("alignment must be a power of two; got " + std::to_string(opt_.alignment));
  join_directory();  // last: the pool is whole now
}

DirectPool::~DirectPool() {
  unregister();
  if (forked()) return;  // its lock may have been held at the fork
  // Live blocks at destruction stay with the user (never freed under them); the rest is gone.
  std::lock_guard<std::mutex> g(mu_);
  table_.for_each([&](std::uintptr_t, BlockRecord* b) { b->drop_used_on(); });
}

void* DirectPool::allocate(std::size_t nbytes, Stream s) {
  check_request(nbytes);
  check_open();
  const std::size_t n = align_up(nbytes, opt_.alignment);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (opt_.limit && reserved_ + claimed_ + n > opt_.limit) {
      OomFigures f;
      f.requested = nbytes;
      f.reserved = reserved_;
      f.live = live_;
      f.limit = opt_.limit;
      f.cause = "limit";
      throw_oom(std::move(f));
    }
    claimed_ += n;  // before the upstream call, so concurrent callers respect the limit
  }
  void* p;
  try {
    p = upstream_alloc(n);
  } catch (const UpstreamOutOfMemory& e) {
    std::lock_guard<std::mutex> g(mu_);
    claimed_ -= n;
    OomFigures f;
    f.requested = nbytes;
    f.reserved = reserved_;
    f.live = live_;
    f.limit = opt_.limit;
    f.cause = "upstream";
    f.upstream_error = e.what();
    throw_oom(std::move(f));
  } catch (...) {
    std::lock_guard<std::mutex> g(mu_);
    claimed_ -= n;
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  claimed_ -= n;
  reserved_ += n;
  BlockRecord* b = nodes_.create();
  b->addr = reinterpret_cast<std::uintptr_t>(p);
  b->size = n;
  b->requested = nbytes;
  b->alloc_stream = b->last_stream = s;
  b->set(ChunkState::Live);
  table_.insert(b->addr, b);
  live_ += nbytes;
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  peak_live_ = std::max(peak_live_, live_);
  return p;
}

void DirectPool::deallocate(void* p, Stream s) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!a) throw InvalidPointer("cannot free a null pointer", 0, "null");
  BlockRecord* b = nullptr;
  std::size_t n = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed()) throw PoolClosed("Direct #" + std::to_string(id_) + " is closed");
    if (table_.find(a, b)) {
      table_.erase(a);
      n = b->size;
    }
  }
  if (!b) {
    std::string inside;
    {
      std::lock_guard<std::mutex> g(mu_);
      table_.for_each([&](std::uintptr_t k, BlockRecord* x) {
        if (inside.empty() && a > k && a < k + x->size)
          inside = format_ptr(a) + " points inside the block at " + format_ptr(k) + " (offset " + std::to_string(a - k) +
                   "): free the block's start address";
      });
    }
    if (!inside.empty()) throw InvalidPointer(inside, a, "interior");
    throw_foreign_pointer(a, "is not a live block (never allocated here, or already freed)");
  }
  try {
    upstream_free(p, n);
  } catch (...) {
    // The upstream kept the memory: the block is live again, nothing is lost from the books.
    std::lock_guard<std::mutex> g(mu_);
    table_.insert(a, b);
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  reserved_ -= n;
  live_ -= b->requested;
  b->drop_used_on();
  nodes_.destroy(b);
}

void DirectPool::record_stream(void* p, Stream s) {
  std::lock_guard<std::mutex> g(mu_);
  check_open();
  BlockRecord* b = nullptr;
  if (!table_.find(reinterpret_cast<std::uintptr_t>(p), b))
    throw InvalidPointer("record_stream: " + format_ptr(reinterpret_cast<std::uintptr_t>(p)) + " is not live",
                         reinterpret_cast<std::uintptr_t>(p), "unknown");
  b->last_stream = s;
}

void DirectPool::reset_peaks() {
  std::lock_guard<std::mutex> g(mu_);
  peak_reserved_ = reserved_;
  peak_live_ = live_;
}

PoolStats DirectPool::stats() {
  std::lock_guard<std::mutex> g(mu_);
  PoolStats st;
  st.reserved = reserved_;
  st.live = live_;
  st.overhead = reserved_ - live_;
  st.peak_reserved = peak_reserved_;
  st.peak_live = peak_live_;
  st.live_blocks = table_.size();
  st.backings = table_.size();
  st.limit = opt_.limit;
  fill_upstream_counts(st);
  return st;
}

void DirectPool::validate() {
  std::lock_guard<std::mutex> g(mu_);
  std::size_t r = 0, l = 0, n = 0;
  table_.for_each([&](std::uintptr_t a, BlockRecord* b) {
    if (b->addr != a || b->st() != ChunkState::Live) throw InvariantViolation("Direct: table entry mismatch");
    if (b->requested > b->size) throw InvariantViolation("Direct: requested above block size");
    r += b->size;
    l += b->requested;
    ++n;
  });
  if (r != reserved_ || l != live_ || n != nodes_.live())
    throw InvariantViolation("Direct: reserved/live totals do not match the live blocks");
  if (!table_.consistent()) throw InvariantViolation("Direct: pointer table counts inconsistent");
}

void DirectPool::close() {
  std::lock_guard<std::mutex> g(mu_);
  if (closed()) return;
  if (table_.size()) {
    std::vector<std::uintptr_t> sample;
    table_.for_each([&](std::uintptr_t a, BlockRecord*) {
      if (sample.size() < 8) sample.push_back(a);
    });
    throw LiveBlocksAtClose("cannot close Direct #" + std::to_string(id_) + ": " + std::to_string(table_.size()) +
                                " block(s), " + format_bytes(live_) + " still live; free them first",
                            table_.size(), live_, sample);
  }
  closed_.store(true, std::memory_order_release);
}

Snapshot DirectPool::snapshot() {
  Snapshot snap;
  snap.pool = name();
  snap.upstream = upstream_->name();
  snap.alignment = opt_.alignment;
  snap.stats = stats();
  std::lock_guard<std::mutex> g(mu_);
  table_.for_each([&](std::uintptr_t a, BlockRecord* b) {
    BackingInfo bi;
    bi.address = a;
    bi.size = b->size;
    ChunkInfo c;
    c.size = b->size;
    c.requested = b->requested;
    c.state = ChunkState::Live;
    c.alloc_stream = b->alloc_stream;
    c.last_stream = b->last_stream;
    bi.chunks.push_back(c);
    snap.backings.push_back(std::move(bi));
  });
  std::sort(snap.backings.begin(), snap.backings.end(),
            [](const BackingInfo& x, const BackingInfo& y) { return x.address < y.address; });
  return snap;
}

bool DirectPool::owns_live(std::uintptr_t p) {
  std::lock_guard<std::mutex> g(mu_);
  BlockRecord* b;
  return table_.find(p, b);
}

}  // namespace poolkeeper
