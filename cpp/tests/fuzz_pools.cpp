// Coverage-guided fuzz target over the pools (libFuzzer), and a replay/random driver without it.
//
// An input is a pool configuration followed by an operation sequence. Header bytes pick the pool
// (Direct, SizeClassPool with or without a cache cap, ArenaPool with or without a thread cache,
// a tiny ArenaPool with a limit), the upstream (Host: blocks carry a cookie checked at free;
// Simulated: virtual streams) and, on the simulated upstream, a fault-injection plan (refused
// allocations and frees). Then each operation byte is decoded into allocate (sizes from 1 B to
// MiBs, plus 0 and absurd sizes), free (live blocks, on their stream or another), bad frees
// (null, already freed, interior, unknown, another pool's live block), record_stream,
// process_pending, trim, synchronize, virtual-clock moves, fault on/off, cache flush / shrink
// scan, snapshot, and close.
//
// After every operation: validate(), reserved == live + free + pending + overhead, live blocks
// and bytes equal to the model's, no two live blocks overlap. Every call must succeed or raise the
// typed error its input calls for (InvalidArgument for a bad size, InvalidPointer with the right
// reason for a bad free, OutOfMemory / UpstreamFailure only when the upstream refused or ran out,
// LiveBlocksAtClose with the right count); a bad call must leave the books unchanged. At the end
// everything is freed and the pool must close with nothing left upstream (a size-class pool's
// refused frees are its only permitted leak, and only on the simulated upstream).
//
// Built with clang -fsanitize=fuzzer (tools/fuzz.sh) it is a libFuzzer target. Built plainly
// (CMake, POOLKEEPER_NATIVE_TESTS) it has its own main:
//   fuzz_pools FILE|DIR...              replay inputs (crash reproducers, the corpus)
//   fuzz_pools --random N [--seed S]    run N random inputs
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/pools/direct_pool.hpp"
#include "poolkeeper/upstreams/faulty_upstream.hpp"
#include "poolkeeper/upstreams/host_upstream.hpp"
#include "poolkeeper/upstreams/simulated_upstream.hpp"
#include "poolkeeper/pools/size_class_pool.hpp"

using namespace poolkeeper;

