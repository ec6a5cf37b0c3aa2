#include "poolkeeper/core/pool.hpp"

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
    case ChunkState::Remote: return "remote_free";
    case ChunkState::Freeing: return "freeing";
  }
  return "?";
}

namespace {
// Every open pool, so a pointer freed into the wrong pool can be traced to its owner.
std::mutex g_dir_mu;
std::vector<Pool*>& directory() {
  static auto* d = new std::vector<Pool*>();  // never destroyed: threads may exit after static destructors
  return *d;
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
  throw PoolClosed(label() +
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

bool Pool::with_pool(std::uint64_t id, void (*fn)(Pool&, void*), void* ctx) {
  std::lock_guard<std::mutex> g(g_dir_mu);
  for (Pool* p : directory())
    if (p->id_ == id) {
      if (p->forked()) return false;  // its lock may have been held at the fork
      fn(*p, ctx);
      return true;
    }
  return false;
}

void Pool::unregister() {
  std::lock_guard<std::mutex> g(g_dir_mu);
  auto& d = directory();
  d.erase(std::remove(d.begin(), d.end(), this), d.end());
}

void Pool::give_back_after_close(void* p, std::size_t n) {
  try {
    upstream_free(p, n);
  } catch (...) {
    refused_after_close_.fetch_add(1, std::memory_order_relaxed);
  }
  throw_closed();
}

void Pool::throw_closed() const {
  check_not_forked();
  throw PoolClosed(label() + " is closed");
}

void Pool::throw_null_free() { throw InvalidPointer("cannot free a null pointer", 0, "null"); }

void Pool::throw_refusal(std::uintptr_t p, const Refusal& r) {
  const std::string at = format_ptr(p), block = format_ptr(r.block), off = std::to_string(p - r.block);
  switch (r.kind) {
    case Refusal::DoubleFree:
      throw InvalidPointer(at + " was already freed (double free; " +
                               (r.state == ChunkState::ThreadCached ? std::string("the block sits in a thread cache")
                                                                    : "the block is " + std::string(chunk_state_name(r.state))) +
                               ")",
                           p, "double_free");
    case Refusal::FreedMemory: {
      const std::string st = chunk_state_name(r.state);
      throw InvalidPointer(at + " points into " + st + " memory (the " + st + " chunk at " + block + ", offset " + off +
                               "): already freed (double free) or never allocated here",
                           p, "double_free");
    }
    case Refusal::Interior:
      throw InvalidPointer(at + " points inside the " + (r.state == ChunkState::Live ? "live " : "") + "block at " +
                               block + " (offset " + off +
                               "): free the block's start address",
                           p, "interior");
    default: break;
  }
  // Called without this pool's lock held, so asking the others cannot deadlock on us.
  std::string owner;
  {
    std::lock_guard<std::mutex> g(g_dir_mu);
    for (Pool* other : directory()) {
      if (other == this || other->closed()) continue;
      if (other->find_live(p)) {
        owner = other->label();
        break;
      }
    }
  }
  if (!owner.empty())
    throw InvalidPointer(at + " belongs to " + owner + ", not to " + label() + ": free it into its own pool", p,
                         "other_pool");
  throw InvalidPointer(at + (r.kind == Refusal::UnknownOrFreed
                                 ? " is not a live block (never allocated here, or already freed)"
                                 : " is not a block of this pool (never allocated here)") +
                           " (" + label() + ")",
                       p, "unknown");
}

void Pool::record_stream(void* p, Stream s) {
  check_open();
  if (!do_record_stream(p, s)) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    throw InvalidPointer("record_stream: " + format_ptr(a) + " is not a live block of this pool", a, "unknown");
  }
}

void Pool::close() {
  if (closed()) return;
  LiveAtClose live;
  if (!do_close(live))
    throw LiveBlocksAtClose("cannot close " + label() + ": " + std::to_string(live.blocks) + " block(s), " +
                                format_bytes(live.bytes) + " still live; free them first",
                            live.blocks, live.bytes, live.sample);
}

const char* oom_cause_name(OomCause c) {
  switch (c) {
    case OomCause::Upstream: return "upstream";
    case OomCause::Limit: return "limit";
    case OomCause::Pending: return "pending";
    case OomCause::ThreadCache: return "thread_cache";
    case OomCause::Fragmentation: return "fragmentation";
  }
  return "?";
}

OomCause diagnose_oom(const OomFigures& f, std::size_t need, bool limit_hit, FreeFit fit) {
  if (fit == FreeFit::AnyPiece) {
    const bool no_piece = f.largest_free < need;
    // Refilled by their owners since the pool reclaimed them during recovery.
    if (f.thread_cached && f.free >= need && f.free - f.thread_cached < need && no_piece) return OomCause::ThreadCache;
    if (f.pending && f.pending + f.free >= need && no_piece) return OomCause::Pending;
    if (f.free >= need && no_piece) return OomCause::Fragmentation;
  } else if (f.pending >= need) {
    return OomCause::Pending;
  }
  return limit_hit ? OomCause::Limit : OomCause::Upstream;
}

OomFigures oom_figures(const PoolStats& st, std::size_t requested) {
  return OomFigures{.requested = requested, .reserved = st.reserved, .live = st.live, .free = st.free,
                    .largest_free = st.largest_free, .pending = st.pending, .free_chunks = st.free_chunks,
                    .limit = st.limit, .thread_cached = st.thread_cached, .pending_by_stream = st.pending_by_stream};
}

Snapshot Pool::snapshot_head(PoolStats st) const {
  Snapshot snap;
  snap.pool = name();
  snap.upstream = upstream_->name();
  snap.alignment = alignment();
  snap.stats = std::move(st);
  return snap;
}

void Pool::sort_backings(Snapshot& s) {
  std::sort(s.backings.begin(), s.backings.end(),
            [](const BackingInfo& x, const BackingInfo& y) { return x.address < y.address; });
}

void Pool::throw_oom(OomFigures f, std::size_t need, bool limit_hit, FreeFit fit) {
  ooms_.fetch_add(1, std::memory_order_relaxed);
  f.cause = diagnose_oom(f, need, limit_hit, fit);
  f.pool = label();
  f.upstream = upstream_->name();
  std::ostringstream d;
  d << "out of memory in " << f.pool << ": requested " << format_bytes(f.requested) << "; ";
  switch (f.cause) {
    case OomCause::Limit:
      // A request larger than the limit itself is not the pool being full: say so (an empty
      // pool had reported "limit of 32.00 MiB reached (2.00 MiB reserved, 0 B live ...)").
      if (need > f.limit)
        d << "the request alone is larger than the limit of " << format_bytes(f.limit) << " (";
      else if (f.refused_growth > f.limit)
        d << "the limit of " << format_bytes(f.limit) << " is below the " << format_bytes(f.refused_growth)
          << " this request needs mapped: the upstream maps whole granules of " << format_bytes(f.growth_unit) << " (";
      else
        d << "limit of " << format_bytes(f.limit) << " reached (";
      d << format_bytes(f.reserved) << " reserved, " << format_bytes(f.live) << " live, " << format_bytes(f.free)
        << " free)";
      break;
    case OomCause::Pending: {
      std::size_t top_bytes = 0;
      Stream top = kNoStream;
      for (auto& [s, b] : f.pending_by_stream)
        if (b > top_bytes) top_bytes = b, top = s;
      d << format_bytes(f.pending) << " pending on stream " << format_stream(top) << " (" << format_bytes(top_bytes)
        << ")";
      if (f.pending_by_stream.size() > 1) d << " and " << f.pending_by_stream.size() - 1 << " other stream(s)";
      d << " until its event completes; synchronize the stream or free with stream=None once its work is done ("
        << format_bytes(f.free) << " free, largest " << format_bytes(f.largest_free) << ")";
      break;
    }
    case OomCause::ThreadCache:
      d << format_bytes(f.thread_cached) << " of the " << format_bytes(f.free)
        << " free sit in other threads' caches, refilled since they were reclaimed (largest free block outside them "
        << format_bytes(f.largest_free) << ", " << format_bytes(f.reserved) << " reserved, " << format_bytes(f.live)
        << " live); retry, or lower thread_cache_bytes";
      break;
    case OomCause::Fragmentation:
      d << format_bytes(f.free) << " free in " << f.free_chunks << " chunks";
      if (f.thread_cached) d << " (" << format_bytes(f.thread_cached) << " of it in thread caches)";
      d << " but the largest is " << format_bytes(f.largest_free) << ": fragmentation in " << name() << " backings ("
        << format_bytes(f.reserved) << " reserved";
      if (f.limit) d << " of a " << format_bytes(f.limit) << " limit";
      else d << ", the upstream refused more";
      d << ", " << format_bytes(f.live) << " live)";
      break;
    case OomCause::Upstream:
      d << "upstream " << f.upstream << " exhausted (" << format_bytes(f.reserved) << " reserved by this pool, "
        << format_bytes(f.live) << " live, " << format_bytes(f.free) << " free, largest "
        << format_bytes(f.largest_free) << ")";
      if (!f.upstream_error.empty()) d << ": " << f.upstream_error;
      break;
  }
  throw OutOfMemory(d.str(), std::move(f));
}

void throw_bad_request(std::size_t nbytes) {
  if (nbytes == 0) throw InvalidArgument("allocation size must be positive; got 0 bytes");
  throw InvalidArgument("allocation size " + std::to_string(nbytes) + " bytes is absurd (above 2^62)");
}

}  // namespace poolkeeper
