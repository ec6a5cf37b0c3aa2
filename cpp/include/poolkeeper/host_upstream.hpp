// Host: aligned host memory from the C heap. For tests, host-side pools and the staging pool's
// CI path. Thread-safe; throws UpstreamOutOfMemory when the heap refuses.
#pragma once
#include "poolkeeper/upstream.hpp"

namespace poolkeeper {

class HostUpstream final : public Upstream {
 public:
  explicit HostUpstream(std::size_t alignment = 256);
  std::string name() const override { return "Host"; }
  MemoryKind kind() const override { return MemoryKind::Host; }
  std::size_t alignment() const override { return alignment_; }

 protected:
  void* do_allocate(std::size_t nbytes) override;
  void do_deallocate(void* p, std::size_t nbytes) override;

 private:
  std::size_t alignment_;
};

}  // namespace poolkeeper
