// Direct: the pass-through arm. Every allocate is one upstream allocation and every deallocate
// one upstream free, so every comparison has its baseline. It keeps a table of live blocks only
// to refuse bad pointers and to account honestly.
//
// Stream order: Direct holds nothing, so a release goes straight to the upstream (for CudaAsync
// that is a stream-ordered free on the upstream's stream; cuMemFree itself waits for the device).
// Thread-safe (one mutex, guarding the table, the budget and live_). snapshot() is exact during
// traffic: a block leaves the books (table, reserved, live) in the same hold that starts its
// upstream free, and a refused free books it back. close() counts a block in its upstream free
// as live (the upstream may refuse and hand it back). validate() wants a quiet pool.
#pragma once
#include <mutex>
#include <vector>

#include "poolkeeper/detail/budget.hpp"
#include "poolkeeper/detail/node_arena.hpp"
#include "poolkeeper/detail/pointer_table.hpp"
#include "poolkeeper/core/pool.hpp"
#include "poolkeeper/core/stream_order.hpp"

namespace poolkeeper {

struct DirectOptions {
  std::size_t alignment = 256;
  std::size_t limit = 0;  // 0: none
};

class DirectPool final : public Pool {
 public:
  DirectPool(std::shared_ptr<Upstream> upstream, DirectOptions opt = {});
  ~DirectPool() override;

  PoolStats stats() override;
  void reset_peaks() override;
  void validate() override;
  std::size_t trim() override {
    check_open();
    return 0;
  }
  std::size_t process_pending() override { return 0; }
  // Waits for the device. While a capture scope is open on the device it returns at once: Direct
  // has nothing pending to settle, and a device synchronize would invalidate the capture (the
  // other pools' synchronize then settles only what needs no device-wide wait, as trim releases
  // nothing).
  void synchronize() override {
    if (upstream_->captures_underway() == 0) upstream_->synchronize();
  }
  Snapshot snapshot() override;
  std::string name() const override { return "Direct"; }
  std::size_t alignment() const override { return opt_.alignment; }

 private:
  // stats(), and with `blocks` given the live blocks as backings, in one hold of the lock: a
  // snapshot's stats and chunks are one observation (taken apart, a snapshot during traffic failed
  // accounting.check about once in 2,000, found by hostile probing).
  PoolStats stats_impl(std::vector<BackingInfo>* blocks);
  POOLKEEPER_POOL_HOOKS;

  const DirectOptions opt_;
  std::mutex mu_;  // guards everything below
  detail::NodeArena<BlockRecord> nodes_;       // guarded by mu_
  detail::PointerTable<BlockRecord*> table_;  // guarded by mu_: the live blocks
  detail::Budget budget_;                      // guarded by mu_: reserved, in-flight claims, limit
  std::size_t live_ = 0, peak_live_ = 0;       // guarded by mu_
  // guarded by mu_: blocks out of the table while their upstream free runs (a refused free puts
  // one back); close() counts them live. A handful at most: one per thread in deallocate().
  std::vector<BlockRecord*> freeing_;
};

}  // namespace poolkeeper
