// Pool: the interface every pool implements (Direct, SizeClassPool, ArenaPool), so the bindings,
// the C ABI registry and the tests treat them alike.
//
// Contracts shared by every pool:
// - allocate(n, s): n > 0 bytes, aligned to the pool's alignment, usable on stream s
//   (kNoStream: usable anywhere once the caller orders it). Throws InvalidArgument (n == 0,
//   n > 2^62), OutOfMemory (after the pool's own recovery), PoolClosed.
// - deallocate(p, s): p must be live in this pool. s = kNoStream: the caller guarantees all device
//   work on the block has completed. s = a stream: work on p was ordered on s; the block is
//   reusable at once on s, and by other streams once an event recorded on s (and on every stream
//   added by record_stream) has completed. Throws InvalidPointer (null, unknown, double free,
//   interior, another pool's) and leaves the pool unchanged.
// - Accounting at one observation point: reserved == live + free + pending + overhead
//   (PoolStats; each pool's header lists how its books add up). validate() checks it with every structural invariant and throws
//   InvariantViolation; call it at a quiescent point (no concurrent allocate/deallocate).
// - Thread safety: all members may be called concurrently, except close(), validate() and
//   snapshot(), which need no concurrent allocate/deallocate on the same pool (ArenaPool's
//   lock-free thread-cache paths change chunk records without the pool lock; stats() stays exact
//   at any time through its seqlocked counters). A pool may promise more: Direct's and
//   SizeClassPool's snapshot() are exact during traffic (their headers say so).
#pragma once
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "poolkeeper/core/errors.hpp"
#include "poolkeeper/core/upstream.hpp"

