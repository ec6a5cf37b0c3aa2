#include "poolkeeper/arena_pool.hpp"

namespace poolkeeper {
namespace detail { class ArenaCore {}; }
ArenaPool::ArenaPool(std::shared_ptr<Upstream> upstream, ArenaOptions) : Pool(std::move(upstream)) { throw Error("ArenaPool: not built yet"); }
ArenaPool::~ArenaPool() = default;
void* ArenaPool::allocate(std::size_t, Stream) { return nullptr; }
void ArenaPool::deallocate(void*, Stream) {}
void* ArenaPool::try_allocate_fast(std::size_t, Stream) { return nullptr; }
bool ArenaPool::try_deallocate_fast(void*, Stream) { return false; }
void ArenaPool::record_stream(void*, Stream) {}
PoolStats ArenaPool::stats() { return {}; }
void ArenaPool::validate() {}
std::size_t ArenaPool::trim() { return 0; }
std::size_t ArenaPool::process_pending() { return 0; }
void ArenaPool::synchronize() {}
void ArenaPool::close() {}
Snapshot ArenaPool::snapshot() { return {}; }
bool ArenaPool::owns_live(std::uintptr_t) { return false; }
std::size_t ArenaPool::alignment() const { return 256; }
std::size_t ArenaPool::shrink_scan() { return 0; }
void ArenaPool::flush_thread_cache() {}
}
