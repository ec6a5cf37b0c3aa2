// FaultyUpstream: an Upstream decorator that makes chosen calls fail, so tests can show what a
// pool does when its upstream refuses (rolls back, reports a typed error, keeps serving).
//
// Which calls are watched: every allocate, and every deallocate too when fail_frees is set. Each
// watched call gets the next index 0, 1, 2, ... (one sequence for both kinds, counted whether or
// not the plan is armed). A watched call fails when the plan is armed and ANY rule matches:
//   fail_every = N  (N > 0): the N-th, 2N-th, ... watched call (index + 1 divisible by N);
//   fail_at         : the listed indices;
//   fail_bytes_over = B (B > 0): a call for more than B bytes.
// A failing call never reaches the inner upstream. An allocation fails with UpstreamOutOfMemory
// (error = Oom, "POOLKEEPER_INJECTED_OOM") or UpstreamFailure (error = Failure,
// "POOLKEEPER_INJECTED_FAULT"); a free always fails with UpstreamFailure (the memory stays with
// the upstream, as a refused cuMemFree leaves it). Error code: kInjectedCode. With
// refuse_after_us, a refused call first sleeps that long (a driver call that fails after its
// work), so a test can act on the pool while a refused call is under way.
//
// Virtual memory is forwarded when the inner upstream has it: a map is watched like an
// allocation (same index sequence, same rules, same errors; a refused map maps nothing) and an
// unmap like a free (watched only with fail_frees). reserve/unreserve are never refused. Aliases
// (a second mapping of mapped memory) are forwarded too: an alias is watched like a map (same
// errors), an unalias like an unmap.
//
// Everything else -- name, kind, device, alignment, and (ForwardingUpstream) the whole stream
// interface and the capture state -- is the inner upstream's, so a pool over Faulty(Simulated)
// keeps its virtual streams and its captures.
// Thread safety: every member may be called concurrently (atomic counters; the plan's rules are
// fixed at construction, only `armed` changes).
#pragma once
#include <atomic>
#include <memory>
#include <vector>

#include "poolkeeper/core/forwarding_upstream.hpp"

namespace poolkeeper {

struct FaultPlan {
  enum class Error { Oom, Failure };
  std::uint64_t fail_every = 0;          // 0: rule off
  std::vector<std::uint64_t> fail_at;    // watched-call indices
  std::size_t fail_bytes_over = 0;       // 0: rule off
  bool fail_frees = false;               // watch deallocate calls too
  Error error = Error::Oom;              // how an allocation fails
  bool armed = true;                     // initial state of the switch
  std::uint64_t refuse_after_us = 0;     // a refused call sleeps this long before it throws
};

class FaultyUpstream final : public ForwardingUpstream {
 public:
  static constexpr int kInjectedCode = 990;

  // Throws InvalidArgument for a null inner upstream.
  FaultyUpstream(std::shared_ptr<Upstream> inner, FaultPlan plan);

  std::string name() const override { return "Faulty(" + inner_->name() + ")"; }
  MemoryKind kind() const override { return inner_->kind(); }
  int device() const override { return inner_->device(); }
  std::size_t alignment() const override { return inner_->alignment(); }
  bool supports_virtual() const override { return inner_->supports_virtual(); }
  bool supports_alias() const override { return inner_->supports_alias(); }
  std::size_t vm_granularity() const override { return inner_->vm_granularity(); }
  std::size_t memory_capacity() const override { return inner_->memory_capacity(); }

  const FaultPlan& plan() const { return plan_; }
  bool armed() const { return armed_.load(std::memory_order_acquire); }
  void set_armed(bool on) { armed_.store(on, std::memory_order_release); }

  std::uint64_t calls() const { return calls_.load(std::memory_order_relaxed); }  // watched calls so far
  std::uint64_t injected() const { return injected_allocs_.load(std::memory_order_relaxed) + injected_frees_.load(std::memory_order_relaxed); }
  std::uint64_t injected_allocations() const { return injected_allocs_.load(std::memory_order_relaxed); }
  std::uint64_t injected_deallocations() const { return injected_frees_.load(std::memory_order_relaxed); }

 protected:
  void* do_allocate(std::size_t nbytes) override;
  void do_deallocate(void* p, std::size_t nbytes) override;
  std::uintptr_t do_reserve(std::size_t bytes) override { return inner_->reserve(bytes); }
  void do_map(std::uintptr_t addr, std::size_t bytes) override;
  void do_unmap(std::uintptr_t addr, std::size_t bytes) override;
  void do_unreserve(std::uintptr_t addr, std::size_t bytes) override { inner_->unreserve(addr, bytes); }
  void do_alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) override;
  void do_unalias(std::uintptr_t dst, std::size_t bytes) override;

 private:
  void maybe_refuse_alloc(const char* what, std::size_t nbytes);
  void maybe_refuse_free(const char* what, std::uintptr_t p, std::size_t nbytes);
  bool should_fail(std::uint64_t index, std::size_t nbytes) const;

  FaultPlan plan_;  // fail_at sorted
  std::atomic<bool> armed_;
  std::atomic<std::uint64_t> calls_{0}, injected_allocs_{0}, injected_frees_{0};
};

}  // namespace poolkeeper