namespace poolkeeper {

// Remote: freed by a thread whose home is another arena shard and waiting, still counted live, on
// that shard's remote-free list until the shard's owner next holds its lock (arena_pool.hpp).
// Freeing: a locked free (ArenaPool, SizeClassPool) has claimed the block (Live -> Freeing, one
// compare-exchange, so a lock-free free of the same block on another thread cannot take it too)
// and has not filed it yet, or an allocation's carve has taken it and not handed it out yet (so no
// lock-free free can claim it there); never seen outside that lock hold.
enum class ChunkState : std::uint8_t { Free = 0, Live = 1, Pending = 2, ThreadCached = 3, Remote = 4, Freeing = 5 };
const char* chunk_state_name(ChunkState s);

struct PoolStats {
  std::size_t reserved = 0, live = 0, free = 0, pending = 0, overhead = 0;
  std::size_t thread_cached = 0;          // part of free: exact-size blocks parked in thread caches
  std::size_t thread_cached_pending = 0;  // part of pending: cached blocks usable only on their stream
  std::size_t largest_free = 0;
  std::size_t peak_reserved = 0, peak_live = 0;
  std::size_t live_blocks = 0, free_chunks = 0, pending_blocks = 0, backings = 0;
  std::size_t limit = 0;
  std::vector<std::pair<Stream, std::size_t>> pending_by_stream;
  // Per-pool extras (counters of passes, hits, ...): name -> value.
  std::vector<std::pair<std::string, std::uint64_t>> extra;
};

struct ChunkInfo {
  std::size_t offset = 0, size = 0, requested = 0;
  ChunkState state = ChunkState::Free;
  Stream alloc_stream = kNoStream, last_stream = kNoStream;
  EventId event = kNullEvent;  // pending: the event it waits on (kNullEvent: not yet fenced)
  std::vector<Stream> waits_on;  // pending: the streams whose events it waits on
};

struct BackingInfo {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  bool resident = false, oversize = false;
  std::vector<ChunkInfo> chunks;
};

struct Snapshot {
  std::string pool, upstream;
  std::size_t alignment = 0;
  PoolStats stats;
  std::vector<BackingInfo> backings;
};

[[noreturn]] void throw_bad_request(std::size_t nbytes);
// Validates a request size (0 < nbytes <= 2^62); returns it. Throws InvalidArgument with the figure.
inline std::size_t check_request(std::size_t nbytes) {
  if (nbytes - 1 >= kMaxRequest) [[unlikely]] throw_bad_request(nbytes);  // 0 wraps
  return nbytes;
}

// Why a pool's do_deallocate refused a pointer (returned with the pool's lock released):
// Pool::deallocate turns it into the one InvalidPointer text per kind. Trivially destructible, so
// a successful free returns it in registers.
struct Refusal {
  enum Kind : std::uint8_t {
    None,          // freed
    DoubleFree,    // a block of this pool, not live now (state: what it is)
    FreedMemory,   // inside a non-live chunk (block: its start; state: what it is)
    Interior,      // inside a live block (block: its start)
    Unknown,       // not this pool's: Pool names the owner if another pool holds it live
    UnknownOrFreed,// as Unknown, for a pool that forgets a block when it is freed
  } kind = None;
  ChunkState state = ChunkState::Live;
  std::uintptr_t block = 0;
  explicit operator bool() const { return kind != None; }
};

// What close() found still live: the count, the bytes and up to kSample addresses for the error.
struct LiveAtClose {
  static constexpr std::size_t kSample = 8;
  std::size_t blocks = 0, bytes = 0;
  std::vector<std::uintptr_t> sample;
  void note(std::uintptr_t a) {
    if (sample.size() < kSample) sample.push_back(a);
  }
};

// Where free memory can serve a request, for the OOM diagnosis: any free piece as large as the
// request (an arena splits chunks), or only blocks of the request's own size class.
enum class FreeFit : std::uint8_t { AnyPiece, OwnClass };

// The skeleton (RMM's shape): the public allocate/deallocate/record_stream/close are not virtual;
// they check the request, the pool's state and the pointer once, map errors once, and call the
// do_* / find_live hooks each pool implements. The non-blocking and lock-free attempts
// (try_*_nowait, try_*_fast) stay virtual: they are the measured fast paths.
class Pool {
 public:
  explicit Pool(std::shared_ptr<Upstream> upstream);
  virtual ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Inline: a call costs the checks and one virtual call, as it did when allocate was the hook.
  void* allocate(std::size_t nbytes, Stream s) {
    check_request(nbytes);
    check_open();
    return do_allocate(nbytes, s);
  }
  void deallocate(void* p, Stream s) {
    if (!p) [[unlikely]] throw_null_free();
    check_open();
    if (const Refusal r = do_deallocate(p, s)) [[unlikely]] throw_refusal(reinterpret_cast<std::uintptr_t>(p), r);
  }
  // Mark live block p as used on stream s too: its release then also waits for s.
  void record_stream(void* p, Stream s);
  // Free everything. Throws LiveBlocksAtClose (and stays open) while blocks are live. Idempotent.
  void close();
  // Is p a live block of this pool? (used to name the owner of a foreign pointer)
  bool owns_live(std::uintptr_t p) { return find_live(p); }

  // Lock-free attempts used by the bindings while holding the GIL; nullptr/false means "take the
  // full path" (which may block on the pool lock or the upstream, so it runs without the GIL).
  virtual void* try_allocate_fast(std::size_t nbytes, Stream s) { return nullptr; }
  virtual bool try_deallocate_fast(void* p, Stream s) { return false; }
  // Non-blocking attempts for callers that hold a lock of their own (the bindings keep the GIL
  // through them): the fast path, then whatever the pool can do without waiting -- its lock only
  // if it is free at once, never an upstream call, never a wait for the device. nullptr/false:
  // take the blocking path, which also reports errors (these never throw for bad input).
  // Why: a blocking call releases the GIL, and taking it back behind busy Python threads costs
  // tens of microseconds to milliseconds; most misses of a pool with free memory need neither.
  // Inline so a hit costs what it did before: one virtual call, the fast path.
  void* try_allocate_nowait(std::size_t nbytes, Stream s) {
    if (void* r = try_allocate_fast(nbytes, s)) return r;
    return try_allocate_locked_nowait(nbytes, s);
  }
  bool try_deallocate_nowait(void* p, Stream s) { return try_deallocate_fast(p, s) || try_deallocate_locked_nowait(p, s); }
  // The pool-specific second step: what can be done under the pool lock if it is free at once.
  virtual void* try_allocate_locked_nowait(std::size_t nbytes, Stream s) { return nullptr; }
  virtual bool try_deallocate_locked_nowait(void* p, Stream s) { return false; }