namespace {

[[noreturn]] void finding(const char* what, const std::string& detail = "") {
  std::fprintf(stderr, "FUZZ FINDING: %s %s\n", what, detail.c_str());
  std::fflush(stderr);
  std::abort();
}
#define CHECK(cond, ...)                         \
  do {                                           \
    if (!(cond)) finding(#cond, ##__VA_ARGS__);  \
  } while (0)

// Totals for the replay driver's summary line.
struct Totals {
  std::uint64_t ops = 0, bad_inputs = 0, typed_errors = 0, faults = 0, ooms = 0;
} g_tot;

struct Reader {
  const std::uint8_t* d;
  std::size_t n, i = 0;
  bool empty() const { return i >= n; }
  std::uint8_t u8() { return i < n ? d[i++] : 0; }
  std::uint16_t u16() { return static_cast<std::uint16_t>(u8() | (u8() << 8)); }
  std::uint32_t u32() { return u16() | (std::uint32_t{u16()} << 16); }
  std::uint64_t u64() { return u32() | (std::uint64_t{u32()} << 32); }
};

struct Allow {
  bool trace = false;  // FUZZ_TRACE=1: print each operation and the books (for reproducers)
  Allow() { trace = std::getenv("FUZZ_TRACE") != nullptr; }
};
const Allow& allow() {
  static const Allow a;
  return a;
}

enum class Kind { Direct, SizeClass, SizeClassCapped, Arena, ArenaNoCache, ArenaTiny };
constexpr int kKinds = 6;
constexpr std::size_t kSimCapacity = std::size_t{256} << 20;

struct Live {
  std::size_t n;
  Stream s;
};

std::uint8_t cookie(std::uintptr_t p, std::size_t i) { return static_cast<std::uint8_t>((p >> 8) * 131 + i * 29 + 7); }

class Session {
 public:
  explicit Session(Reader& r) : r_(r) {
    kind_ = static_cast<Kind>(r.u8() % kKinds);
    const std::uint8_t up_byte = r.u8();
    host_ = up_byte % 3 == 0;
    const std::uint8_t fault = r.u8();
    if (host_) {
      up_ = std::make_shared<HostUpstream>();
    } else {
      sim_ = std::make_shared<SimulatedUpstream>(LatencyModel::none(), kSimCapacity);
      up_ = sim_;
      if (fault % 2) {
        FaultPlan plan;
        plan.fail_every = 2 + fault / 2 % 7;
        plan.fail_frees = fault & 0x10;
        plan.error = fault & 0x20 ? FaultPlan::Error::Failure : FaultPlan::Error::Oom;
        if (fault & 0x40) plan.fail_bytes_over = std::size_t{1} << (12 + fault % 8);
        faulty_ = std::make_shared<FaultyUpstream>(sim_, plan);
        up_ = faulty_;
      }
      for (int i = 0; i < 4; ++i) streams_.push_back(sim_->new_stream());
    }
    pool_ = make(kind_, up_);
    other_ = std::make_shared<DirectPool>(host_ ? up_ : std::shared_ptr<Upstream>(sim_));
    other_block_ = other_->allocate(4096, kNoStream);
  }

  void run() {
    if (allow().trace)
      std::fprintf(stderr, "session: kind %d host %d faulty %d (every %llu frees %d bytes_over %zu error %d)\n", int(kind_),
                   host_, bool(faulty_), faulty_ ? (unsigned long long)faulty_->plan().fail_every : 0ULL,
                   faulty_ ? faulty_->plan().fail_frees : 0, faulty_ ? faulty_->plan().fail_bytes_over : 0,
                   faulty_ ? int(faulty_->plan().error) : -1);
    for (int ops = 0; ops < 400 && !r_.empty() && !closed_; ++ops) {
      const std::uint8_t op = r_.u8();
      step(op);
      ++g_tot.ops;
      if (allow().trace) {
        const PoolStats st = pool_->stats();
        std::fprintf(stderr, "op %2d: reserved %zu live %zu free %zu pending %zu backings %zu | armed %d injected %llu\n",
                     op % 20, st.reserved, st.live, st.free, st.pending, st.backings, faulty_ && faulty_->armed(),
                     faulty_ ? (unsigned long long)faulty_->injected() : 0ULL);
      }
      check_books();
      if (ops % 8 == 7) check_snapshot();
    }
    finish();
  }

 private:
  static std::shared_ptr<Pool> make(Kind k, std::shared_ptr<Upstream> up) {
    switch (k) {
      case Kind::Direct: return std::make_shared<DirectPool>(std::move(up));
      case Kind::SizeClass: return std::make_shared<SizeClassPool>(std::move(up));
      case Kind::SizeClassCapped: {
        SizeClassOptions o;
        o.max_cached_bytes = 64 << 10;
        o.classes_per_doubling = 2;
        return std::make_shared<SizeClassPool>(std::move(up), o);
      }
      case Kind::Arena:
      case Kind::ArenaNoCache: {
        ArenaOptions o;
        o.initial_backing = 64 << 10;
        o.max_backing = 1 << 20;
        o.thread_cache_bytes = k == Kind::Arena ? 256 << 10 : 0;
        o.thread_cache_max_block = 32 << 10;
        o.shrink_interval = 16;
        return std::make_shared<ArenaPool>(std::move(up), o);
      }
      case Kind::ArenaTiny: {
        ArenaOptions o;
        o.initial_backing = 4 << 10;
        o.max_backing = 16 << 10;
        o.growth_factor = 1.5;
        o.thread_cache_bytes = 16 << 10;
        o.thread_cache_max_block = 2 << 10;
        o.shrink_interval = 4;
        o.shrink_hysteresis = 1;
        o.limit = 256 << 10;
        return std::make_shared<ArenaPool>(std::move(up), o);
      }
    }
    return nullptr;
  }

  bool is_arena() const { return kind_ == Kind::Arena || kind_ == Kind::ArenaNoCache || kind_ == Kind::ArenaTiny; }
  bool faults_possible() const { return faulty_ && faulty_->armed(); }

  Stream stream_arg() {
    const std::uint8_t b = r_.u8();
    if (streams_.empty() || b % 5 == 0) return kNoStream;
    return streams_[b % streams_.size()];
  }

  std::size_t size_arg() {
    const std::uint8_t c = r_.u8();
    switch (c % 8) {
      case 0:
      case 1:
      case 2: return 1 + r_.u8();
      case 3:
      case 4: return 1 + r_.u16();
      case 5: return 1 + r_.u32() % (host_ ? (4u << 20) : (64u << 20));
      case 6: {
        static const std::size_t edge[] = {0,
                                           1,
                                           255,
                                           256,
                                           257,
                                           std::size_t{1} << 20,
                                           (std::size_t{1} << 20) + 1,
                                           kMaxRequest,
                                           kMaxRequest + 1,
                                           ~std::size_t{0},
                                           kMaxRequest - 255};
        return edge[r_.u8() % (sizeof edge / sizeof edge[0])];
      }
      default: return 1 + r_.u8() * 256;  // exact multiples of the alignment: bin hits
    }
  }

  void* any_live() {
    if (live_.empty()) return nullptr;
    auto it = live_.begin();
    std::advance(it, r_.u16() % live_.size());
    return reinterpret_cast<void*>(it->first);
  }

  // ---- model helpers

  void add_live(void* p, std::size_t n, Stream s) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    CHECK(a != 0 && a % pool_->alignment() == 0, "allocate returned null or a misaligned address");
    auto next = live_.lower_bound(a);
    CHECK(next == live_.end() || next->first >= a + n, "new block overlaps a live block");
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      CHECK(prev->first + prev->second.n <= a, "new block overlaps a live block");
    }
    if (host_) {
      auto* b = static_cast<std::uint8_t*>(p);
      for (std::size_t i = 0; i < std::min<std::size_t>(n, 64); ++i) b[i] = cookie(a, i);
      for (std::size_t i = n > 64 ? std::max<std::size_t>(64, n - 64) : n; i < n; ++i) b[i] = cookie(a, i);
    }
    live_[a] = {n, s};
    live_bytes_ += n;
    freed_.erase(a);
  }

