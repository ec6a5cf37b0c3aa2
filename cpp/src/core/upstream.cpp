#include "poolkeeper/core/upstream.hpp"

#include "poolkeeper/core/capture.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace poolkeeper {

namespace {
std::uint64_t now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// An upstream call timed from t0: a failure is counted (failed, and its time in ns) and rethrown.
template <class F>
decltype(auto) timed_call(F&& f, std::uint64_t t0, std::atomic<std::uint64_t>& failed, std::atomic<std::uint64_t>& ns) {
  try {
    return f();
  } catch (...) {
    failed.fetch_add(1, std::memory_order_relaxed);
    ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    throw;
  }
}

// A run (map_pieces and the rest): `count()` books the pieces it got through, whether `run`
// returns or throws; a refusal is also counted in `failed` (where the run's kind has one), and a
// refused run that booked nothing adds its time to `ns` itself (count() adds it otherwise).
template <class Run, class Count>
void counted_run(Run&& run, Count&& count, std::uint64_t t0 = 0, std::atomic<std::uint64_t>* failed = nullptr,
                 std::atomic<std::uint64_t>* ns = nullptr) {
  try {
    run();
  } catch (...) {
    if (failed) failed->fetch_add(1, std::memory_order_relaxed);
    if (!count() && ns) ns->fetch_add(now_ns() - t0, std::memory_order_relaxed);
    throw;
  }
  count();
}
}  // namespace

void* Upstream::allocate(std::size_t nbytes) {
  RelaxedCapture relaxed(*this);  // growth during a graph capture must not invalidate it
  const auto t0 = now_ns();
  void* p = timed_call([&] { return do_allocate(nbytes); }, t0, failed_allocations_, alloc_ns_);
  count_alloc(nbytes, t0);
  return p;
}

void Upstream::count_alloc(std::size_t nbytes, std::uint64_t t0, std::uint64_t calls) {
  alloc_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  allocations_.fetch_add(calls, std::memory_order_relaxed);
  bytes_allocated_.fetch_add(nbytes, std::memory_order_relaxed);
  const auto out = outstanding_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  auto peak = peak_outstanding_.load(std::memory_order_relaxed);
  while (out > peak && !peak_outstanding_.compare_exchange_weak(peak, out, std::memory_order_relaxed)) {
  }
}

void Upstream::count_dealloc(std::size_t nbytes, std::uint64_t t0, std::uint64_t calls) {
  dealloc_ns_.fetch_add(now_ns() - t0, std::memory_order_relaxed);
  deallocations_.fetch_add(calls, std::memory_order_relaxed);
  bytes_deallocated_.fetch_add(nbytes, std::memory_order_relaxed);
  outstanding_.fetch_sub(nbytes, std::memory_order_relaxed);
}

std::uintptr_t Upstream::reserve(std::size_t bytes) {
  RelaxedCapture relaxed(*this);
  const std::uintptr_t a = do_reserve(bytes);
  reserves_.fetch_add(1, std::memory_order_relaxed);
  return a;
}

void Upstream::unreserve(std::uintptr_t addr, std::size_t bytes) {
  RelaxedCapture relaxed(*this);
  do_unreserve(addr, bytes);
  unreserves_.fetch_add(1, std::memory_order_relaxed);
}

void Upstream::map(std::uintptr_t addr, std::size_t bytes) {
  RelaxedCapture relaxed(*this);  // growth during a graph capture must not invalidate it
  const auto t0 = now_ns();
  timed_call([&] { do_map(addr, bytes); }, t0, failed_allocations_, alloc_ns_);
  maps_.fetch_add(1, std::memory_order_relaxed);
  count_alloc(bytes, t0);
}

void Upstream::unmap(std::uintptr_t addr, std::size_t bytes) {
  RelaxedCapture relaxed(*this);
  const auto t0 = now_ns();
  timed_call([&] { do_unmap(addr, bytes); }, t0, failed_deallocations_, dealloc_ns_);
  unmaps_.fetch_add(1, std::memory_order_relaxed);
  count_dealloc(bytes, t0);
}

void Upstream::alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) {
  RelaxedCapture relaxed(*this);
  do_alias(dst, src, bytes);
  aliases_.fetch_add(1, std::memory_order_relaxed);
}

void Upstream::unalias(std::uintptr_t dst, std::size_t bytes) {
  RelaxedCapture relaxed(*this);
  do_unalias(dst, bytes);
  unaliases_.fetch_add(1, std::memory_order_relaxed);
}

