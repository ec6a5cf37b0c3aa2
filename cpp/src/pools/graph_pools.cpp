// GraphPools (graph_pools.hpp): private pools for CUDA-graph captures.
#include "poolkeeper/pools/graph_pools.hpp"

#include <algorithm>
#include <mutex>
#include <vector>

#include <pthread.h>

#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/core/capture.hpp"
#include "poolkeeper/core/forwarding_upstream.hpp"

namespace poolkeeper {

namespace {

// The device pool seen as an upstream: a private pool's backings are blocks of the device pool.
// Stream and capture questions go to the device pool's own upstream (same device, same streams).
class PoolBackedUpstream final : public ForwardingUpstream {
 public:
  explicit PoolBackedUpstream(std::shared_ptr<Pool> parent)
      : ForwardingUpstream(parent->upstream()), parent_(std::move(parent)) {}
  std::string name() const override { return "GraphPool(" + parent_->name() + ")"; }
  MemoryKind kind() const override { return inner_->kind(); }
  int device() const override { return inner_->device(); }
  std::size_t alignment() const override { return parent_->alignment(); }

 protected:
  // kNoStream both ways: a backing is taken free for every stream, and given back only after the
  // device was synchronized (GraphPools closes a private pool after a device synchronize).
  // A backing starts one alignment unit into the device pool's block, so no graph block has the
  // address of a device-pool block: a graph block freed through the device pool by mistake points
  // inside a live block (InvalidPointerError) instead of handing the whole backing back while the
  // graph still serves from it. (The private pool asks for round sizes less the pad, see
  // create_or_use_locked, so the device pool still sees its round sizes.)
  void* do_allocate(std::size_t n) override {
    return static_cast<char*>(parent_->allocate(n + pad_, kNoStream)) + pad_;
  }
  void do_deallocate(void* p, std::size_t) override { parent_->deallocate(static_cast<char*>(p) - pad_, kNoStream); }