  void check_cookie(std::uintptr_t a, std::size_t n) {
    if (!host_) return;
    const auto* b = reinterpret_cast<const std::uint8_t*>(a);
    for (std::size_t i = 0; i < std::min<std::size_t>(n, 64); ++i) CHECK(b[i] == cookie(a, i), "cookie broken");
    for (std::size_t i = n > 64 ? std::max<std::size_t>(64, n - 64) : n; i < n; ++i)
      CHECK(b[i] == cookie(a, i), "cookie broken");
  }

  struct Books {
    std::size_t reserved, live, free, pending, overhead, live_blocks;
    bool operator==(const Books&) const = default;
  };
  Books books() {
    const PoolStats st = pool_->stats();
    return {st.reserved, st.live, st.free, st.pending, st.overhead, st.live_blocks};
  }

  void check_books() {
    if (closed_) return;
    try {
      pool_->validate();
    } catch (const InvariantViolation& e) {
      finding("validate() failed", e.what());
    }
    const PoolStats st = pool_->stats();
    CHECK(st.reserved == st.live + st.free + st.pending + st.overhead, "accounting equation broken");
    CHECK(st.live_blocks == live_.size(), "live_blocks " + std::to_string(st.live_blocks) + " vs model " + std::to_string(live_.size()));
    CHECK(st.live == live_bytes_, "live bytes differ from the model");
    if (st.limit)
      CHECK(st.reserved <= st.limit, "reserved " + std::to_string(st.reserved) + " above the limit " + std::to_string(st.limit));
  }

