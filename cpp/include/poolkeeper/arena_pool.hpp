// ArenaPool: large backings from the upstream, sliced into chunks. Upstream calls scale with the
// high-water footprint, not with the allocation count (seed 002).
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
//   by it (they are pending for everyone else).
// - Shrink: every shrink_interval locked operations, a scan coalesces and counts, per backing,
//   consecutive scans in which it was wholly free; at shrink_hysteresis it goes back upstream.
// - Bookkeeping nodes (chunks, tree nodes) come from node arenas, never the heap on the hot path.
//
// Invariants (validate()):
//   reserved == live + free + pending + overhead  (thread caches included)
//   chunks tile each backing exactly; every indexed chunk is Free and indexed once; after a
//   coalesce pass no two address-adjacent chunks are both Free; the pointer table holds exactly
//   the Live and ThreadCached chunks; pending totals match the stream-order lanes.
// Thread safety: all members may be called concurrently; validate() and close() need quiescence.
#pragma once
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "poolkeeper/detail/node_arena.hpp"
#include "poolkeeper/detail/pointer_table.hpp"
#include "poolkeeper/pool.hpp"
#include "poolkeeper/stream_order.hpp"

namespace poolkeeper {

struct ArenaOptions {
  std::size_t alignment = 256;
  std::size_t initial_backing = std::size_t{2} << 20;
  std::size_t max_backing = std::size_t{256} << 20;
  double growth_factor = 2.0;
  std::size_t thread_cache_bytes = std::size_t{8} << 20;  // per thread; 0 disables
  std::size_t thread_cache_max_block = std::size_t{1} << 20;
  std::size_t shrink_hysteresis = 2;
  std::size_t shrink_interval = 4096;  // locked operations between automatic scans; 0: never
  std::size_t limit = 0;
};

namespace detail {
struct ArenaChunk;
struct ArenaBacking;
class ThreadCache;
class ArenaCore;
}  // namespace detail

class ArenaPool final : public Pool {
 public:
  ArenaPool(std::shared_ptr<Upstream> upstream, ArenaOptions opt = {});
  ~ArenaPool() override;

  void* allocate(std::size_t nbytes, Stream s) override;
  void deallocate(void* p, Stream s) override;
  void* try_allocate_fast(std::size_t nbytes, Stream s) override;
  bool try_deallocate_fast(void* p, Stream s) override;
  void record_stream(void* p, Stream s) override;
  PoolStats stats() override;
  void validate() override;
  std::size_t trim() override;
  std::size_t process_pending() override;
  void synchronize() override;
  void close() override;
  Snapshot snapshot() override;
  bool owns_live(std::uintptr_t p) override;
  std::string name() const override { return "ArenaPool"; }
  std::size_t alignment() const override;

  // One automatic shrink scan, now. Returns bytes released.
  std::size_t shrink_scan();
  // Return the calling thread's cached blocks to the pool.
  void flush_thread_cache();

 private:
  std::unique_ptr<detail::ArenaCore> core_;
};

}  // namespace poolkeeper