  virtual PoolStats stats() = 0;
  // Restart peak_reserved and peak_live from the current reserved and live bytes (what
  // torch.cuda.reset_peak_memory_stats does). Thread-safe; a peak set by a concurrent allocation
  // on another thread's cache may land on either side of the reset.
  virtual void reset_peaks() = 0;
  virtual void validate() = 0;
  // Return every wholly free backing (except a resident one) to the upstream. Returns bytes freed.
  virtual std::size_t trim() = 0;
  // Move pending blocks whose events have completed to free. Returns bytes moved.
  virtual std::size_t process_pending() = 0;
  // Wait for the device, then process_pending(): nothing is pending afterwards. While a capture
  // scope is open on the device (Upstream::captures_underway) no pool synchronizes the device (that
  // would invalidate the capture): the call settles what it can without, and releases held back by
  // the capture stay pending until its scope ends.
  virtual void synchronize() = 0;
  virtual Snapshot snapshot() = 0;
  virtual std::string name() const = 0;
  virtual std::size_t alignment() const = 0;

  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // True in a child process for every pool inherited through fork(): another thread of the parent
  // may have held its lock, or been half-way through an update, at the fork. Such a pool is closed
  // there and refuses every call before touching a lock (the bindings and the C ABI check this,
  // since the pools' own slow paths take their lock first); its destructor frees nothing.
  bool forked() const { return forked_.load(std::memory_order_relaxed); }
  // PoolClosed naming the fork, if forked().
  void check_not_forked() const {
    if (forked()) throw_forked();
  }
  const std::shared_ptr<Upstream>& upstream() const { return upstream_; }
  // The fork child handler's step (pool.cpp): closed, and forked() from now on.
  void mark_forked();
  std::uint64_t id() const { return id_; }
  // The directory's lookup by id: fn(pool, ctx) under the directory lock, so the pool cannot be
  // destroyed meanwhile (lock order: the directory, then a pool's own lock). False when no pool of
  // that id is in the directory, or it was inherited through fork(). (ArenaPool's thread-exit
  // hook folds a dying thread's cache into its pool this way.)
  static bool with_pool(std::uint64_t id, void (*fn)(Pool&, void*), void* ctx);

 protected:
  // ---- the hooks. Called after the checks above: nbytes valid, p non-null, the pool open (as
  // seen without its lock; a pool that must exclude a concurrent close rechecks under it).
  virtual void* do_allocate(std::size_t nbytes, Stream s) = 0;
  // Refusal::None when freed. A refusal leaves the pool unchanged and its lock released (Pool may
  // ask the other pools who owns p).
  virtual Refusal do_deallocate(void* p, Stream s) = 0;
  // Adds s to live block p's streams; false when p is not a live block of this pool.
  virtual bool do_record_stream(void* p, Stream s) = 0;
  // Frees everything and marks the pool closed (mark_closed), unless blocks are live: then fills
  // `live` and returns false, changing nothing.
  virtual bool do_close(LiveAtClose& live) = 0;
  virtual bool find_live(std::uintptr_t p) = 0;

