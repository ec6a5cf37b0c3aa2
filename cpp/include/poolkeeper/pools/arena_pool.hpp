// ArenaPool: large backings from the upstream, sliced into chunks. Upstream calls scale with the
// high-water footprint, not with the allocation count (docs/design.md).
//
// Structure
// - Backings: a doubling ramp initial_backing * growth^k up to max_backing, then max_backing
//   each; a request above max_backing gets its own oversize backing. The first non-oversize
//   backing is resident: never shrunk, so a steady small workload keeps a warm arena.
// - Each backing is an address-ordered doubly linked chunk list that tiles it exactly.
// - Free index: 128 exact-size fast bins (chunk sizes alignment*1 .. alignment*128) with a
//   two-word occupancy bitmap, plus a (size, address) ordered tree for everything else. An
//   occupied exact bin is already the best fit; otherwise the tree's lower_bound is.
// - Deferred coalescing: deallocate files a chunk in its bin/tree and returns. Merging runs in one
//   pass over dirty backings only when a request cannot be served from what is indexed, so a loop
//   cycling through a few sizes never merges (counter: coalesce_passes).
// - Thread cache (thread_cache.hpp): exact-size blocks per thread in front of everything; a hit
//   takes no lock. Blocks released on a stream are cached tagged with that stream and reused only
//   by it (they are pending for everyone else). With several caches, a full cache hands a bin to
//   a transfer cache and a dry one takes it from there (transfer_cache.hpp), under a lock of
//   their own; the pool's lock is taken only when that has nothing to give or no room.
// - Shrink: every shrink_interval locked releases, a scan counts, per backing, consecutive scans
//   in which it was wholly free; at shrink_hysteresis it goes back upstream. Bytes on their way
//   back still count against the limit until the upstream accepts them (a refused free is
//   re-adopted, so the books never lose bytes and never pass the limit).
// - Bookkeeping nodes (chunks, tree nodes) come from node arenas, never the heap on the hot path.
// - Backings come from a BackingSource (backing_source.hpp): separate upstream allocations (the
//   ramp above), or one virtual range. The policy code here does not know which.
// - Expandable mode (option `expandable`, docs/expandable.md): instead of separate backings the
//   pool reserves ONE virtual range of va_bytes from an upstream with virtual memory and maps
//   physical pieces into it (map_piece bytes at most per map call): no waste between backings,
//   a free run merges with new growth, steps are small (max(need, mapped * step_fraction) clamped
//   to [granularity, max_step]). Wholly free pieces anywhere in the range (never a piece with a
//   live, pending or thread-cached byte; never the first piece; never during a capture scope) are
//   unmapped by trim(), by shrink scans after shrink_hysteresis scans, at OOM recovery and, with
//   release_on_grow, before a growth; growth refills the lowest hole that fits first. Every
//   backing is a segment (a run of consecutive mapped pieces); holes between segments carry no
//   chunk. reserved_bytes = mapped bytes. Extra invariants: segments cover exactly the mapped
//   pieces not lent to a stitched range, never touch, and lie inside the range. With `stitch`,
//   wholly free pieces may be mapped a second time into a stitched range (a backing of its own
//   outside the range) instead of growing; each piece is then tiled by chunks in exactly one place.
// - Single-stream mode (option `single_stream`, docs/stream_order.md "One stream"): while every
//   allocation names the home stream (the first one seen), a release on home of a block used on
//   home alone is filed Free at once instead of pending (home's later work is ordered after it;
//   no other stream can be served meanwhile: the fast path refuses them and the locked path ends
//   the mode first). `home_dirty_` marks memory the device may still be using; before any of it
//   goes upstream (trim, OOM recovery, close, synchronize) the pool waits for home
//   (home_barrier_locked); the paths that need not release (a growth's release_on_grow and
//   stitched-range teardowns, a free's teardown) skip instead (the virtual source checks
//   home_dirty_ at each unmap and unalias); automatic shrink scans never wait either: while home
//   releases are unsettled each records an event on home, and the next scan releases only memory
//   free since the previous one, once that event has completed (home_fence_; a scan a capture
//   scope kept from counting records none and keeps the epoch); ending the mode waits once (or,
//   while home is being captured, turns every free chunk pending on home).
//
// Invariants (validate()):
//   reserved == live + free + pending + overhead  (thread and transfer caches included)
//   chunks tile each backing exactly; every indexed chunk is Free and indexed once; after a
//   coalesce pass no two address-adjacent chunks are both Free; the pointer table holds exactly
//   the Live and ThreadCached chunks; pending totals match the stream-order lanes; the transfer
//   cache is empty when fewer than two thread caches are left; home releases are unsettled only
//   while single-stream mode lasts with a home, and the mode runs on one shard; no chunk is
//   Freeing outside the lock hold of the free (or carve) that set it.
// A chunk leaves Live only through one compare-exchange (the cache free, the remote push, the
// locked frees' claim), so two threads freeing one block at once cannot both file it.
// Shards (option `shards`, docs/threads.md): requests above thread_cache_max_block are served by
// the calling thread's home shard. Shard 0 is this object's own books (thread caches included);
// shards 1..n-1 are inner ArenaPools (made on first use, no thread cache, no limit, no resident
// backing) with their own lock, free index, stream order and backings. Threads get homes round
// robin on their first visit, so a pool used by one thread never leaves shard 0. A free goes to
// the shard that owns the block (found by lock-free pointer-table probes, decided again under
// the locks before it becomes an error; a thread whose home is another shard pushes it on the
// owner's remote-free list instead, one CAS, and the owner files it the next time it holds its
// lock: a shard's books stay in its owner's CPU cache instead of moving to every thread that frees
// there); a home shard that cannot reuse borrows from the others
// with try_lock before it grows; a failed growth trims the other shards and retries once.
// Each shard's books balance on their own, so stats() (the sum) balances too; peaks are then the
// sum of the shards' peaks (an upper bound). With a limit (one budget) there is one shard.
// Thread safety: all members may be called concurrently; validate() and close() need quiescence.
// One lock per shard (mu_, a SpinMutex) for everything outside the thread caches; a shard lock is
// never held while another is taken, except by close() (shard 0, then an inner one). Upstream frees run after it is
// released (free_detached); a new separate backing is allocated with the lock let go (its bytes
// claimed in the budget first); the expandable arena's map/unmap call the upstream under the
// growing shard's lock only (docs/threads.md).
#pragma once
#include <algorithm>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "poolkeeper/pools/backing_source.hpp"
#include "poolkeeper/detail/arena_types.hpp"
#include "poolkeeper/detail/budget.hpp"
#include "poolkeeper/detail/free_index.hpp"
#include "poolkeeper/detail/node_arena.hpp"
#include "poolkeeper/detail/pointer_table.hpp"
#include "poolkeeper/detail/spin_mutex.hpp"
#include "poolkeeper/detail/thread_cache.hpp"
#include "poolkeeper/detail/transfer_cache.hpp"
#include "poolkeeper/core/pool.hpp"
#include "poolkeeper/core/stream_order.hpp"

