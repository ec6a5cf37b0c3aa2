#include "poolkeeper/pools/direct_pool.hpp"

#include <algorithm>

namespace poolkeeper {

DirectPool::DirectPool(std::shared_ptr<Upstream> upstream, DirectOptions opt) : Pool(std::move(upstream)), opt_(opt) {
  if (!is_pow2(opt_.alignment))
    throw InvalidArgument("alignment must be a power of two; got " + std::to_string(opt_.alignment));
  budget_.limit = opt_.limit;
  join_directory();  // last: the pool is whole now
}

DirectPool::~DirectPool() {
  unregister();
  if (forked()) return;  // its lock may have been held at the fork
  // Live blocks at destruction stay with the user (never freed under them); the rest is gone.
  std::lock_guard<std::mutex> g(mu_);
  table_.for_each([&](std::uintptr_t, BlockRecord* b) { b->drop_used_on(); });
}

void* DirectPool::do_allocate(std::size_t nbytes, Stream s) {
  const std::size_t n = align_up(nbytes, opt_.alignment);
  bool claimed;
  {
    std::lock_guard<std::mutex> g(mu_);
    claimed = budget_.claim(n);
  }
  if (!claimed) throw_oom(oom_figures(stats(), nbytes), n, true, FreeFit::OwnClass);
  void* p;
  try {
    p = upstream_alloc(n);
  } catch (const UpstreamOutOfMemory& e) {
    {
      std::lock_guard<std::mutex> g(mu_);
      budget_.cancel(n);
    }
    OomFigures f = oom_figures(stats(), nbytes);
    f.upstream_error = e.what();
    throw_oom(std::move(f), n, false, FreeFit::OwnClass);
  } catch (...) {
    std::lock_guard<std::mutex> g(mu_);
    budget_.cancel(n);
    throw;
  }
  std::unique_lock<std::mutex> g(mu_);
  if (closed()) {
    budget_.cancel(n);
    g.unlock();
    give_back_after_close(p, n);
  }
  budget_.commit(n);
  BlockRecord* b = nodes_.create();
  b->addr = reinterpret_cast<std::uintptr_t>(p);
  b->size = n;
  b->requested = nbytes;
  b->alloc_stream = b->last_stream = s;
  b->set(ChunkState::Live);
  table_.insert(b->addr, b);
  live_ += nbytes;
  peak_live_ = std::max(peak_live_, live_);
  return p;
}

Refusal DirectPool::do_deallocate(void* p, Stream) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  BlockRecord* b = nullptr;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!table_.find(a, b)) {
      Refusal r{Refusal::UnknownOrFreed};
      table_.for_each([&](std::uintptr_t k, BlockRecord* x) {
        if (r.kind != Refusal::Interior && a > k && a < k + x->size) r = Refusal{Refusal::Interior, ChunkState::Live, k};
      });
      return r;
    }
    // Out of the books before the upstream call, held against the limit until it returns: a
    // snapshot meanwhile sees neither the block nor its bytes (it saw the bytes reserved with no
    // block to hold them: 178 of 2,000 snapshots during traffic failed accounting.check).
    freeing_.push_back(b);  // first: the one step that can throw (then nothing has changed)
    table_.erase(a);
    budget_.start_release(b->size);
    live_ -= b->requested;
  }
  try {
    upstream_free(p, b->size);
  } catch (...) {
    // The upstream kept the memory: the block is live again, nothing is lost from the books.
    std::lock_guard<std::mutex> g(mu_);
    std::erase(freeing_, b);
    budget_.end_release(b->size);
    budget_.grow(b->size);
    live_ += b->requested;
    // A reset_peaks() during the call set the peak below what the block now adds back.
    peak_live_ = std::max(peak_live_, live_);
    table_.insert(a, b);
    throw;
  }
  std::lock_guard<std::mutex> g(mu_);
  std::erase(freeing_, b);
  budget_.end_release(b->size);
  b->drop_used_on();
  nodes_.destroy(b);
  return {};
}

bool DirectPool::do_record_stream(void* p, Stream s) {
  std::lock_guard<std::mutex> g(mu_);
  BlockRecord* b = nullptr;
  if (!table_.find(reinterpret_cast<std::uintptr_t>(p), b)) return false;
  b->last_stream = s;
  return true;
}

void DirectPool::reset_peaks() {
  std::lock_guard<std::mutex> g(mu_);
  budget_.reset_peak();
  peak_live_ = live_;
}

PoolStats DirectPool::stats() { return stats_impl(nullptr); }

PoolStats DirectPool::stats_impl(std::vector<BackingInfo>* blocks) {
  std::lock_guard<std::mutex> g(mu_);
  if (blocks) table_.for_each([&](std::uintptr_t, BlockRecord* b) { blocks->push_back(block_backing(*b)); });
  PoolStats st;
  st.reserved = budget_.reserved;
  st.live = live_;
  st.overhead = budget_.reserved - live_;
  st.peak_reserved = budget_.peak_reserved;
  st.peak_live = peak_live_;
  st.live_blocks = table_.size();
  st.backings = table_.size();
  st.limit = opt_.limit;
  // A refused free of a live block goes back to its caller; only memory handed over after close()
  // has a refusal the pool swallows.
  add_extras(st, {{"upstream_free_failures", refused_after_close()}});
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
  // A block in its upstream free has a record but no table entry (do_deallocate).
  if (r != budget_.reserved || l != live_ || n + freeing_.size() != nodes_.live())
    throw InvariantViolation("Direct: reserved/live totals do not match the live blocks");
  if (!table_.consistent()) throw InvariantViolation("Direct: pointer table counts inconsistent");
}

bool DirectPool::do_close(LiveAtClose& live) {
  std::lock_guard<std::mutex> g(mu_);
  // A block in its upstream free has left the table but not the pool: the upstream may refuse
  // the free and hand it back. Closing meanwhile put that block back into a closed pool (its
  // bytes reserved for good, found by hostile probing), so close() counts it as still live.
  if (table_.size() || !freeing_.empty()) {
    live.blocks = table_.size() + freeing_.size();
    live.bytes = live_;
    for (BlockRecord* b : freeing_) {
      live.bytes += b->requested;
      live.note(b->addr);
    }
    table_.for_each([&](std::uintptr_t a, BlockRecord*) { live.note(a); });
    return false;
  }
  mark_closed();
  return true;
}

Snapshot DirectPool::snapshot() {
  std::vector<BackingInfo> blocks;
  Snapshot snap = snapshot_head(stats_impl(&blocks));
  snap.backings = std::move(blocks);
  sort_backings(snap);
  return snap;
}

bool DirectPool::find_live(std::uintptr_t p) {
  std::lock_guard<std::mutex> g(mu_);
  BlockRecord* b;
  return table_.find(p, b);
}

}  // namespace poolkeeper
