// Host: aligned host memory from the C heap. For tests, host-side pools and the staging pool's
// CI path. Thread-safe; throws UpstreamOutOfMemory when the heap refuses.
//
// It remembers every live allocation and its size, so a raw deallocate() of a pointer it did not
// hand out (or no longer holds), or with another size, is an UpstreamFailure (EINVAL) and changes
// nothing -- as on Simulated -- instead of corrupting the C heap (glibc aborts the process) or
// wrapping the outstanding-bytes counter.
#pragma once
#include <mutex>

#include "poolkeeper/detail/fork_safe_mutex.hpp"
#include <unordered_map>

#include "poolkeeper/core/upstream.hpp"

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
  detail::ForkSafeMutex mu_;  // free in a forked child (see fork_safe_mutex.hpp)
  std::unordered_map<std::uintptr_t, std::size_t> live_;  // address -> requested bytes
};

}  // namespace poolkeeper