namespace poolkeeper {

struct ArenaOptions {
  std::size_t alignment = 256;
  std::size_t initial_backing = std::size_t{2} << 20;
  std::size_t max_backing = std::size_t{128} << 20;
  double growth_factor = 1.5;
  // Per thread; 0 disables. Covers the common large classes too (a round of 8 blocks of 2 MiB fits):
  // with many threads, everything above the cache meets on the pool lock. 64 MiB, not 32: a thread
  // that frees blocks another thread allocated receives them out of phase with its own allocations,
  // and at 32 MiB its cache overflowed into the shared books at every other round (docs/threads.md,
  // "The cache budget").
  std::size_t thread_cache_bytes = std::size_t{64} << 20;
  std::size_t thread_cache_max_block = std::size_t{2} << 20;
  std::size_t shrink_hysteresis = 2;
  std::size_t shrink_interval = 4096;  // locked releases between automatic scans; 0: never
  std::size_t limit = 0;
  // Requests above this get an oversize backing of their own (clamped to max_backing). Large
  // blocks then do not fragment the ramp backings, and a freed one is a whole hole for the next.
  std::size_t oversize_threshold = std::size_t{32} << 20;
  // Expandable (virtual-memory) backing; needs upstream->supports_virtual() (else InvalidArgument).
  bool expandable = false;
  std::size_t va_bytes = 0;       // range to reserve; 0: the upstream's memory_capacity() (1 TiB if unknown)
  double step_fraction = 0.0625;  // growth step as a fraction of what is mapped
  // Cap on the fraction, not on what a request lacks. 8 MiB, not 64: the last step's overshoot is
  // what sets the peak on fragmenting runs (BERT replay 1.209x -> 1.149x peak reserved / peak live,
  // random_lifetime 1.246x -> 1.139x) for ~1.5x the map calls (benchmarks/expandable_peak.py).
  std::size_t max_step = std::size_t{8} << 20;
  // Expandable: largest physical piece one map call creates (0: a growth step is one piece).
  // Only whole pieces can be unmapped, so smaller pieces free holes sooner for more map calls.
  std::size_t map_piece = 0;
  // Expandable: unmap wholly free pieces anywhere in the range (trim, shrink scans, OOM recovery)
  // and refill the lowest holes first; false: only the free tail is unmapped.
  bool reclaim_holes = true;
  // Expandable: before mapping more, unmap the wholly free pieces the request could not use.
  bool release_on_grow = false;
  // Expandable, upstreams with aliases (upstream.hpp): when nothing contiguous fits, map wholly
  // free pieces a second time, end to end, into a fresh range instead of mapping more memory
  // (backing_source_virtual.cpp, docs/expandable.md). Ignored by upstreams without aliases.
  bool stitch = true;
  // Expandable with stitch: most pieces one stitched range joins (each is one upstream alias call).
  std::size_t stitch_max_parts = 16;
  // Expandable with stitch: only a request of at least this many bytes is stitched; a smaller one
  // grows. Each stitch lends free pieces out of the main range and leaves holes there that a
  // contiguous run (a KV cache growing step by step) can no longer extend into; a small request
  // gains little by it (docs/expandable.md, "Stitching moves on").
  std::size_t stitch_from = 0;
  // Expandable with stitch: a request of at least this many bytes may stitch the free pieces of
  // the run at the growth's edge too (0: never). A growth there maps only what that run lacks;
  // stitching it instead maps nothing now, and the next growth maps in full what extending the run
  // would have mapped in part. For large requests (a batch's activations) stitching wins, for a
  // KV cache's step-by-step growth growing does (docs/expandable.md, "Stitching moves on").
  std::size_t stitch_edge_from = 0;
  // Expandable with stitch: when the wholly free pieces fall short of a request that may stitch
  // (stitch_from), but by less than a growth would map, map only what they lack and stitch them
  // with it. Saves what the growth would have mapped beside them; costs an alias per piece of
  // the request (docs/expandable.md, "Top-ups and homecomings").
  bool stitch_top_up = false;
  // Expandable with stitch: a stitched range may also begin with the free end of a piece whose
  // start still holds memory in use, and end with the free start of another: those bytes are
  // lent, the rest of each piece stays in the main range. A request that whole free pieces fall
  // short of by less than that then maps a granule or two less (docs/expandable.md, "Fragments").
  bool stitch_fragments = false;
  // Expandable with stitch: Stale aliases (a moved piece's old mapping) left mapped at most; past
  // it, the next growth or shrink scan unmaps every one that queued work can no longer reach (the
  // free of a stitched range's last block, that range's). Below it one goes only when its piece is
  // unmapped, on trim, OOM recovery or close, or once more than half the stitch area is spoken
  // for. An alias holds no memory, and unmapping one is a driver call that rewrites the device's
  // page tables (docs/expandable.md, "Stale aliases stay"). 0: every such pass unmaps them, as
  // before the option.
  std::size_t stale_alias_cap = 4096;
  // Arena shards for requests above thread_cache_max_block (docs/threads.md): 0 = one per hardware
  // thread, at most 16; 1 = one lock for everything. Forced to 1 with a limit, without a cache, or
  // with single_stream.
  std::size_t shards = 0;
  // One stream (docs/stream_order.md, "One stream"): while every allocation names the same stream
  // (the pool's home, the first stream it sees), a block released on it is free at once, as in
  // PyTorch's allocator, instead of pending until a fence: it merges with its free neighbours and
  // best fit sees it. The first allocation on another stream or without one waits, once, for
  // the home stream to pass its releases, and the mode ends. Memory goes back to the upstream
  // (trim, OOM recovery, close, release_on_grow) only after such a wait; automatic shrink scans
  // wait for nothing: each records an event on home, and the next releases what was free at both
  // scans once that event has completed.
  bool single_stream = false;
};

class ArenaPool final : public Pool {
 public:
  ArenaPool(std::shared_ptr<Upstream> upstream, ArenaOptions opt = {});
  ~ArenaPool() override;

