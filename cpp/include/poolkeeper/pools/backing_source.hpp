// BackingSource: where an ArenaPool's backings come from, and how they go back.
//
// The arena's policy code (best fit, splitting, deferred coalescing, stream order, thread caches,
// OOM recovery) works on backings tiled exactly by chunks and does not know which source made
// them. Two sources exist:
// - SeparateBackings (default): each backing is one upstream allocation, sized by a doubling ramp
//   (initial_backing * growth_factor^k up to max_backing) or, above oversize_threshold, exactly
//   for the request. A backing goes back whole once wholly free (backing_source_separate.cpp).
// - VirtualRange (option `expandable`): one reserved virtual range; physical pieces are mapped
//   into it and unmapped again (backing_source_virtual.cpp, docs/expandable.md).
//
// Contract: every member runs under the arena's lock (validate()/stats() too; grow() may let go of
// it around its upstream call, below); a source touches
// the arena's books (backings, chunks, free index, reserved bytes, counters) only through the
// arena it was made for. No member may unmap or free while a capture scope is open
// (upstream->captures_underway() > 0): the arena does not call release_free / release_for_oom then,
// and a source must not release from grow().
// Errors: grow() throws LimitHit when the pool's limit forbids the growth (with the growth it
// needed, when the source grows in units larger than the request), the upstream's typed error
// (UpstreamOutOfMemory, UpstreamFailure) when it refuses; in every case the books still satisfy
// validate() (memory mapped before a later refusal stays, filed as free).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mutex>

#include "poolkeeper/detail/arena_types.hpp"
#include "poolkeeper/detail/spin_mutex.hpp"
#include "poolkeeper/core/pool.hpp"

namespace poolkeeper {

class ArenaPool;
struct ArenaOptions;

namespace detail {

class SeparateBackings;
class VirtualRange;

// Growth would pass the pool's limit. need: the least growth that could serve the request, in
// multiples of unit (VirtualRange: whole granules, which may be more than the request and more
// than the limit itself); 0 when that is the request's own rounded size (SeparateBackings).
struct LimitHit {
  std::size_t need = 0, unit = 0;
};

using Detached = std::vector<std::pair<void*, std::size_t>>;

// Every chunk of b is Free (not live, pending or thread-cached). `used`, when given, gets the
// latest epoch in which one of them was handed out (ArenaChunk::used_epoch).
inline bool wholly_free(const ArenaBacking* b, std::uint64_t* used = nullptr) {
  std::uint64_t u = 0;
  for (const ArenaChunk* c = b->first; c; c = c->next_addr) {
    if (c->st() != ChunkState::Free) return false;
    u = std::max(u, c->used_epoch);
  }
  if (used) *used = u;
  return true;
}

// A shrink scan's count for memory (a backing, a piece) of consecutive scans in which it sat free
// and was handed to no one: 0 when it is not free now, 1 when something over it was handed out
// since the last scan (its latest used_epoch is this scan's epoch), else one more than before.
// Every hand-out (a block made live, a thread-cache refill, a cache flush) stamps used_epoch, and
// merges keep the later stamp, so no path has to restart the count itself.
inline std::size_t idle_scans_after(bool free, std::uint64_t last_used, std::uint64_t epoch, std::size_t before) {
  return !free ? 0 : last_used >= epoch ? 1 : before + 1;
}

class BackingSource {
 public:
  explicit BackingSource(ArenaPool& arena) : a_(arena) {}
  virtual ~BackingSource() = default;
  BackingSource(const BackingSource&) = delete;
  BackingSource& operator=(const BackingSource&) = delete;

  // A Free chunk of at least `rounded` bytes, out of the free index (the caller carves it). `g`
  // holds the arena's lock; a source may unlock it for its upstream call and lock it again before
  // it returns or throws (SeparateBackings does: one thread's cuMemAlloc no longer stalls every
  // other thread of the shard). Other threads may then change the books meanwhile, and the pool
  // may have been closed: the source rechecks, gives the memory back and throws PoolClosed.
  // `s`: the request's stream. A source that extends existing memory (VirtualRange) counts a run
  // at the edge it extends of chunks free or pending on s alone (s may use its own releases at
  // once); the chunk returned may then be smaller than `rounded`, and the caller merges it with
  // that run (ArenaPool::take_stream_run_locked).
  virtual ArenaChunk* grow(std::size_t rounded, std::unique_lock<SpinMutex>& g, Stream s) = 0;
  // If another thread's grow() is in its upstream call with the lock let go and its step could
  // also serve `rounded` bytes: wait for it to land (`g` unlocked meanwhile, locked again on
  // return) and return true, so that the caller looks for a fit again before it grows itself.
  // False at once otherwise: the caller grows beside it.
  virtual bool wait_for_growth(std::unique_lock<SpinMutex>&, std::size_t /*rounded*/) { return false; }
  // Give back wholly free memory: everything that can go (hysteresis false: trim) or what stayed
  // free for shrink_hysteresis consecutive scans. Memory put in `out` is freed by the caller
  // outside the lock (a refusal comes back through readopt()); a source that must release under
  // the lock does so here. Returns the bytes released or detached.
  virtual std::size_t release_free(Detached& out, bool hysteresis) = 0;
  // Recovery from a failed growth: give back what would let the retry succeed. Returns bytes.
  virtual std::size_t release_for_oom(Detached& out) = 0;
  // A detached piece the upstream refused to take: back into the books as a wholly free backing.
  virtual ArenaChunk* readopt(void* p, std::size_t n) = 0;
  // close(): nothing is live, cached or pending and every backing is one merged free chunk.
  // Everything goes back (in `out`, or directly); failures are counted, never thrown.
  virtual void close(Detached& out) = 0;
  // Destructor of a pool with live blocks left: give back only what holds nothing live.
  virtual void release_unused(Detached& out) = 0;
  // A block of the backing at `backing_addr` was just released by deallocate() without a stream:
  // a source may give back what that freed (an expandable range tears down a stitched range whose
  // last block it was). By address: the release's shrink scan may already have removed the
  // backing. The non-blocking paths never call the upstream: they leave to deallocate() every
  // release for which wants_release(c) says true (c is the block, claimed by the free: Freeing).
  virtual void released(std::uintptr_t backing_addr) {}
  virtual bool wants_release(const ArenaChunk*) const { return false; }
  // The source's own invariants (the arena checks the chunks, the index and the partition).
  virtual void validate(const std::function<void(const std::string&)>& fail) const = 0;
  // The source's entries in stats().extra.
  virtual void stats(PoolStats& st) const = 0;

 protected:
  ArenaPool& a_;
};

std::unique_ptr<BackingSource> make_separate_backings(ArenaPool& arena);
// Throws InvalidArgument for an upstream without virtual memory or bad options, or the
// upstream's typed error when the range cannot be reserved.
std::unique_ptr<BackingSource> make_virtual_range(ArenaPool& arena);

}  // namespace detail
}  // namespace poolkeeper