// A run's pieces are counted as that many maps, whether the run completes or stops at a refusal
// (then the refusal is counted as one failed allocation, as a refused map() is).
void Upstream::map_pieces(std::uintptr_t addr, std::size_t bytes, std::size_t piece, std::size_t& done) {
  done = 0;
  if (!piece) piece = bytes;
  RelaxedCapture relaxed(*this);
  const auto t0 = now_ns();
  counted_run([&] { do_map_pieces(addr, bytes, piece, done); },
              [&] {
                if (!done) return false;
                maps_.fetch_add((done + piece - 1) / piece, std::memory_order_relaxed);
                count_alloc(done, t0, (done + piece - 1) / piece);
                return true;
              },
              t0, &failed_allocations_, &alloc_ns_);
}

void Upstream::alias_pieces(std::uintptr_t dst, const AliasSource* srcs, std::size_t n, std::size_t& done) {
  done = 0;
  RelaxedCapture relaxed(*this);
  counted_run([&] { do_alias_pieces(dst, srcs, n, done); }, [&] { return aliases_.fetch_add(done, std::memory_order_relaxed), true; });
}

// A run to take down: at least one piece, none empty, and its end inside the address space (the
// defaults walk it last first from its end: a sum that wrapped would name a real piece).
static void check_run(const std::string& who, const char* what, std::uintptr_t base, const std::size_t* sizes, std::size_t n) {
  std::uintptr_t end = base;
  bool ok = n > 0;
  for (std::size_t i = 0; ok && i < n; ++i) ok = sizes[i] && end + sizes[i] > end && (end += sizes[i], true);
  if (!ok)
    throw UpstreamFailure(who + ": " + what + " of " + std::to_string(n) + " piece(s) from " + format_ptr(base) +
                              " is empty, holds an empty piece or runs past the end of the address space",
                          who, "CUDA_ERROR_INVALID_VALUE", 1);
}

// Runs taken down: each piece down counts as one unmap (a deallocation of its bytes) or one
// unalias, whether the run completes or stops at a refusal (counted as one failed deallocation,
// as a refused unmap() is).
void Upstream::unmap_pieces(std::uintptr_t addr, const std::size_t* sizes, std::size_t n, std::size_t& done) {
  done = 0;
  RelaxedCapture relaxed(*this);
  const auto t0 = now_ns();
  counted_run(
      [&] {
        check_run(name(), "unmap run", addr, sizes, n);
        do_unmap_pieces(addr, sizes, n, done);
      },
      [&] {
        if (!done) return false;
        std::size_t bytes = 0;
        for (std::size_t i = n - done; i < n; ++i) bytes += sizes[i];
        unmaps_.fetch_add(done, std::memory_order_relaxed);
        count_dealloc(bytes, t0, done);
        return true;
      },
      t0, &failed_deallocations_, &dealloc_ns_);
}

void Upstream::unalias_pieces(std::uintptr_t dst, const std::size_t* sizes, std::size_t n, std::size_t& done) {
  done = 0;
  RelaxedCapture relaxed(*this);
  counted_run(
      [&] {
        check_run(name(), "unalias run", dst, sizes, n);
        do_unalias_pieces(dst, sizes, n, done);
      },
      [&] { return unaliases_.fetch_add(done, std::memory_order_relaxed), true; });
}

// At least one do_map: an empty run is refused as map() refuses an empty range.
void Upstream::do_map_pieces(std::uintptr_t addr, std::size_t bytes, std::size_t piece, std::size_t& done) {
  std::size_t k = 0;
  do {
    do_map(addr + done, k = std::min(piece, bytes - done));
  } while ((done += k) < bytes);
}

void Upstream::do_alias_pieces(std::uintptr_t dst, const AliasSource* srcs, std::size_t n, std::size_t& done) {
  for (std::size_t at = 0; done < n; at += srcs[done++].bytes) do_alias(dst + at, srcs[done].src, srcs[done].bytes);
}

// Last first: the pieces still mapped after a refusal are the run's first ones, a shorter run.
// `one` is do_unmap or do_unalias.
static void take_down_last_first(Upstream& u, void (Upstream::*one)(std::uintptr_t, std::size_t), std::uintptr_t base,
                                 const std::size_t* sizes, std::size_t n, std::size_t& done) {
  std::size_t end = 0;
  for (std::size_t i = 0; i < n; ++i) end += sizes[i];
  for (; done < n; ++done) (u.*one)(base + (end -= sizes[n - 1 - done]), sizes[n - 1 - done]);
}

void Upstream::do_unmap_pieces(std::uintptr_t addr, const std::size_t* sizes, std::size_t n, std::size_t& done) {
  take_down_last_first(*this, &Upstream::do_unmap, addr, sizes, n, done);
}