 private:
  std::shared_ptr<Pool> parent_;
  std::size_t pad_ = parent_->alignment();
};

// This thread's reclaim_next(): the waiting-count of the GraphPools it is for, the pool, the
// address and the size the next allocation must have. The count is held, not the GraphPools:
// compared, it names the GraphPools (no other can have it while this holds it, even after that
// one is destroyed), and it is given back when the record is dropped, at the latest at thread exit.
struct Reclaim {
  std::shared_ptr<std::atomic<int>> count;
  GraphPoolId id{};
  std::uintptr_t addr = 0;
  std::size_t nbytes = 0;
  Reclaim() = default;
  Reclaim(const Reclaim&) = delete;  // a copy would give the count back twice
  Reclaim& operator=(const Reclaim&) = delete;
  ~Reclaim() { drop(); }
  void drop() noexcept {
    if (!count) return;
    count->fetch_sub(1, std::memory_order_acq_rel);
    count.reset();
  }
};
thread_local Reclaim tl_reclaim;

std::string id_text(GraphPoolId id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

// Every GraphPools, so that the end of the last capture scope on an upstream can close the private
// pools that other GraphPools over it had to leave open (maybe_close_locked): two GraphPools share
// an upstream after the C ABI's device pool was replaced, or when two callers (the CuPy allocator,
// the C ABI) each made one over the same pool. Immortal (a GraphPools may be destroyed during
// exit()); pointers, so that a forked child can start afresh. Lock order: this, then a
// GraphPools's mu_ (nothing takes this under a mu_).
std::mutex* g_all_mu = new std::mutex;
std::vector<GraphPools*>* g_all = new std::vector<GraphPools*>;  // guarded by *g_all_mu
// In the child the parent's GraphPools are left alone (any of their locks may have been held at
// the fork, and they sit over inherited pools, which refuse): the list starts empty, and so does
// its lock (held, maybe, by a thread that did not survive the fork). The old ones leak.
void all_after_fork_in_child() {
  g_all_mu = new std::mutex;
  g_all = new std::vector<GraphPools*>;
}
[[maybe_unused]] const int g_all_atfork = pthread_atfork(nullptr, nullptr, all_after_fork_in_child);

}  // namespace

void GraphPools::close_deferred_everywhere() {
  std::lock_guard<std::mutex> d(*g_all_mu);
  for (GraphPools* g : *g_all) {
    if (!g->deferred_.load(std::memory_order_acquire)) continue;
    std::lock_guard<std::mutex> l(g->mu_);
    if (g->main_->upstream()->captures_underway() > 0) continue;  // the last scope has not ended yet
    g->deferred_.store(false, std::memory_order_release);
    g->close_released_locked();  // sets deferred_ again for a pool that still cannot close
  }
}

GraphPools::GraphPools(std::shared_ptr<Pool> main) : main_(std::move(main)) {
  if (!main_) throw InvalidArgument("GraphPools needs a device pool");
  std::lock_guard<std::mutex> d(*g_all_mu);
  g_all->push_back(this);
}

GraphPools::~GraphPools() {
  {
    std::lock_guard<std::mutex> d(*g_all_mu);  // first: no sweep may reach us any more
    if (auto it = std::find(g_all->begin(), g_all->end(), this); it != g_all->end()) g_all->erase(it);
  }
  // Inherited through fork(): its lock, or its pools', may have been held by a thread the fork
  // left behind. Nothing of it is touched (the private pools, forked too, free nothing).
  if (main_->forked()) return;
  std::vector<Scope> dead;  // filters are destroyed after mu_ is let go (see the header)
  bool ended_scopes = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (std::size_t i = 0; i < scopes_.size(); ++i) main_->upstream()->capture_scope_end();
    ended_scopes = !scopes_.empty();
    dead.swap(scopes_);
    for (auto& [id, pp] : pools_) {
      if (pp.live_blocks) continue;  // still referenced by live blocks: its backings stay live in main
      try {
        pp.pool->close();
      } catch (...) {
        // A destructor cannot report; whatever the pool could not return stays counted in main.
      }
    }
  }
  // Its scopes were the last ones on the upstream: other GraphPools may close what they released.
  if (ended_scopes) {
    try {
      close_deferred_everywhere();
    } catch (...) {
    }
  }
}

GraphPools::Private& GraphPools::create_or_use_locked(GraphPoolId id) {
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    Private pp;
    pp.up = std::make_shared<PoolBackedUpstream>(main_);
    ArenaOptions opt;
    opt.alignment = main_->alignment();
    opt.thread_cache_bytes = 0;  // every block's owner must be known under mu_
    opt.shrink_interval = 0;     // graph memory stays until the pool is released
    // Round sizes less PoolBackedUpstream's pad: the device pool is asked for 2 MiB first, 64 MiB
    // at the cap and a little under 4, 8, ... MiB between, so its cached round blocks serve (a
    // size-class pool would round 2 MiB + pad up to its 2.5 MiB class, a direct pool's cuMemAlloc
    // to 4 MiB, and a cached 2 MiB block could not serve).
    const std::size_t pad = main_->alignment();
    opt.initial_backing = (std::size_t{2} << 20) - pad;
    opt.max_backing = (std::size_t{64} << 20) - pad;
    pp.pool = std::make_shared<ArenaPool>(pp.up, opt);
    it = pools_.emplace(id, std::move(pp)).first;
    ++counters_.pools_created;
  } else if (it->second.released && it->second.uses == 0) {
    it->second.released = false;  // PyTorch may reuse an id; the pool comes back into use
  }
  ++it->second.uses;
  return it->second;
}

void GraphPools::begin(GraphPoolId id, CaptureFilter filter) {
  main_->check_not_forked();  // (see the class comment: fork)
  if (!filter) throw InvalidArgument("GraphPools.begin: a filter is required");
  auto shared = std::make_shared<const CaptureFilter>(std::move(filter));
  std::lock_guard<std::mutex> g(mu_);
  Private& pp = create_or_use_locked(id);
  ++pp.open_scopes;
  scopes_.push_back({id, std::move(shared)});
  main_->upstream()->capture_scope_begin();
  open_.fetch_add(1, std::memory_order_acq_rel);
}