  void check_snapshot() {
    if (closed_) return;
    const Snapshot snap = pool_->snapshot();
    std::size_t reserved = 0, live = 0, nlive = 0;
    for (const auto& b : snap.backings) {
      std::size_t at = 0;
      for (const auto& c : b.chunks) {
        if (is_arena()) CHECK(c.offset == at, "snapshot chunks do not tile their backing");
        at += c.size;
        reserved += c.size;
        if (c.state == ChunkState::Live) live += c.requested, ++nlive;
      }
    }
    const PoolStats st = snap.stats;
    CHECK(reserved == st.reserved, "snapshot chunks do not add up to reserved");
    CHECK(nlive == live_.size() && live == live_bytes_, "snapshot live chunks differ from the model");
  }

  // ---- operations

  void do_allocate() {
    const std::size_t n = size_arg();
    const Stream s = stream_arg();
    const bool fast = r_.u8() & 1;
    try {
      void* p = fast ? pool_->try_allocate_nowait(n, s) : nullptr;
      if (!p) p = pool_->allocate(n, s);
      CHECK(n != 0 && n <= kMaxRequest, "a zero or absurd size was accepted");
      add_live(p, n, s);
    } catch (const InvalidArgument&) {
      CHECK(n == 0 || n > kMaxRequest, "InvalidArgument for a valid size " + std::to_string(n));
      ++g_tot.bad_inputs, ++g_tot.typed_errors;
    } catch (const OutOfMemory& e) {
      ++g_tot.ooms;
      // Legitimate only when something can run out: a huge request, the limit, the simulated
      // capacity, or an injected refusal.
      CHECK(n > (std::size_t{1} << 20) || kind_ == Kind::ArenaTiny || faults_possible() ||
                (sim_ && sim_->counters().outstanding_bytes + 2 * std::max<std::size_t>(n, 1 << 20) > kSimCapacity),
            std::string("unexpected OutOfMemory: ") + e.what());
      CHECK(std::string(oom_cause_name(e.figures.cause)) != "?", "OutOfMemory without a cause");
    } catch (const UpstreamFailure& e) {
      CHECK(faults_possible() && faulty_->plan().error == FaultPlan::Error::Failure,
            std::string("UpstreamFailure without an injected fault: ") + e.what());
    }
  }

  void do_free() {
    if (live_.empty()) return;
    void* p = any_live();
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    const Live l = live_[a];
    Stream s = l.s;
    if (r_.u8() % 4 == 0) s = stream_arg();
    const bool fast = r_.u8() & 1;
    check_cookie(a, l.n);
    try {
      if (!(fast && pool_->try_deallocate_nowait(p, s))) pool_->deallocate(p, s);
    } catch (const UpstreamFailure& e) {
      // Only Direct frees upstream inside deallocate(); its policy: the block stays live.
      CHECK(kind_ == Kind::Direct && faults_possible(), std::string("free raised ") + e.what());
      CHECK(pool_->owns_live(a), "Direct: a refused free did not leave the block live");
      return;
    }
    live_.erase(a);
    live_bytes_ -= l.n;
    freed_.insert(a);
  }

