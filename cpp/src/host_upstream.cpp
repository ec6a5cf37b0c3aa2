#include "poolkeeper/host_upstream.hpp"

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
  return p;
}

void HostUpstream::do_deallocate(void* p, std::size_t) { std::free(p); }

}  // namespace poolkeeper