void GraphPools::end(GraphPoolId id) {
  main_->check_not_forked();  // (see the class comment: fork)
  std::shared_ptr<const CaptureFilter> dead;  // destroyed after mu_ is let go (see the header)
  {
    std::lock_guard<std::mutex> g(mu_);
    auto s = std::find_if(scopes_.rbegin(), scopes_.rend(), [&](const Scope& x) { return x.id == id; });
    if (s == scopes_.rend()) throw InvalidArgument("GraphPools.end: no open scope for pool " + id_text(id));
    dead = std::move(s->filter);
    scopes_.erase(std::next(s).base());
    main_->upstream()->capture_scope_end();
    open_.fetch_sub(1, std::memory_order_acq_rel);
    auto it = pools_.find(id);
    if (it != pools_.end()) --it->second.open_scopes;
    // A pool released while a capture was under way could not close then (that would synchronize
    // the device during the capture); the last scope ending is the moment.
    if (scopes_.empty()) close_released_locked();
  }
  // The same for pools other GraphPools over this upstream released during this capture (with
  // mu_ let go: the sweep takes each one's lock).
  if (main_->upstream()->captures_underway() == 0) close_deferred_everywhere();
}

void GraphPools::release(GraphPoolId id) {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) return;  // PyTorch releases ids that never allocated here: nothing to do
  if (it->second.uses > 0) --it->second.uses;
  if (it->second.uses == 0) it->second.released = true;
  maybe_close_locked(it);
}

void GraphPools::maybe_close_locked(std::map<GraphPoolId, Private>::iterator it) {
  Private& pp = it->second;
  if (!pp.released || pp.live_blocks || pp.open_scopes || !scopes_.empty()) return;
  if (main_->upstream()->captures_underway() > 0) {
    // A capture scope of another GraphPools over the same upstream is open (after a device pool
    // swap, or two callers' GraphPools over one pool): the synchronize below would invalidate
    // that capture. The end of the last scope closes this pool (close_deferred_everywhere).
    deferred_.store(true, std::memory_order_release);
    return;
  }
  try {
    {
      // A replay of the graph may still be running: its memory is reusable only once it is done.
      RelaxedCapture relaxed(*main_->upstream());
      main_->upstream()->synchronize();
    }
    pp.pool->close();  // backings back to the device pool, stream-free (the device is idle)
  } catch (...) {
    // The driver refused (the pool stays open, as it was): tried again by the next sweep, at the
    // end of a capture scope or at empty_cache (close_deferred_everywhere), and by release().
    deferred_.store(true, std::memory_order_release);
    throw;
  }
  pools_.erase(it);
  ++counters_.pools_closed;
}

void GraphPools::close_released_locked() noexcept {
  for (auto p = pools_.begin(); p != pools_.end();) {
    try {
      maybe_close_locked(p++);
    } catch (...) {
      // (deferred_ is set) The caller's own step -- a scope ended, a block freed -- is done; the
      // pool that could not close yet is not its failure to report.
    }
  }
}

std::optional<GraphPoolId> GraphPools::route(Stream s) {
  std::vector<Scope> open;
  {
    std::lock_guard<std::mutex> g(mu_);
    open = scopes_;
  }
  for (auto it = open.rbegin(); it != open.rend(); ++it) {
    bool take = false;
    try {
      take = (*it->filter)(s);
    } catch (const CaptureFilterAbort&) {
      throw;
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      ++counters_.filter_errors;  // a filter that cannot answer does not claim the allocation
    }
    if (take) return it->id;
  }
  return std::nullopt;
}

