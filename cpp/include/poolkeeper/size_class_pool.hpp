// SizeClassPool: a request is rounded up to its size class and served from that class's free
// list; a miss is one upstream allocation of exactly the class size.
//
// - Classes: `classes_per_doubling` (k) geometric steps between consecutive powers of two, above
//   the alignment: rounding waste < 1/k of the request. Sizes up to 2^62.
// - Live and cached blocks are held in one open-addressing PointerTable (no heap traffic per
//   insert/erase once grown), so a double free is told from an unknown pointer.
// - release_cached() detaches every cached block under the lock and frees upstream outside it:
//   cuMemFree synchronizes the device, and holding a mutex across it would stall every thread.
// - Stream order through the shared StreamOrder component.
//
// Invariants (validate()): reserved == live + free + pending + overhead; every free-list block is
// Free and of its class; table size == live + free + pending blocks; pending totals match.
// Thread safety: one mutex; the critical section is a table probe and a list pop.
#pragma once
#include <mutex>
#include <vector>

#include "poolkeeper/detail/node_arena.hpp"
#include "poolkeeper/detail/pointer_table.hpp"
#include "poolkeeper/pool.hpp"
#include "poolkeeper/stream_order.hpp"

namespace poolkeeper {

// Largest alignment a SizeClassPool accepts (its class table is sized from it).
inline constexpr std::size_t kMaxSizeClassAlignment = std::size_t{1} << 30;

struct SizeClassOptions {
  std::size_t alignment = 256;
  std::size_t classes_per_doubling = 4;
  // Cap on cached free bytes: 0 caches nothing (every release goes upstream), SIZE_MAX: no cap.
  std::size_t max_cached_bytes = SIZE_MAX;
  std::size_t limit = 0;             // 0: none
};

class SizeClassPool final : public Pool {
 public:
  SizeClassPool(std::shared_ptr<Upstream> upstream, SizeClassOptions opt = {});
  ~SizeClassPool() override;

  void* allocate(std::size_t nbytes, Stream s) override;
  void deallocate(void* p, Stream s) override;
  // Hits only, and only when the lock is free right now (try_lock): the caller holds the GIL, so
  // it must never wait here. Anything else (a miss, contention, an error) takes the full path.
  void* try_allocate_fast(std::size_t nbytes, Stream s) override;
  bool try_deallocate_fast(void* p, Stream s) override;
  void record_stream(void* p, Stream s) override;
  PoolStats stats() override;
  void reset_peaks() override;
  void validate() override;
  std::size_t trim() override { return release_cached(); }
  std::size_t process_pending() override;
  void synchronize() override;
  void close() override;
  Snapshot snapshot() override;
  bool owns_live(std::uintptr_t p) override;
  std::string name() const override { return "SizeClassPool"; }
  std::size_t alignment() const override { return opt_.alignment; }

  // Free every cached block to the upstream. Returns bytes freed.
  std::size_t release_cached();
  // The class size a request of nbytes is rounded to.
  static std::size_t class_size_for(std::size_t nbytes, std::size_t alignment, std::size_t per_doubling);
  std::size_t class_index(std::size_t rounded) const;

 private:
  struct Block : BlockRecord {
    Block* next_free = nullptr;
    std::uint32_t cls = 0;
  };
  struct FreeList {
    Block* head = nullptr;
    std::size_t count = 0;
  };
  void make_free_locked(Block* b);
  void retire_locked(Block* b, std::vector<std::pair<void*, std::size_t>>& out);
  Block* pop_free_locked(std::uint32_t cls);
  void* serve_hit_locked(Block* b, std::size_t nbytes, Stream s);
  void free_detached(std::vector<std::pair<void*, std::size_t>>& v);
  OomFigures figures_locked(std::size_t requested, const char* cause) const;

  SizeClassOptions opt_;
  unsigned shift_;  // log2(classes_per_doubling)
  mutable std::mutex mu_;
  detail::NodeArena<Block> nodes_;
  detail::PointerTable<Block*> table_;
  std::vector<FreeList> free_;  // by class index
  StreamOrder order_;
  std::size_t claimed_ = 0;  // bytes of upstream calls in flight: count against the limit, not reserved
  std::size_t reserved_ = 0, live_ = 0, overhead_ = 0, free_bytes_ = 0, free_blocks_ = 0;
  std::size_t peak_reserved_ = 0, peak_live_ = 0, live_blocks_ = 0;
  std::uint64_t hits_ = 0, misses_ = 0, released_blocks_ = 0, upstream_free_failures_ = 0, oom_retries_ = 0;
};

}  // namespace poolkeeper
