// Direct: the pass-through arm. Every allocate is one upstream allocation and every deallocate
// one upstream free, so every comparison has its baseline. It keeps a table of live blocks only
// to refuse bad pointers and to account honestly.
//
// Stream order: Direct holds nothing, so a release goes straight to the upstream (for CudaAsync
// that is a stream-ordered free on the upstream's stream; cuMemFree itself waits for the device).
// Thread-safe (one mutex).
#pragma once
#include <mutex>

#include "poolkeeper/detail/node_arena.hpp"
#include "poolkeeper/detail/pointer_table.hpp"
#include "poolkeeper/pool.hpp"
#include "poolkeeper/stream_order.hpp"

namespace poolkeeper {

struct DirectOptions {
  std::size_t alignment = 256;
  std::size_t limit = 0;  // 0: none
};

class DirectPool final : public Pool {
 public:
  DirectPool(std::shared_ptr<Upstream> upstream, DirectOptions opt = {});
  ~DirectPool() override;

  void* allocate(std::size_t nbytes, Stream s) override;
  void deallocate(void* p, Stream s) override;
  void record_stream(void* p, Stream s) override;
  PoolStats stats() override;
  void reset_peaks() override;
  void validate() override;
  std::size_t trim() override {
    check_open();
    return 0;
  }
  std::size_t process_pending() override { return 0; }
  void synchronize() override { upstream_->synchronize(); }
  void close() override;
  Snapshot snapshot() override;
  bool owns_live(std::uintptr_t p) override;
  std::string name() const override { return "Direct"; }
  std::size_t alignment() const override { return opt_.alignment; }

 private:
  DirectOptions opt_;
  std::mutex mu_;
  detail::NodeArena<BlockRecord> nodes_;
  detail::PointerTable<BlockRecord*> table_;
  std::size_t claimed_ = 0;  // bytes of upstream calls in flight: count against the limit, not reserved
  std::size_t reserved_ = 0, live_ = 0, peak_reserved_ = 0, peak_live_ = 0;
};

}  // namespace poolkeeper