  void do_bad_free() {
    void* p = nullptr;
    const char* expect = nullptr;  // the one reason it must give, if any
    const auto which = r_.u8() % 6;
    if (which == 0) {
      expect = "null";
    } else if (which == 1 && !freed_.empty()) {
      auto it = freed_.begin();
      std::advance(it, r_.u16() % freed_.size());
      p = reinterpret_cast<void*>(*it);
    } else if (which == 2 && !live_.empty()) {
      void* q = any_live();
      const std::size_t n = live_[reinterpret_cast<std::uintptr_t>(q)].n;
      if (n < 2) return;
      p = static_cast<std::uint8_t*>(q) + 1 + r_.u32() % (n - 1);
      if (kind_ != Kind::Direct) expect = "interior";
    } else if (which == 3) {
      expect = "other_pool";
      p = other_block_;
    } else {
      p = reinterpret_cast<void*>(r_.u64() | 1);  // odd: never a block start
    }
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    if (live_.count(a)) return;
    const Books before = books();
    ++g_tot.bad_inputs;
    const bool fast = r_.u8() & 1;
    try {
      if (!(fast && pool_->try_deallocate_fast(p, kNoStream))) pool_->deallocate(p, kNoStream);
      finding("a bad free was accepted", format_ptr(a) + " kind " + std::to_string(int(kind_)));
    } catch (const InvalidPointer& e) {
      ++g_tot.typed_errors;
      if (expect) CHECK(e.reason == expect, "bad free reason '" + e.reason + "', expected '" + expect + "': " + e.what());
      CHECK(e.reason == "null" || e.reason == "unknown" || e.reason == "double_free" || e.reason == "interior" ||
                e.reason == "other_pool",
            "unknown reason " + e.reason);
    }
    CHECK(books() == before, "a refused free changed the books");
  }

  void do_record_stream() {
    if (streams_.empty()) return;
    const Stream s = streams_[r_.u8() % streams_.size()];
    if (!live_.empty() && r_.u8() % 8) {
      pool_->record_stream(any_live(), s);
      return;
    }
    const Books before = books();
    ++g_tot.bad_inputs;
    const std::uintptr_t bad = r_.u64() | 1;
    try {
      pool_->record_stream(reinterpret_cast<void*>(bad), s);
      finding("record_stream on a non-block was accepted", format_ptr(bad));
    } catch (const InvalidPointer&) {
      ++g_tot.typed_errors;
    }
    CHECK(books() == before, "a refused record_stream changed the books");
  }

  void step(std::uint8_t op) {
    switch (op % 20) {
      case 0: case 1: case 2: case 3: case 4: do_allocate(); break;
      case 5: case 6: case 7: case 8: do_free(); break;
      case 9: case 10: do_bad_free(); break;
      case 11: do_record_stream(); break;
      case 12: pool_->process_pending(); break;
      case 13: pool_->trim(); break;
      case 14: pool_->synchronize(); break;
      case 15:
        if (sim_) {
          const Stream s = streams_[r_.u8() % streams_.size()];
          sim_->enqueue(s, r_.u8());
          sim_->advance(r_.u8());
        }
        break;
      case 16:
        if (faulty_) faulty_->set_armed(!faulty_->armed());
        break;
      case 17:
        if (auto* ap = dynamic_cast<ArenaPool*>(pool_.get())) {
          if (r_.u8() & 1) ap->flush_thread_cache();
          else ap->shrink_scan();
        } else if (auto* sp = dynamic_cast<SizeClassPool*>(pool_.get())) {
          sp->release_cached();
        }
        break;
      case 18: check_snapshot(); break;
      case 19: do_close(); break;
    }
  }

  void do_close() {
    const Books before = books();
    try {
      pool_->close();
    } catch (const LiveBlocksAtClose& e) {
      ++g_tot.bad_inputs, ++g_tot.typed_errors;
      CHECK(!live_.empty() && e.blocks == live_.size() && e.bytes == live_bytes_, "LiveBlocksAtClose figures wrong");
      CHECK(!pool_->closed() && books() == before, "a refused close changed the pool");
      return;
    }
    CHECK(live_.empty(), "close() succeeded with live blocks");
    CHECK(pool_->closed(), "close() did not close");
    closed_ = true;
    ++g_tot.bad_inputs;
    try {
      pool_->allocate(256, kNoStream);
      finding("allocate after close succeeded");
    } catch (const PoolClosed&) {
      ++g_tot.typed_errors;
    }
    if (other_block_) {
      ++g_tot.bad_inputs;
      try {
        pool_->deallocate(other_block_, kNoStream);
        finding("deallocate after close succeeded");
      } catch (const PoolClosed&) {
        ++g_tot.typed_errors;
      }
    }
  }

