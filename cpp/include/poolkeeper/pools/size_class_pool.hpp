// SizeClassPool: a request is rounded up to its size class and served from that class's free
// list; a miss is one upstream allocation of exactly the class size.
//
// - Classes: `classes_per_doubling` (k) geometric steps between consecutive powers of two, above
//   the alignment: rounding waste < 1/k of the request. Sizes up to 2^62.
// - Shards (issue 20: many threads at once). The pool is split into `shards` independent parts,
//   each with its own lock, free lists, stream order and counters; a thread works in its own
//   shard (threads are numbered on first use, round robin). Every block belongs to exactly one
//   shard (Block::shard), where it is counted live, free or pending, so each shard's books
//   balance on their own at every observation point. A miss in the caller's shard first moves
//   free blocks of the class from another shard before asking the upstream (the shards whose lock
//   is free at once first; if none had one and some were busy, each in turn, waiting, locks in
//   index order), so sharding never grows the footprint while another shard holds a fitting block.
// - Cross-thread frees. A stream-less free of a block of another thread's shard (or of the
//   caller's own shard while its lock is busy) takes no lock: it claims the block (Live -> Remote,
//   one compare-exchange on the block's state: a second free of it fails there and is reported by
//   the locked path) and pushes it on that shard's `remote` list (one more compare-exchange on a
//   cache line of its own). Whoever next holds that shard's lock files the list -- the shard's
//   books move the blocks from live to free then -- so the next allocation of the class in that
//   shard reuses them, and the freeing thread never touches the shard's lock, counters or free
//   lists (the cache lines the allocating thread works on). The list is filed before a miss
//   looks elsewhere (the own shard's, then each other shard's before its blocks are borrowed),
//   before a new per-shard live peak is taken, and at every observation point (AllLocks: stats,
//   validate, snapshot, close, reset_peaks), by trim(), process_pending() and synchronize(), and
//   nothing pushed on it is ever lost to the pool. Until filed, a Remote block is live in its
//   shard's books, and every observation counts it so (a claim that lands while an observation
//   holds the locks, or whose push has not happened yet, cannot be filed by it). A free on
//   a stream takes the block's shard lock (stream bookkeeping lives there).
// - Live and cached blocks are held in one open-addressing PointerTable (no heap traffic per
//   insert/erase once grown), so a double free is told from an unknown pointer. It is read
//   lock-free (a free finds its block without any shared lock) and written only on upstream
//   calls, under grow_mu_; a lock-free miss is confirmed under every lock before it is an error.
// - Upstream calls run outside every lock: release_cached() detaches under the locks and frees
//   after (cuMemFree synchronizes the device). Event work (fences, multi-stream releases) stays
//   under the shard lock that owns the block's stream order: one shard, not the whole pool.
// - Stream order through the shared StreamOrder component, one per shard.
//
// Invariants (validate(), after filing every remote list; Remote blocks count as live): per
// shard and in total, reserved == live + free + pending + overhead;
// every free-list block is Free, of its class and of that shard; table size == live + free +
// pending blocks; pending totals match; the shards' reserved bytes add to the pool's.
// peak_live is exact while one thread uses the pool; with several it is the largest of what one
// shard held and of every stats()/validate() observation (a lower bound of the true peak).
// Thread safety: all members may be called concurrently; stats() and snapshot() are exact
// observations during other threads' traffic, validate() and close() want a quiet pool.
// Freeing a block the caller does not own while another thread frees or trims it is outside the
// contract (as with any allocator); a double free in sequence is always reported.
// Locks: shard locks in index order, then grow_mu_. Each SpinMutex spins briefly, then parks.
// The remote lists take no lock to push; they are emptied only under their shard's lock.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "poolkeeper/detail/budget.hpp"
#include "poolkeeper/detail/node_arena.hpp"
#include "poolkeeper/detail/pointer_table.hpp"
#include "poolkeeper/detail/spin_mutex.hpp"
#include "poolkeeper/core/pool.hpp"
#include "poolkeeper/core/stream_order.hpp"

namespace poolkeeper {

// Largest alignment a SizeClassPool accepts (its class table is sized from it).
inline constexpr std::size_t kMaxSizeClassAlignment = std::size_t{1} << 30;

struct SizeClassOptions {
  std::size_t alignment = 256;
  std::size_t classes_per_doubling = 4;
  // Cap on cached free bytes: 0 caches nothing (every release goes upstream), SIZE_MAX: no cap.
  std::size_t max_cached_bytes = SIZE_MAX;
  std::size_t limit = 0;             // 0: none
  std::size_t shards = 0;            // independent parts (rounded up to a power of two); 0: auto
};

class SizeClassPool final : public Pool {
 public:
  SizeClassPool(std::shared_ptr<Upstream> upstream, SizeClassOptions opt = {});
  ~SizeClassPool() override;

  // Hits only, and only when the caller's shard lock is free right now (try_lock): the caller
  // holds the GIL, so it must never wait here. Anything else (a miss, contention, an error) takes
  // the full path.
  void* try_allocate_fast(std::size_t nbytes, Stream s) override;
  bool try_deallocate_fast(void* p, Stream s) override;
  PoolStats stats() override;
  void reset_peaks() override;
  void validate() override;
  std::size_t trim() override { return release_cached(); }
  std::size_t process_pending() override;
  void synchronize() override;
  Snapshot snapshot() override;
  std::string name() const override { return "SizeClassPool"; }
  std::size_t alignment() const override { return opt_.alignment; }