  // Lock-free: served from / parked into the calling thread's cache, or nullptr/false.
  void* try_allocate_fast(std::size_t nbytes, Stream s) override;
  bool try_deallocate_fast(void* p, Stream s) override;
  // The locked reuse path if the pool lock is free at once (no growth, no settling of pending
  // releases, no shrink scan, no event recording: those may call the upstream or wait).
  void* try_allocate_locked_nowait(std::size_t nbytes, Stream s) override;
  bool try_deallocate_locked_nowait(void* p, Stream s) override;
  PoolStats stats() override;
  void reset_peaks() override;
  void validate() override;
  std::size_t trim() override;
  std::size_t process_pending() override;
  void synchronize() override;
  Snapshot snapshot() override;
  std::string name() const override { return "ArenaPool"; }
  std::size_t alignment() const override { return opt_.alignment; }

  // Hand out exactly [p, p + nbytes rounded to the alignment) as a live block on stream s, as if
  // allocate() had chosen it. For CUDA-graph trees' checkpoint restore (GraphPools::reclaim_next):
  // a graph baked the address in, so only that address will do. Settles first: every thread's
  // cache, the pending releases (waited for unless a capture scope is open on the upstream, where
  // a wait would join the graph) and, in single-stream mode, home's releases; a request on
  // another stream ends that mode first, as allocate() does. The range must lie
  // inside one Free chunk; else InvalidPointer (nothing changes). A pool of several shards is
  // refused (InvalidArgument): a block there belongs to the shard of the thread that made it.
  // Thread safety: any thread, under the pool lock. Never calls the upstream.
  void* allocate_at(void* p, std::size_t nbytes, Stream s);