  void finish() {
    if (faulty_) g_tot.faults += faulty_->injected();
    if (faulty_) faulty_->set_armed(false);
    if (!closed_) {
      for (auto& [a, l] : std::map<std::uintptr_t, Live>(live_)) {
        check_cookie(a, l.n);
        pool_->deallocate(reinterpret_cast<void*>(a), l.s);
        live_.erase(a);
        live_bytes_ -= l.n;
      }
      pool_->synchronize();
      check_books();
      pool_->close();
      CHECK(pool_->closed(), "final close failed");
    }
    std::uint64_t free_failures = 0;
    for (auto& [k, v] : pool_->stats().extra)
      if (k == "upstream_free_failures") free_failures = v;
    other_->deallocate(other_block_, kNoStream);
    other_->close();
    const auto out = (faulty_ ? std::shared_ptr<Upstream>(sim_) : up_)->counters().outstanding_bytes;
    // Refused frees are re-adopted and retried (ArenaPool, SizeClassPool) or stay live (Direct);
    // only a refusal during close() itself can leave bytes upstream.
    if (kind_ == Kind::Direct || !free_failures)
      CHECK(out == 0, "upstream still holds " + std::to_string(out) + " B after close");
  }

  Reader& r_;
  Kind kind_;
  bool host_ = false, closed_ = false;
  std::shared_ptr<Upstream> up_;
  std::shared_ptr<SimulatedUpstream> sim_;
  std::shared_ptr<FaultyUpstream> faulty_;
  std::vector<Stream> streams_;
  std::shared_ptr<Pool> pool_;
  std::shared_ptr<DirectPool> other_;
  void* other_block_ = nullptr;
  std::map<std::uintptr_t, Live> live_;
  std::size_t live_bytes_ = 0;
  std::set<std::uintptr_t> freed_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Reader r{data, size};
  Session(r).run();
  return 0;
}

#ifndef POOLKEEPER_LIBFUZZER
// Without libFuzzer: replay files (a crash reproducer, a corpus directory) or random inputs.
#include <dirent.h>

#include <fstream>
#include <iterator>

static int replay(const std::string& path) {
  if (DIR* d = opendir(path.c_str())) {
    int n = 0;
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') n += replay(path + "/" + e->d_name);
    closedir(d);
    return n;
  }
  std::ifstream f(path, std::ios::binary);
  std::vector<std::uint8_t> buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(buf.data(), buf.size());
  return 1;
}

int main(int argc, char** argv) {
  std::uint64_t random_runs = 0, seed = 1;
  std::size_t max_len = 2048;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--random" && i + 1 < argc) random_runs = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--max-len" && i + 1 < argc) max_len = std::strtoull(argv[++i], nullptr, 10);
    else paths.push_back(a);
  }
  if (paths.empty() && !random_runs) {
    std::fprintf(stderr, "usage: fuzz_pools FILE|DIR... | --random N [--seed S] [--max-len L]\n");
    return 2;
  }
  std::uint64_t runs = 0;
  for (auto& p : paths) runs += replay(p);
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> buf;
  for (std::uint64_t k = 0; k < random_runs; ++k) {
    buf.resize(rng() % max_len + 4);
    for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
    ++runs;
  }
  std::printf("fuzz_pools: %llu inputs, %llu operations, %llu bad inputs tried -> %llu typed errors, %llu faults "
              "injected, %llu out-of-memory errors, 0 findings\n",
              static_cast<unsigned long long>(runs), static_cast<unsigned long long>(g_tot.ops),
              static_cast<unsigned long long>(g_tot.bad_inputs), static_cast<unsigned long long>(g_tot.typed_errors),
              static_cast<unsigned long long>(g_tot.faults), static_cast<unsigned long long>(g_tot.ooms));
  return 0;
}
#endif