  // Free every cached block to the upstream. Returns bytes freed.
  std::size_t release_cached();
  // The class size a request of nbytes is rounded to.
  static std::size_t class_size_for(std::size_t nbytes, std::size_t alignment, std::size_t per_doubling);
  std::size_t class_index(std::size_t rounded) const;

 private:
  // stats(), and with `blocks` given every block as a backing, under one hold of every lock: a
  // snapshot's stats and chunks are one observation (taken apart, a snapshot during traffic failed
  // accounting.check 420 times in 2,000, found by hostile probing). A Remote block is reported
  // live, as the books count it.
  PoolStats stats_impl(std::vector<BackingInfo>* blocks);
  POOLKEEPER_POOL_HOOKS;

  // alignas: one block's record never shares a cache line with another's, so threads working on
  // their own blocks do not invalidate each other's lines.
  struct alignas(64) Block : BlockRecord {
    // Guarded by the owning shard's lock while the block is on a free list; on a remote list it
    // is the link, written by the pushing thread before its release and read by the filer after
    // its acquire (the block is Free and on no free list then).
    Block* next_free = nullptr;
    std::uint32_t cls = 0;
    // The owning shard. Changes only while the block is Free, under both shards' locks; atomic
    // because a free reads it before it knows which lock to take.
    std::atomic<std::uint32_t> shard{0};
    std::uint32_t home() const { return shard.load(std::memory_order_relaxed); }
  };
  struct FreeList {
    Block* head = nullptr;
    std::size_t count = 0;
  };
  using Detached = std::vector<std::pair<void*, std::size_t>>;
  // One independent part of the pool. Every field is guarded by mu (alignas: no false sharing).
  struct alignas(64) Shard {
    Shard(Upstream* up, std::uint32_t i) : index(i), order(up) {}
    const std::uint32_t index;
    detail::SpinMutex mu;
    std::vector<FreeList> free;  // by class index
    StreamOrder order;
    std::size_t reserved = 0, live = 0, overhead = 0, free_bytes = 0, free_blocks = 0, live_blocks = 0;
    std::size_t peak_live = 0;
    std::uint64_t hits = 0, migrated = 0, remote_frees = 0;
    // Blocks freed lock-free into this shard, not yet filed (a stack: push by compare-exchange,
    // emptied whole by exchange under mu). On a cache line of its own: the pushing threads write
    // it, and the owner's lock and counters stay on lines only it writes.
    alignas(64) std::atomic<Block*> remote{nullptr};
  };
  using Guard = std::lock_guard<detail::SpinMutex>;
  // Every shard lock (index order), then grow_mu_: an observation point of the whole pool. Files
  // every remote list, so the observation sees each lock-free free pushed by then as done (one
  // claimed later stays Remote, live in the books, until the next lock holder files it).
  struct AllLocks {
    explicit AllLocks(SizeClassPool* p);
    ~AllLocks();
    SizeClassPool* p;
  };

  Shard& my_shard();
  std::uint32_t my_shard_index() const;
  // Lock-free free (stream-less): claim b (Live -> Remote) and push it on its shard's remote list.
  // False: b is not a live block at a (the locked path decides), or the cache cap refuses.
  bool free_remote(Block* b, std::uintptr_t a);
  // sh locked: file sh's remote list (live -> free in sh's books). Returns blocks filed.
  std::size_t file_remote_locked(Shard& sh);
  void make_free_locked(Shard& sh, Block* b, bool counted = false);
  void retire_locked(Shard& sh, Block* b, Detached& out);  // + grow_mu_
  Block* pop_free_locked(Shard& sh, std::uint32_t cls);
  void* serve_hit_locked(Shard& sh, Block* b, std::size_t nbytes, Stream s);
  // sh locked through g (released and retaken when another shard's lock must come first).
  Block* steal_locked(std::unique_lock<detail::SpinMutex>& g, Shard& sh, std::uint32_t cls, std::size_t csize, Stream s);
  Block* take_from_locked(Shard& sh, Shard& o, std::uint32_t cls, std::size_t csize, Stream s);
  std::size_t detach_all_free(Detached& out, bool drain);  // every shard's free blocks, retired
  void free_detached(Detached& v);
  void release_block_locked(Shard& sh, Block* b, Stream s, Detached& out);

  SizeClassOptions opt_;
  unsigned shift_;  // log2(classes_per_doubling)
  std::size_t nclasses_ = 0;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::uint32_t shard_mask_ = 0;
  // Taken after the shard locks.
  mutable detail::SpinMutex grow_mu_;
  detail::NodeArena<Block> nodes_;      // guarded by grow_mu_
  detail::PointerTable<Block*> table_;  // written under grow_mu_; read lock-free
  detail::Budget budget_;               // guarded by grow_mu_: reserved, in-flight claims, limit
  std::size_t peak_live_ = 0;           // guarded by grow_mu_ (with every shard lock: stats/reset)
  std::uint64_t misses_ = 0, released_blocks_ = 0, upstream_free_failures_ = 0, oom_retries_ = 0;  // guarded by grow_mu_
  // Bytes in every shard's free lists; kept only with a max_cached_bytes cap (a shared counter
  // every free would write otherwise).
  std::atomic<std::size_t> cached_total_{0};
  // max_cached_bytes: SIZE_MAX (the default) is no cap; any other value, 0 included, caps.
  bool capped() const { return opt_.max_cached_bytes != SIZE_MAX; }
};

}  // namespace poolkeeper
