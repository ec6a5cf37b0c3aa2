#include "poolkeeper/upstreams/host_upstream.hpp"

#include <cstdlib>

namespace poolkeeper {

HostUpstream::HostUpstream(std::size_t alignment) : alignment_(alignment) {
  if (!is_pow2(alignment) || alignment < sizeof(void*))
    throw InvalidArgument("Host upstream alignment must be a power of two >= " + std::to_string(sizeof(void*)) +
                          "; got " + std::to_string(alignment));
}

void* HostUpstream::do_allocate(std::size_t nbytes) {
  if (nbytes == 0 || nbytes > kMaxRequest)
    throw UpstreamOutOfMemory("host heap cannot provide " + format_bytes(nbytes), "Host", "ENOMEM", 12);
  void* p = std::aligned_alloc(alignment_, align_up(nbytes, alignment_));
  if (!p) throw UpstreamOutOfMemory("host heap refused " + format_bytes(nbytes), "Host", "ENOMEM", 12);
  try {
    std::lock_guard<detail::ForkSafeMutex> g(mu_);
    live_.emplace(reinterpret_cast<std::uintptr_t>(p), nbytes);
  } catch (...) {
    std::free(p);
    throw;
  }
  return p;
}

void HostUpstream::do_deallocate(void* p, std::size_t nbytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  {
    std::lock_guard<detail::ForkSafeMutex> g(mu_);
    auto it = live_.find(a);
    if (it == live_.end() || it->second != nbytes) {
      const std::string why = it == live_.end()
                                  ? "not a live allocation of this upstream (unknown, already freed, or inside a block)"
                                  : "allocated with " + format_bytes(it->second) + ", freed with " + format_bytes(nbytes);
      throw UpstreamFailure("host heap: invalid free of " + format_ptr(a) + " (" + format_bytes(nbytes) + "): " + why,
                            "Host", "EINVAL", 22);
    }
    live_.erase(it);
  }
  std::free(p);
}

}  // namespace poolkeeper
