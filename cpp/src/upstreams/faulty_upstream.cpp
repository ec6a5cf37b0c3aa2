#include "poolkeeper/upstreams/faulty_upstream.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

namespace poolkeeper {

FaultyUpstream::FaultyUpstream(std::shared_ptr<Upstream> inner, FaultPlan plan)
    : ForwardingUpstream(std::move(inner)), plan_(std::move(plan)), armed_(plan_.armed) {
  if (!inner_) throw InvalidArgument("Faulty needs an inner upstream");
  std::sort(plan_.fail_at.begin(), plan_.fail_at.end());
  plan_.fail_at.erase(std::unique(plan_.fail_at.begin(), plan_.fail_at.end()), plan_.fail_at.end());
}

bool FaultyUpstream::should_fail(std::uint64_t index, std::size_t nbytes) const {
  if (!armed()) return false;
  if (plan_.fail_every && (index + 1) % plan_.fail_every == 0) return true;
  if (plan_.fail_bytes_over && nbytes > plan_.fail_bytes_over) return true;
  return std::binary_search(plan_.fail_at.begin(), plan_.fail_at.end(), index);
}

void FaultyUpstream::maybe_refuse_alloc(const char* what, std::size_t nbytes) {
  const std::uint64_t i = calls_.fetch_add(1, std::memory_order_relaxed);
  if (!should_fail(i, nbytes)) return;
  injected_allocs_.fetch_add(1, std::memory_order_relaxed);
  if (plan_.refuse_after_us) std::this_thread::sleep_for(std::chrono::microseconds(plan_.refuse_after_us));
  const std::string msg = std::string("injected fault: ") + what + " #" + std::to_string(i) + " of " +
                          format_bytes(nbytes) + " refused by " + name();
  if (plan_.error == FaultPlan::Error::Oom) throw UpstreamOutOfMemory(msg, name(), "POOLKEEPER_INJECTED_OOM", kInjectedCode);
  throw UpstreamFailure(msg, name(), "POOLKEEPER_INJECTED_FAULT", kInjectedCode);
}

void FaultyUpstream::maybe_refuse_free(const char* what, std::uintptr_t p, std::size_t nbytes) {
  if (!plan_.fail_frees) return;
  const std::uint64_t i = calls_.fetch_add(1, std::memory_order_relaxed);
  if (!should_fail(i, nbytes)) return;
  injected_frees_.fetch_add(1, std::memory_order_relaxed);
  if (plan_.refuse_after_us) std::this_thread::sleep_for(std::chrono::microseconds(plan_.refuse_after_us));
  throw UpstreamFailure(std::string("injected fault: ") + what + " #" + std::to_string(i) + " of " + format_ptr(p) +
                            " (" + format_bytes(nbytes) + ") refused by " + name(),
                        name(), "POOLKEEPER_INJECTED_FAULT", kInjectedCode);
}

void* FaultyUpstream::do_allocate(std::size_t nbytes) {
  maybe_refuse_alloc("allocation", nbytes);
  return inner_->allocate(nbytes);
}

void FaultyUpstream::do_deallocate(void* p, std::size_t nbytes) {
  maybe_refuse_free("free", reinterpret_cast<std::uintptr_t>(p), nbytes);
  inner_->deallocate(p, nbytes);
}

void FaultyUpstream::do_map(std::uintptr_t addr, std::size_t bytes) {
  maybe_refuse_alloc("map", bytes);
  inner_->map(addr, bytes);
}

void FaultyUpstream::do_unmap(std::uintptr_t addr, std::size_t bytes) {
  maybe_refuse_free("unmap", addr, bytes);
  inner_->unmap(addr, bytes);
}

void FaultyUpstream::do_alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) {
  maybe_refuse_alloc("alias", bytes);
  inner_->alias(dst, src, bytes);
}

void FaultyUpstream::do_unalias(std::uintptr_t dst, std::size_t bytes) {
  maybe_refuse_free("unalias", dst, bytes);
  inner_->unalias(dst, bytes);
}

}  // namespace poolkeeper