void* GraphPools::allocate(std::size_t nbytes, Stream s) {
  main_->check_not_forked();  // (see the class comment: fork)
  if (routing()) {
    if (tl_reclaim.count == reclaims_ && tl_reclaim.nbytes == nbytes) return allocate_reclaimed(nbytes, s);
    if (const auto id = route(s)) {
      std::lock_guard<std::mutex> g(mu_);
      auto it = pools_.find(*id);
      // The scope may have ended while its filter ran: the allocation then is not the capture's.
      if (it != pools_.end() && it->second.open_scopes > 0) {
        Private& pp = it->second;
        void* p = pp.pool->allocate(nbytes, s);
        owner_.emplace(reinterpret_cast<std::uintptr_t>(p), Owned{it->first, nbytes, s});
        ++pp.live_blocks;
        ++counters_.private_allocations;
        private_blocks_.fetch_add(1, std::memory_order_acq_rel);
        return p;
      }
    }
  }
  if (void* p = main_->try_allocate_fast(nbytes, s)) return p;
  return main_->allocate(nbytes, s);
}

bool GraphPools::deallocate_private(void* p, Stream s) {
  main_->check_not_forked();  // (see the class comment: fork)
  if (!holds_private_blocks()) return false;
  std::lock_guard<std::mutex> g(mu_);
  auto o = owner_.find(reinterpret_cast<std::uintptr_t>(p));
  if (o == owner_.end()) return false;
  auto it = pools_.find(o->second.id);
  it->second.pool->deallocate(p, s);  // throws before anything changes here
  owner_.erase(o);
  --it->second.live_blocks;
  ++counters_.private_deallocations;
  private_blocks_.fetch_sub(1, std::memory_order_acq_rel);
  // The block is freed whatever happens next: a failed close of its released pool is not this
  // free's failure (reported so, a retry was refused as a free inside a live block, and the pool
  // stayed open for good).
  try {
    maybe_close_locked(it);
  } catch (...) {
  }
  return true;
}

void GraphPools::deallocate(void* p, Stream s) {
  if (deallocate_private(p, s)) return;
  if (!main_->try_deallocate_fast(p, s)) main_->deallocate(p, s);
}

bool GraphPools::record_stream_private(void* p, Stream s) {
  main_->check_not_forked();  // (see the class comment: fork)
  if (!holds_private_blocks()) return false;
  std::lock_guard<std::mutex> g(mu_);
  auto o = owner_.find(reinterpret_cast<std::uintptr_t>(p));
  if (o == owner_.end()) return false;
  pools_.at(o->second.id).pool->record_stream(p, s);
  return true;
}

void GraphPools::record_stream(void* p, Stream s) {
  if (!record_stream_private(p, s)) main_->record_stream(p, s);
}

bool GraphPools::has_open_scope(GraphPoolId id) {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  return std::any_of(scopes_.begin(), scopes_.end(), [&](const Scope& sc) { return sc.id == id; });
}

bool GraphPools::has_private_pools() {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  return !pools_.empty();
}

bool GraphPools::owns_private(std::uintptr_t p) {
  main_->check_not_forked();  // (see the class comment: fork)
  if (!holds_private_blocks()) return false;
  std::lock_guard<std::mutex> g(mu_);
  return owner_.count(p) != 0;
}

std::vector<GraphPoolInfo> GraphPools::info() {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  std::vector<GraphPoolInfo> out;
  for (auto& [id, pp] : pools_) {
    GraphPoolInfo i;
    i.id = id;
    i.uses = pp.uses;
    i.open_scopes = pp.open_scopes;
    i.released = pp.released;
    i.live_blocks = pp.live_blocks;
    i.stats = pp.pool->stats();
    out.push_back(std::move(i));
  }
  return out;
}

std::shared_ptr<Pool> GraphPools::private_pool(GraphPoolId id) {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  auto it = pools_.find(id);
  return it == pools_.end() ? nullptr : it->second.pool;
}

std::vector<std::uintptr_t> GraphPools::live_blocks(GraphPoolId id) {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::uintptr_t> out;
  for (auto& [p, owner] : owner_)
    if (owner.id == id) out.push_back(p);
  return out;
}