  // One automatic shrink scan, now. Returns bytes released.
  std::size_t shrink_scan();
  // Return the calling thread's cached blocks to the pool.
  void flush_thread_cache();
  // Thread-exit hook (internal): fold a dying thread's cache into the pool.
  void on_thread_exit(detail::ThreadCache* tc);
  // Shards in use (1 + inner shards made so far).
  std::size_t shards_in_use() const;

 private:
  POOLKEEPER_POOL_HOOKS;

  struct ShardTag {};
  // An inner shard: shares the parent's id (its errors name the parent), joins no directory or
  // thread-exit registry, keeps no resident backing.
  ArenaPool(std::shared_ptr<Upstream> upstream, ArenaOptions opt, ShardTag, std::uint64_t parent_id);
  ArenaPool* shard(std::size_t i);         // inner shard i (1..nshards_-1), made on first use
  ArenaPool* existing_shard(std::size_t i) const { return shards_[i - 1].load(std::memory_order_acquire); }
  ArenaPool* home_shard();                 // nullptr: this thread's home is shard 0
  ArenaPool* owner_shard(std::uintptr_t a);  // lock-free probe; nullptr: shard 0 or nobody
  void* allocate_in_shard(ArenaPool* home, std::size_t nbytes, Stream s);
  [[noreturn]] void oom_of_pool(ArenaPool* home, std::size_t nbytes);  // in a catch block only
  std::size_t trim_shards(const ArenaPool* except);  // trim every shard but `except`; bytes freed
  // These books' locked free (do_deallocate's body for one shard): Refusal::Unknown when p is not
  // in these books, so the caller can ask the other shards.
  Refusal deallocate_here(std::uintptr_t a, Stream s);
  // A free from a thread whose home is another shard: pushed onto this shard's remote-free list
  // with one CAS, no lock (false: not such a free; the locked path decides). Lock-free.
  bool push_remote(std::uintptr_t a, Stream s, std::uint32_t caller_home);
  std::uint32_t caller_home() const;  // the calling thread's home shard (~0u: none yet)
  void drain_remote_locked();  // the remote-free list into the books (under mu_)
  bool record_here(std::uintptr_t a, Stream s);  // do_record_stream for one shard
  std::size_t trim_own();  // trim() of shard 0 alone
  void* try_reuse_nowait(std::size_t nbytes, Stream s);  // try_allocate_locked_nowait on these books only
  Snapshot snapshot_locked();
  // The backing sources work on the arena's books under its lock (backing_source.hpp).
  friend class detail::SeparateBackings;
  friend class detail::VirtualRange;
  using Detached = detail::Detached;
  using LimitHit = detail::LimitHit;
  detail::ThreadCache* cache_locked();
  void flush_cache_locked(detail::ThreadCache* tc);
  void flush_bins_locked(detail::ThreadCache* tc, std::size_t size);  // size 0: every bin
  bool uncache_locked(detail::ArenaChunk* c);  // a cached chunk back into the books; true: filed free
  void refill_cache_locked(std::size_t rounded);   // batches between caches and books (several threads)
  // c claimed (Freeing) by the caller's locked free: cached now (true), or still Freeing.
  bool spill_and_cache_locked(detail::ArenaChunk* c, Stream s, bool nowait = false);
  // c (found at address a) into tc's bins, claimed from `from` by one compare-exchange (Live: a
  // lock-free free racing other frees of c; Freeing: a locked free's own claim). False: not taken,
  // c as it was. tc is the caller's own cache, inside its fast-path scope or under mu_.
  bool cache_free(detail::ThreadCache* tc, detail::ArenaChunk* c, std::uintptr_t a, Stream s, ChunkState from);
  // Between caches without the pool's lock (transfer_cache.hpp); tc is the caller's own cache,
  // inside its fast-path scope. hand_over: one bin of `size` (free for every stream) out of tc;
  // take_over: up to a bin of `size` into an empty bin of tc (returned, or nullptr).
  bool hand_over(detail::ThreadCache* tc, std::size_t size);
  // (s: the request's stream, for single-stream mode's check.)
  detail::ThreadCache::Bin* take_over(detail::ThreadCache* tc, std::size_t size, Stream s);
  // The free fast path's bin for a chunk of `size` released on s when the hinted bin will not do
  // (tc is the caller's own cache, inside its fast-path scope); nullptr: the locked path serves.
  detail::ThreadCache::Bin* free_bin_slow(detail::ThreadCache* tc, std::size_t size, Stream s);
  std::size_t flush_transfer_locked();  // every transferred chunk back into the books; bytes
  std::size_t file_transfer_slot_locked(detail::TransferCache::Slot& slot);  // xfer_.mu held; bytes filed
  // No slot for chunks of `size` in the transfer cache: the least recently used one back into
  // the books. False: a slot was there already (or nothing to evict).
  bool evict_transfer_locked(std::size_t size);
  std::size_t reclaim_caches_locked();  // every thread's cache, idle owners included; bytes moved
  void fold_cache_locked(detail::ThreadCache* tc);
  void file_free_locked(detail::ArenaChunk* c);
  detail::ArenaChunk* split_locked(detail::ArenaChunk* c, std::size_t rounded);
  void* carve_locked(detail::ArenaChunk* c, std::size_t rounded, std::size_t nbytes, Stream s);
  void* make_live_locked(detail::ArenaChunk* c, std::size_t nbytes, Stream s);
  void* carve_pending_locked(detail::ArenaChunk* c, std::size_t rounded, std::size_t nbytes, Stream s);
  // c (the best free fit, out of the index, or nullptr) or the best fit pending on s, whichever is
  // smaller, carved; nullptr when neither exists.
  void* carve_best_locked(detail::ArenaChunk* c, std::size_t rounded, std::size_t nbytes, Stream s);
  // After a growth of backing `grown` for a request on stream s that counted chunks pending on s
  // (BackingSource::grow): the smallest run of address neighbours there, each free or pending on
  // s alone, that holds `rounded` bytes, merged into one chunk pending on s (for
  // carve_pending_locked); nullptr if none.
  detail::ArenaChunk* take_stream_run_locked(detail::ArenaBacking* grown, Stream s, std::size_t rounded);
  // Room for a request on s: c is free, or pending on s alone (s may use its own releases at once).
  // No stream, no pending room: lane_stream() names no stream for blocks pending on several
  // streams or held for a capture, and kNoStream would match them.
  bool stream_room_locked(const detail::ArenaChunk* c, Stream s) const;
  void* reuse_locked(std::size_t rounded, std::size_t nbytes, Stream s);
  void unlive_locked(detail::ArenaChunk* c);
  void release_live_locked(detail::ArenaChunk* c, Stream s, Detached& out);  // c claimed (Freeing)
  void coalesce_locked();
  // c takes in its next neighbour (the caller has already added its size): the list, the later
  // hand-out (used_epoch) and the node. join_next_locked is the bare step (a growth joining a
  // segment uses it); swallow_next_locked also counts a merge.
  void join_next_locked(detail::ArenaChunk* c);
  void swallow_next_locked(detail::ArenaChunk* c);
  bool same_lane_pending(const detail::ArenaChunk* a, const detail::ArenaChunk* b) const;
  void note_pending_locked(detail::ArenaChunk* c);
  detail::ArenaBacking* adopt_locked(std::uintptr_t addr, std::size_t size, bool oversize, bool resident);
  void release_backing_locked(detail::ArenaBacking* b, Detached& out);
  // counted: set when the backing source counted its free scans (false while a capture scope is
  // open, or when trim could not wait for home).
  std::size_t release_free_backings_locked(Detached& out, bool hysteresis, bool* counted = nullptr);
  void free_detached(Detached& d);
  void tick_locked(Detached& out);
  std::size_t scan_locked(Detached& out);  // one shrink scan: hysteresis release, then a new epoch
  void settle_locked();
  void drain_locked(bool wait);
  PoolStats stats_locked();
  void note_peak_locked();
  detail::ArenaChunk* chunk_at_locked(std::uintptr_t a) const;  // the chunk holding a, or nullptr
  Refusal locate_locked(std::uintptr_t p);
  OomFigures figures_locked(std::size_t requested);
  // Single-stream mode. note_stream_locked: a request on s (sets the home; false when s ends the
  // mode, the caller then calls end_single_locked, or refuses when it may not wait).
  bool note_stream_locked(Stream s);
  // The home stream has passed every release filed free so far (waits for it on the host). False
  // while a capture scope is open (no event may be recorded then; nothing is released then anyway).
  bool home_barrier_locked();
  void end_single_locked();  // the barrier, then the mode ends for good
  // Shrink scans' settle point (home_fence_): poll the previous scan's event (true: complete; clears
  // home_dirty_ when no home release came after it), record the next one, drop it. Never wait; never
  // during a capture scope (a query may synchronize, an event recorded then joins the graph).
  bool poll_home_fence_locked();
  void fence_home_locked();
  void drop_home_fence_locked();
  // Whether the shrink scan under way may release memory that has sat free and unused for
  // `idle_scans` scans (idle_scans_after), the one rule both backing sources ask: shrink_hysteresis
  // scans, and while home releases are unsettled at least 2 (free at the previous scan too, so every
  // release over it came before that scan's event) with that event complete (fence_passed_).
  bool scan_may_release(std::size_t idle_scans) const {
    if (!home_dirty_) return idle_scans >= opt_.shrink_hysteresis;
    return fence_passed_ && idle_scans >= std::max<std::size_t>(2, opt_.shrink_hysteresis);
  }
  // A release of c on s may be filed free at once (single-stream mode, c used on s alone).
  bool home_release_locked(const detail::ArenaChunk* c, Stream s) const;
  // c, released on home while the mode lasts, into the free index (the device may still use it).
  void file_home_free_locked(detail::ArenaChunk* c);
  // Lock-free, for the thread caches: single-stream mode keeps a request on s off every cache
  // (s is not the home, and the home is set). A pool without the option reads no atomic.
  bool barred_from_caches(Stream s) const {
    if (!opt_.single_stream || !single_active_.load(std::memory_order_acquire)) return false;
    const Stream h = home_.load(std::memory_order_acquire);
    return h != s && h != kNoStream;
  }