void Upstream::do_unalias_pieces(std::uintptr_t dst, const std::size_t* sizes, std::size_t n, std::size_t& done) {
  take_down_last_first(*this, &Upstream::do_unalias, dst, sizes, n, done);
}

static std::string no_vm(const std::string& who) {
  return who + " has no virtual memory interface (supports_virtual() is false)";
}
std::uintptr_t Upstream::do_reserve(std::size_t) { throw UpstreamFailure(no_vm(name()), name(), "NOT_SUPPORTED", 801); }
void Upstream::do_map(std::uintptr_t, std::size_t) { throw UpstreamFailure(no_vm(name()), name(), "NOT_SUPPORTED", 801); }
void Upstream::do_unmap(std::uintptr_t, std::size_t) { throw UpstreamFailure(no_vm(name()), name(), "NOT_SUPPORTED", 801); }
void Upstream::do_unreserve(std::uintptr_t, std::size_t) { throw UpstreamFailure(no_vm(name()), name(), "NOT_SUPPORTED", 801); }
void Upstream::do_alias(std::uintptr_t, std::uintptr_t, std::size_t) {
  throw UpstreamFailure(name() + " cannot map memory twice (supports_alias() is false)", name(), "NOT_SUPPORTED", 801);
}
void Upstream::do_unalias(std::uintptr_t, std::size_t) {
  throw UpstreamFailure(name() + " cannot map memory twice (supports_alias() is false)", name(), "NOT_SUPPORTED", 801);
}

void Upstream::deallocate(void* p, std::size_t nbytes) {
  RelaxedCapture relaxed(*this);
  const auto t0 = now_ns();
  timed_call([&] { do_deallocate(p, nbytes); }, t0, failed_deallocations_, dealloc_ns_);
  count_dealloc(nbytes, t0);
}

UpstreamCounters Upstream::counters() const {
  UpstreamCounters c;
  c.allocations = allocations_.load(std::memory_order_relaxed);
  c.deallocations = deallocations_.load(std::memory_order_relaxed);
  c.bytes_allocated = bytes_allocated_.load(std::memory_order_relaxed);
  c.bytes_deallocated = bytes_deallocated_.load(std::memory_order_relaxed);
  c.outstanding_bytes = outstanding_.load(std::memory_order_relaxed);
  c.peak_outstanding_bytes = peak_outstanding_.load(std::memory_order_relaxed);
  c.alloc_ns = alloc_ns_.load(std::memory_order_relaxed);
  c.dealloc_ns = dealloc_ns_.load(std::memory_order_relaxed);
  c.failed_allocations = failed_allocations_.load(std::memory_order_relaxed);
  c.failed_deallocations = failed_deallocations_.load(std::memory_order_relaxed);
  c.maps = maps_.load(std::memory_order_relaxed);
  c.unmaps = unmaps_.load(std::memory_order_relaxed);
  c.reserves = reserves_.load(std::memory_order_relaxed);
  c.unreserves = unreserves_.load(std::memory_order_relaxed);
  c.aliases = aliases_.load(std::memory_order_relaxed);
  c.unaliases = unaliases_.load(std::memory_order_relaxed);
  return c;
}

void Upstream::reset_counters() {
  // Outstanding bytes are state, not history: they survive a reset (peak restarts from them).
  allocations_ = 0;
  deallocations_ = 0;
  bytes_allocated_ = 0;
  bytes_deallocated_ = 0;
  peak_outstanding_ = outstanding_.load();
  alloc_ns_ = 0;
  dealloc_ns_ = 0;
  failed_allocations_ = 0;
  failed_deallocations_ = 0;
  maps_ = 0;
  unmaps_ = 0;
  reserves_ = 0;
  unreserves_ = 0;
  aliases_ = 0;
  unaliases_ = 0;
}

std::string format_bytes(std::size_t n) {
  char buf[64];
  const double d = static_cast<double>(n);
  if (n >= (std::size_t{1} << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", d / double(1u << 30));
  else if (n >= (std::size_t{1} << 20)) std::snprintf(buf, sizeof buf, "%.2f MiB", d / double(1u << 20));
  else if (n >= (std::size_t{1} << 10)) std::snprintf(buf, sizeof buf, "%.2f KiB", d / 1024.0);
  else std::snprintf(buf, sizeof buf, "%zu B", n);
  return buf;
}

std::string format_stream(Stream s) {
  if (s == kNoStream) return "none";
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(s));
  return buf;
}

std::string format_ptr(std::uintptr_t p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(p));
  return buf;
}

}  // namespace poolkeeper
