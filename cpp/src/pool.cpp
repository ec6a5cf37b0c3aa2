#include "poolkeeper/pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <sstream>

namespace poolkeeper {

const char* chunk_state_name(ChunkState s) {
  switch (s) {
    case ChunkState::Free: return "free";
    case ChunkState::Live: return "live";
    case ChunkState::Pending: return "pending";
    case ChunkState::ThreadCached: return "thread_cached";
  }
  return "?";
}

namespace {
// Every open pool, so a pointer freed into the wrong pool can be traced to its owner.
std::mutex g_dir_mu;
std::vector<Pool*>& directory() {
  static std::vector<Pool*> d;
  return d;
}
std::atomic<std::uint64_t> g_next_id{1};

// fork(): the child has only the forking thread. Holding the directory lock across the fork keeps
// the list whole; in the child every pool on it is marked forked (see Pool::forked) before anyone
// can call into one whose lock a vanished thread held.
void fork_prepare() { g_dir_mu.lock(); }
void fork_parent() { g_dir_mu.unlock(); }
void fork_child() {
  for (Pool* p : directory()) p->mark_forked();
  g_dir_mu.unlock();
}
}  // namespace

void Pool::mark_forked() {
  forked_.store(true, std::memory_order_relaxed);
  closed_.store(true, std::memory_order_release);
}

void Pool::throw_forked() const {
  throw PoolClosed(name() + " #" + std::to_string(id_) +
                   " was inherited through fork(): it is closed in the child process (another thread may have "
                   "held its lock at the fork); make a new pool in the child");
}

Pool::Pool(std::shared_ptr<Upstream> upstream) : upstream_(std::move(upstream)), id_(g_next_id++) {
  if (!upstream_) throw InvalidArgument("a pool needs an upstream");
}

void Pool::join_directory() {
  static const int atfork = pthread_atfork(fork_prepare, fork_parent, fork_child);
  (void)atfork;
  std::lock_guard<std::mutex> g(g_dir_mu);
  directory().push_back(this);
}

Pool::~Pool() { unregister(); }

void Pool::unregister() {
  std::lock_guard<std::mutex> g(g_dir_mu);
  auto& d = directory();
  d.erase(std::remove(d.begin(), d.end(), this), d.end());
}

void Pool::throw_foreign_pointer(std::uintptr_t p, const std::string& what_we_know) {
  // Called without this pool's lock held, so asking the others cannot deadlock on us.
  std::string owner;
  {
    std::lock_guard<std::mutex> g(g_dir_mu);
    for (Pool* other : directory()) {
      if (other == this || other->closed()) continue;
      if (other->owns_live(p)) {
        owner = other->name() + " #" + std::to_string(other->id());
        break;
      }
    }
  }
  const std::string me = name() + " #" + std::to_string(id_);
  if (!owner.empty())
    throw InvalidPointer(format_ptr(p) + " belongs to " + owner + ", not to " + me + ": free it into its own pool",
                         p, "other_pool");
  throw InvalidPointer(format_ptr(p) + " " + what_we_know + " (" + me + ")", p, "unknown");
}

void Pool::throw_oom(OomFigures f) {
  ooms_.fetch_add(1, std::memory_order_relaxed);
  f.pool = name() + " #" + std::to_string(id_);
  f.upstream = upstream_->name();
  std::ostringstream d;
  d << "out of memory in " << f.pool << ": requested " << format_bytes(f.requested) << "; ";
  if (f.cause == "limit") {
    d << "limit of " << format_bytes(f.limit) << " reached (" << format_bytes(f.reserved) << " reserved, "
      << format_bytes(f.live) << " live, " << format_bytes(f.free) << " free)";
  } else if (f.cause == "pending") {
    std::size_t top_bytes = 0;
    Stream top = kNoStream;
    for (auto& [s, b] : f.pending_by_stream)
      if (b > top_bytes) top_bytes = b, top = s;
    d << format_bytes(f.pending) << " pending on stream " << format_stream(top) << " (" << format_bytes(top_bytes)
      << ")";
    if (f.pending_by_stream.size() > 1) d << " and " << f.pending_by_stream.size() - 1 << " other stream(s)";
    d << " until its event completes; synchronize the stream or free with stream=None once its work is done ("
      << format_bytes(f.free) << " free, largest " << format_bytes(f.largest_free) << ")";
  } else if (f.cause == "thread_cache") {
    d << format_bytes(f.thread_cached) << " of the " << format_bytes(f.free)
      << " free sit in other threads' caches, refilled since they were reclaimed (largest free block outside them "
      << format_bytes(f.largest_free) << ", " << format_bytes(f.reserved) << " reserved, " << format_bytes(f.live)
      << " live); retry, or lower thread_cache_bytes";
  } else if (f.cause == "fragmentation") {
    d << format_bytes(f.free) << " free in " << f.free_chunks << " chunks";
    if (f.thread_cached) d << " (" << format_bytes(f.thread_cached) << " of it in thread caches)";
    d << " but the largest is " << format_bytes(f.largest_free) << ": fragmentation in " << name() << " backings (" << format_bytes(f.reserved)
      << " reserved";
    if (f.limit) d << " of a " << format_bytes(f.limit) << " limit";
    else d << ", the upstream refused more";
    d << ", " << format_bytes(f.live) << " live)";
  } else {
    d << "upstream " << f.upstream << " exhausted (" << format_bytes(f.reserved) << " reserved by this pool, "
      << format_bytes(f.live) << " live, " << format_bytes(f.free) << " free, largest "
      << format_bytes(f.largest_free) << ")";
    if (!f.upstream_error.empty()) d << ": " << f.upstream_error;
  }
  throw OutOfMemory(d.str(), std::move(f));
}

std::size_t check_request(std::size_t nbytes) {
  if (nbytes == 0) throw InvalidArgument("allocation size must be positive; got 0 bytes");
  if (nbytes > kMaxRequest)
    throw InvalidArgument("allocation size " + std::to_string(nbytes) + " bytes is absurd (above 2^62)");
  return nbytes;
}

}  // namespace poolkeeper