  void check_open() const {
    if (closed_.load(std::memory_order_relaxed)) [[unlikely]]
      throw_closed();
  }
  void mark_closed() { closed_.store(true, std::memory_order_release); }
  // A snapshot's pool, upstream, alignment and stats; the pool adds its backings.
  Snapshot snapshot_head(PoolStats st) const;
  static void sort_backings(Snapshot& s);
  // "ArenaPool #3": how errors name this pool.
  std::string label() const { return name() + " #" + std::to_string(id_); }
  // The process-wide directory (pool.cpp) lists every pool from its constructor's end to its
  // destructor's start: to name the owner of a foreign pointer, and to find a pool by id.
  // Join the directory of open pools. Each most-derived constructor calls it last: a pool in the
  // directory may be asked find_live() by another thread at any moment, so it must be whole.
  void join_directory();
  // Leave the directory of open pools. Derived destructors call it first, so no other thread can
  // ask a half-destroyed pool whether it owns a pointer. Idempotent.
  void unregister();
  // Upstream calls made by this pool, counted per pool (an upstream may serve several pools).
  void* upstream_alloc(std::size_t n) {
    void* p = upstream_->allocate(n);
    up_allocs_.fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  void upstream_free(void* p, std::size_t n) {
    upstream_->deallocate(p, n);
    up_frees_.fetch_add(1, std::memory_order_relaxed);
  }
  // Memory an upstream call handed over after close() had run (close() saw no live block while
  // the call was under way): it goes back to the upstream (a refusal is counted in
  // refused_after_close() and swallowed: the pool is gone) and the allocation raises PoolClosed,
  // rather than hand out a closed pool's block that no deallocate could take back. Called with
  // none of the pool's locks held.
  [[noreturn]] void give_back_after_close(void* p, std::size_t n);
  // Frees give_back_after_close() saw refused (the bytes stay with the upstream): each pool adds
  // them to its stats' upstream_free_failures.
  std::uint64_t refused_after_close() const { return refused_after_close_.load(std::memory_order_relaxed); }
  void fill_upstream_counts(PoolStats& st) const {
    st.extra.emplace_back("upstream_allocations", up_allocs_.load(std::memory_order_relaxed));
    st.extra.emplace_back("upstream_deallocations", up_frees_.load(std::memory_order_relaxed));
    st.extra.emplace_back("ooms", ooms_.load(std::memory_order_relaxed));
  }
  // The one OOM diagnosis, once recovery has failed: classifies f (diagnose_oom) for a request
  // that needed `need` bytes, counts it, and throws OutOfMemory with the text for its cause.
  // limit_hit: the pool's limit refused the growth (rather than the upstream).
  [[noreturn]] void throw_oom(OomFigures f, std::size_t need, bool limit_hit, FreeFit fit);

  std::shared_ptr<Upstream> upstream_;
  std::uint64_t id_;
  // Read relaxed by the fast paths (a hit on a closed pool is refused there, explained here).
  std::atomic<bool> closed_{false};
  // Counters of this pool's upstream calls and OOM errors (PyTorch's num_ooms): relaxed atomics,
  // written by any thread, read by stats().
  std::atomic<std::uint64_t> up_allocs_{0}, up_frees_{0}, ooms_{0}, refused_after_close_{0};

 private:
  [[noreturn]] void throw_forked() const;
  [[noreturn]] void throw_closed() const;
  [[noreturn]] static void throw_null_free();
  // The InvalidPointer for a refusal; for an unknown pointer, names the pool that owns it.
  [[noreturn]] void throw_refusal(std::uintptr_t p, const Refusal& r);

  std::atomic<bool> forked_{false};
};

// Appends a pool's own counters to stats().extra, in the order given.
inline void add_extras(PoolStats& st, std::initializer_list<std::pair<const char*, std::uint64_t>> items) {
  for (const auto& [k, v] : items) st.extra.emplace_back(k, v);
}

// Declares Pool's hooks in a pool class (each pool defines all five in its .cpp); an adaptor that
// forwards to an inner pool (LoggingPool) declares its own.
#define POOLKEEPER_POOL_HOOKS                                      \
  void* do_allocate(std::size_t nbytes, Stream s) override;        \
  Refusal do_deallocate(void* p, Stream s) override;               \
  bool do_record_stream(void* p, Stream s) override;               \
  bool do_close(LiveAtClose& live) override;                       \
  bool find_live(std::uintptr_t p) override

// The cause of an OOM from what the pool holds: enough free or pending memory that could not
// serve the request names why; otherwise the limit or the upstream refused.
OomCause diagnose_oom(const OomFigures& f, std::size_t need, bool limit_hit, FreeFit fit);
// The figures of an OOM error from the pool's stats at the failure.
OomFigures oom_figures(const PoolStats& st, std::size_t requested);


}  // namespace poolkeeper