  // Set by the constructor, read-only afterwards (read lock-free by the fast paths).
  ArenaOptions opt_;
  bool cache_enabled_;
  bool shard_child_ = false;
  std::uint32_t shard_index_ = 0;  // 0: the pool itself; i: inner shard i
  std::size_t nshards_ = 1;
  // Inner shards: each an ArenaPool with its own lock and books (docs/threads.md).
  std::unique_ptr<std::atomic<ArenaPool*>[]> shards_;  // nshards_-1 inner shards; written under shard_mu_
  std::mutex shard_mu_;                                 // making an inner shard (never under mu_)
  std::atomic<std::size_t> inner_shards_{0};            // inner shards made so far
  std::size_t homes_assigned_ = 0;                      // guarded by mu_
  // The pool lock: guards every field below marked "guarded by mu_", and the chunk records of
  // everything outside the thread caches (what the caches own: thread_cache.hpp). Spins briefly,
  // then parks (spin_mutex.hpp): std::mutex convoyed under many threads.
  mutable detail::SpinMutex mu_;
  // Structure, guarded by mu_.
  detail::NodeArena<detail::ArenaChunk> chunk_nodes_;
  detail::PointerTable<detail::ArenaChunk*> table_;  // Live and ThreadCached chunks
  detail::FreeIndex index_;
  StreamOrder order_;
  std::vector<detail::ArenaBacking*> backings_;  // sorted by address
  std::vector<std::unique_ptr<detail::ThreadCache>> caches_;
  std::unique_ptr<detail::BackingSource> source_;  // separate backings, or one virtual range
  // Bins passed between thread caches (with several caches); its own lock (transfer_cache.hpp).
  detail::TransferCache xfer_;
  // Remote frees (push_remote): a lock-free stack of Remote chunks linked through bin_next, pushed
  // by any thread, taken whole by drain_remote_locked() under mu_.
  std::atomic<detail::ArenaChunk*> remote_head_{nullptr};
  // Written under mu_, read lock-free (relaxed) by the fast paths and stats().
  std::atomic<std::size_t> live_{0};  // slow-path live bytes (caches hold their own deltas)
  std::atomic<std::size_t> ncaches_{0};  // thread caches alive (the fast path's peak estimate needs 1)
  // The books, guarded by mu_ (stats_locked() and validate() read them under it).
  detail::Budget budget_;  // reserved bytes, bytes on their way back, the limit (budget.hpp)
  std::size_t overhead_ = 0, live_blocks_ = 0, dirty_backings_ = 0;
  std::size_t peak_live_ = 0;
  std::size_t ops_since_scan_ = 0;  // guarded by mu_: locked releases since the last shrink scan
  std::uint64_t scan_epoch_ = 1;    // guarded by mu_: shrink scans so far + 1 (ArenaChunk::used_epoch)
  // Single-stream mode. Written under mu_; single_active_ and home_ are also read lock-free by the
  // allocation fast path (which then leaves every stream but home to the locked path).
  std::atomic<bool> single_active_{false};
  std::atomic<Stream> home_{kNoStream};
  bool home_dirty_ = false;  // guarded by mu_: a home release was filed free since the last barrier
  // Automatic shrink's settle point while home releases are unsettled: an event recorded on home at
  // the end of each shrink scan. A scan that finds the previous one's event complete knows home has
  // run past every release filed before that scan, so memory free since then (and handed to no one
  // since) may go upstream without waiting; if no home release came after the event, home_dirty_
  // clears. Guarded by mu_; home_fence_set_ implies home_dirty_.
  EventId home_fence_ = kNullEvent;
  bool home_fence_set_ = false;
  std::uint64_t fence_home_frees_ = 0;  // ev_.home_frees when home_fence_ was recorded
  bool fence_passed_ = false;  // during a shrink scan only: the previous scan's event has completed
  // Event counters for stats() extras.
  struct Events {
    std::uint64_t coalesce_passes = 0, merges = 0, shrink_scans = 0, pressure_passes = 0, oom_retries = 0;
    std::uint64_t backings_created = 0, backings_released = 0, oversize_backings_created = 0,
                  upstream_free_failures = 0;
    std::uint64_t slow_allocs = 0, slow_frees = 0;
    // Locked operations served by the non-blocking path (the caller kept the GIL); also counted slow.
    std::uint64_t nowait_allocs = 0, nowait_frees = 0;
    // Thread caches: flushes, reclaims of other threads' caches, batches (arena_thread_cache.cpp),
    // and the hits/frees of caches folded in when their threads exited.
    std::uint64_t cache_flushes = 0, caches_reclaimed = 0, cache_refills = 0, cache_spills = 0, folded_hits = 0,
                  folded_frees = 0;
    std::uint64_t remote_frees = 0;  // frees filed from the remote-free list
    std::uint64_t stream_runs = 0;   // runs of free and same-stream pending chunks merged instead of growing
    std::uint64_t shard_fallbacks = 0;  // threads sent home to shard 0: their shard could not be made
    std::uint64_t home_frees = 0, home_barriers = 0;  // single-stream mode: releases filed free at once, waits
    std::uint64_t home_settles = 0;  // single-stream mode: home_dirty_ cleared by a scan's event, no wait
  } ev_;  // guarded by mu_
};

}  // namespace poolkeeper