std::vector<GraphPools::LiveBlock> GraphPools::live_block_info(GraphPoolId id) {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  std::vector<LiveBlock> out;
  for (auto& [p, owner] : owner_)
    if (owner.id == id) out.push_back({p, owner.nbytes, owner.stream});
  std::sort(out.begin(), out.end(), [](const LiveBlock& a, const LiveBlock& b) { return a.addr < b.addr; });
  return out;
}

void GraphPools::reclaim_next(GraphPoolId id, std::uintptr_t addr, std::size_t nbytes) {
  main_->check_not_forked();  // (see the class comment: fork)
  check_request(nbytes);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!pools_.count(id)) throw InvalidArgument("GraphPools.reclaim_next: no graph pool " + id_text(id));
  }
  tl_reclaim.drop();  // this thread's earlier one, whichever GraphPools it named
  reclaims_->fetch_add(1, std::memory_order_acq_rel);
  tl_reclaim.count = reclaims_;
  tl_reclaim.id = id;
  tl_reclaim.addr = addr;
  tl_reclaim.nbytes = nbytes;
}

void GraphPools::reclaim_cancel() {
  if (tl_reclaim.count == reclaims_) tl_reclaim.drop();
}

void* GraphPools::allocate_reclaimed(std::size_t nbytes, Stream s) {
  const GraphPoolId id = tl_reclaim.id;
  const std::uintptr_t addr = tl_reclaim.addr;
  tl_reclaim.drop();  // served or refused, it is used up
  std::lock_guard<std::mutex> g(mu_);
  auto it = pools_.find(id);
  if (it == pools_.end()) throw InvalidArgument("GraphPools: graph pool " + id_text(id) + " is gone (reclaim_next)");
  auto* arena = dynamic_cast<ArenaPool*>(it->second.pool.get());
  void* p = arena->allocate_at(reinterpret_cast<void*>(addr), nbytes, s);
  owner_.emplace(addr, Owned{it->first, nbytes, s});
  ++it->second.live_blocks;
  ++counters_.private_allocations;
  private_blocks_.fetch_add(1, std::memory_order_acq_rel);
  return p;
}

GraphPools::Counters GraphPools::counters() {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  return counters_;
}

void GraphPools::validate() {
  main_->check_not_forked();  // (see the class comment: fork)
  std::lock_guard<std::mutex> g(mu_);
  std::size_t owned = 0;
  for (auto& [id, pp] : pools_) {
    pp.pool->validate();
    const PoolStats st = pp.pool->stats();
    if (st.reserved != pp.up->counters().outstanding_bytes)
      throw InvariantViolation("graph pool " + id_text(id) + " reserves " + format_bytes(st.reserved) +
                               " but holds " + format_bytes(pp.up->counters().outstanding_bytes) +
                               " of the device pool");
    if (st.live_blocks != pp.live_blocks)
      throw InvariantViolation("graph pool " + id_text(id) + ": " + std::to_string(st.live_blocks) +
                               " live blocks, the owner table names " + std::to_string(pp.live_blocks));
    if (pp.uses < 0 || pp.open_scopes < 0 || (pp.released && pp.uses))
      throw InvariantViolation("graph pool " + id_text(id) + ": bad use counts");
    owned += pp.live_blocks;
  }
  if (owned != owner_.size() || owned != private_blocks_.load())
    throw InvariantViolation("graph pools: owner table holds " + std::to_string(owner_.size()) + " blocks, pools " +
                             std::to_string(owned));
  for (auto& [p, o] : owner_) {
    auto it = pools_.find(o.id);
    if (it == pools_.end() || !it->second.pool->owns_live(p))
      throw InvariantViolation("graph pools: " + format_ptr(p) + " is not live in pool " + id_text(o.id));
  }
  for (auto& sc : scopes_)
    if (!pools_.count(sc.id)) throw InvariantViolation("graph pools: an open scope names no pool");
  if (static_cast<int>(scopes_.size()) != open_.load())
    throw InvariantViolation("graph pools: open scope count mismatch");
}

}  // namespace poolkeeper
