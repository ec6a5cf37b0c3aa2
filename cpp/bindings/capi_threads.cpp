// capi_bench_threads: many native threads hammering poolkeeper_malloc/poolkeeper_free on one
// registered pool at once (issue 20's scaling benchmark). Native threads, not Python threads: the
// question is what the allocator does under contention, and the GIL would serialize the callers.
//
// Each thread runs rounds of 8 allocations then 8 frees of one size (with several sizes, a thread
// takes them in turn, offset by its index, so different sizes run at the same moment). With
// cross_thread_frees, a round's 8 blocks are handed to the next thread, which frees them: the
// pattern of a producer/consumer server, where the freeing thread's cache never saw the block.
// Latency: one cycle of sizes in `sample_every` times each call with the steady clock (reading the
// clock on every call would add ~40 ns to a ~50 ns pair and hide the allocator); per size,
// log-linear histograms merged over threads give p50 and p99 of single calls.
// Warm-up: the threads run the pattern for `warmup` seconds before the measured window, so the
// blocks in flight (with cross-thread frees, up to 5 rounds per thread) are already in the pool:
// the window measures the steady state, not the pool's first growth.
// reference: no pool at all. A "malloc" writes one word of a cache-line record from the calling
// thread's ring and a "free" writes it back, so a cross-thread free still pulls a line the other
// core wrote, as any allocator's per-block state must. What this reference loses from 1 to N
// threads is the cost of the pattern itself (the hand-over locks and the moving lines), not of
// an allocator: the ceiling a pool is read against.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <nanobind/stl/vector.h>

#include "../capi/poolkeeper_capi.h"
#include "bindings.hpp"

namespace poolkeeper::py {

namespace {
using Clock = std::chrono::steady_clock;

// Log-linear histogram of nanoseconds: 16 steps per power of two (< 6.25% bucket error).
struct Hist {
  static constexpr int kSub = 16, kPow = 40;
  std::vector<std::uint64_t> n = std::vector<std::uint64_t>(kSub * kPow, 0);
  static int bucket(std::uint64_t ns) {
    if (ns < kSub) return static_cast<int>(ns);
    const int e = 63 - __builtin_clzll(ns);  // ns in [2^e, 2^(e+1))
    const int sub = static_cast<int>((ns >> (e - 4)) & (kSub - 1));
    return std::min((e - 3) * kSub + sub, kSub * kPow - 1);
  }
  static double value(int b) {  // the bucket's lower bound
    if (b < kSub) return b;
    const int e = b / kSub + 3, sub = b % kSub;
    return double((std::uint64_t{1} << e) + (std::uint64_t(sub) << (e - 4)));
  }
  void add(std::uint64_t ns) { ++n[bucket(ns)]; }
  void merge(const Hist& o) {
    for (std::size_t i = 0; i < n.size(); ++i) n[i] += o.n[i];
  }
  double quantile(double q) const {
    std::uint64_t total = 0;
    for (auto c : n) total += c;
    if (!total) return 0.0;
    const auto want = static_cast<std::uint64_t>(q * double(total - 1));
    std::uint64_t seen = 0;
    for (std::size_t i = 0; i < n.size(); ++i) {
      seen += n[i];
      if (seen > want) return value(static_cast<int>(i));
    }
    return value(static_cast<int>(n.size() - 1));
  }
};

struct Inbox {  // blocks handed over by the previous thread (cross-thread frees)
  std::mutex mu;
  std::vector<std::pair<void*, std::size_t>> items;  // (block, size index); guarded by mu
};

struct alignas(64) RefRecord {  // one reference "block": the word its malloc and free write
  std::atomic<std::size_t> word{0};  // atomic: a record is reused by its ring while a neighbour frees it late
};
// Records a thread cycles through. Nothing bounds how long a neighbour holds one (a preempted
// receiver keeps its inbox while the producer's ring wraps), so a record may be reused while a late
// free is still to come: harmless, since the word is atomic and nothing reads it back.
constexpr std::size_t kRefRing = 256;

struct PerThread {
  std::vector<Hist> alloc_h, free_h;  // by size index
  std::vector<std::uint64_t> pairs;   // by size index
  std::string error;
};
}  // namespace

void bind_capi_threads(nb::module_& m) {
  m.def(
      "capi_bench_threads",
      [](int device, std::vector<std::size_t> sizes, std::size_t threads, double seconds, bool cross_thread_frees,
         nb::handle stream, std::size_t sample_every, double warmup, bool reference) {
        // Bounded: the threads run with the GIL released, so an endless window could not be
        // interrupted, and every thread keeps histograms per size.
        if (sizes.empty() || sizes.size() > 64 || threads == 0 || threads > 1024 || !(seconds > 0) ||
            !(seconds <= 3600) || sample_every == 0 || !(warmup >= 0) || !(warmup <= 3600))
          throw InvalidArgument(
              "capi_bench_threads: need 1..64 sizes, 1..1024 threads, 0 < seconds <= 3600, sample_every >= 1, "
              "0 <= warmup <= 3600");
        const Stream s = parse_stream(stream);
        constexpr int kBlocks = 8;
        const std::size_t nsz = sizes.size();
        std::vector<PerThread> per(threads);
        std::vector<Inbox> inbox(threads);
        // The reference's records outlive every thread: a neighbour may free one after its owner stopped.
        std::vector<RefRecord> rings(reference ? threads * kRefRing : 0);
        std::atomic<std::size_t> ready{0};
        std::atomic<bool> go{false}, stop{false}, measuring{warmup == 0};
        double elapsed = 0;
        std::string start_error;  // a thread the OS would not start: the others stop, then it is raised
        {
          ReleaseGil nogil;  // not nb::gil_scoped_release: see ReleaseGil (bindings.hpp)
          std::vector<std::thread> ts;
          ts.reserve(threads);
          for (std::size_t t = 0; t < threads && start_error.empty(); ++t) {
            try {
              ts.emplace_back([&, t] {
                PerThread& me = per[t];
                bool counted = false;  // this thread has been counted in `ready`
                // Out of memory in a worker (its histograms, the hand-over lists) ends the run with
                // an error instead of std::terminate; the short message needs no allocation.
                try {
                  me.alloc_h.resize(nsz);
                  me.free_h.resize(nsz);
                  me.pairs.assign(nsz, 0);
                  void* blk[kBlocks];
                  std::vector<std::pair<void*, std::size_t>> got;
                  std::size_t ring_next = 0;
                  auto fail = [&](const char* what) {
                    me.error = std::string(what) + ": " + poolkeeper_last_error();
                    stop.store(true);
                  };
                  auto do_malloc = [&](std::size_t n) -> void* {
                    if (!reference) return poolkeeper_malloc(n, device, s);
                    RefRecord& r = rings[t * kRefRing + ring_next++ % kRefRing];
                    r.word.store(n, std::memory_order_relaxed);
                    return &r;
                  };
                  auto do_free = [&](void* b) -> void {
                    if (reference) static_cast<RefRecord*>(b)->word.store(0, std::memory_order_relaxed);
                    else if (poolkeeper_free(b, device, s) != 0 && me.error.empty()) fail("poolkeeper_free");
                  };
                  // Warm: the first round may grow the pool and create this thread's cache.
                  for (std::size_t k = 0; k < nsz && me.error.empty(); ++k) {
                    for (auto& b : blk) b = do_malloc(sizes[k]);
                    for (auto& b : blk) {
                      if (!b) fail("warm-up poolkeeper_malloc");
                      else do_free(b);
                    }
                  }
                  ready.fetch_add(1);
                  counted = true;
                  while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
                  Inbox& mine = inbox[t];
                  Inbox& next = inbox[(t + 1) % threads];
                  bool counting = false;
                  for (std::uint64_t round = 0; !stop.load(std::memory_order_relaxed); ++round) {
                    if (!counting && measuring.load(std::memory_order_relaxed)) {  // the window opens: start afresh
                      counting = true;
                      for (std::size_t i = 0; i < nsz; ++i) me.alloc_h[i] = Hist(), me.free_h[i] = Hist(), me.pairs[i] = 0;
                    }
                    const std::size_t k = (t + round) % nsz;
                    const std::size_t n = sizes[k];
                    const bool timed = (round / nsz) % sample_every == 0;  // whole cycles: every size sampled
                    for (auto& b : blk) {
                      if (timed) {
                        const auto t0 = Clock::now();
                        b = do_malloc(n);
                        me.alloc_h[k].add(std::uint64_t((Clock::now() - t0).count()));
                      } else {
                        b = do_malloc(n);
                      }
                    }
                    bool ok = true;
                    for (auto& b : blk) ok &= b != nullptr;
                    if (!ok) {
                      for (auto& b : blk)
                        if (b) do_free(b);
                      fail("poolkeeper_malloc");
                      break;
                    }
                    bool handed = false;
                    if (cross_thread_frees && threads > 1) {
                      {
                        // Bounded hand-over: a receiver running behind would otherwise pile up live
                        // blocks without limit; then this round is freed here instead.
                        std::lock_guard<std::mutex> g(next.mu);
                        if (next.items.size() < 4 * kBlocks) {
                          for (void* b : blk) next.items.emplace_back(b, k);
                          handed = true;
                        }
                      }
                      std::lock_guard<std::mutex> g(mine.mu);
                      got.swap(mine.items);
                    }
                    if (!handed)
                      for (void* b : blk) got.emplace_back(b, k);
                    for (auto [b, kb] : got) {
                      if (timed) {
                        const auto t0 = Clock::now();
                        do_free(b);
                        me.free_h[kb].add(std::uint64_t((Clock::now() - t0).count()));
                      } else {
                        do_free(b);
                      }
                    }
                    got.clear();
                    me.pairs[k] += kBlocks;
                  }
                } catch (const std::exception&) {
                  me.error = "out of memory";
                  stop.store(true);
                  if (!counted) ready.fetch_add(1);
                }
              });
            } catch (const std::system_error& e) {
              start_error = std::string("could not start thread ") + std::to_string(t + 1) + " of " +
                            std::to_string(threads) + ": " + e.what();
              stop.store(true);
            }
          }
          while (ready.load() < ts.size()) std::this_thread::yield();
          go.store(true, std::memory_order_release);
          if (warmup > 0) {
            const auto w0 = Clock::now();
            while (!stop.load() && std::chrono::duration<double>(Clock::now() - w0).count() < warmup)
              std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
          const auto t0 = Clock::now();
          measuring.store(true);
          while (!stop.load() && std::chrono::duration<double>(Clock::now() - t0).count() < seconds)
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          stop.store(true);
          for (auto& th : ts) th.join();
          elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
          for (auto& ib : inbox)  // blocks handed over after their receiver stopped (no pool holds a reference record)
            if (!reference)
              for (auto& [b, kb] : ib.items) poolkeeper_free(b, device, s);
        }
        if (!start_error.empty()) throw Error("capi_bench_threads: " + start_error);
        for (auto& p : per)
          if (!p.error.empty()) throw Error("capi_bench_threads: " + p.error);
        std::uint64_t total = 0;
        nb::list per_size;
        for (std::size_t k = 0; k < nsz; ++k) {
          Hist ah, fh;
          std::uint64_t pairs = 0;
          for (auto& p : per) {
            ah.merge(p.alloc_h[k]);
            fh.merge(p.free_h[k]);
            pairs += p.pairs[k];
          }
          total += pairs;
          nb::dict d;
          d["nbytes"] = sizes[k];
          d["pairs"] = pairs;
          d["alloc_p50_ns"] = ah.quantile(0.50);
          d["alloc_p99_ns"] = ah.quantile(0.99);
          d["free_p50_ns"] = fh.quantile(0.50);
          d["free_p99_ns"] = fh.quantile(0.99);
          per_size.append(d);
        }
        nb::dict out;
        out["threads"] = threads;
        out["seconds"] = elapsed;
        out["pairs"] = total;
        out["pairs_per_s"] = double(total) / elapsed;
        out["per_size"] = per_size;
        return out;
      },
      "device"_a, "sizes"_a, "threads"_a, "seconds"_a = 1.0, "cross_thread_frees"_a = false,
      "stream"_a = nb::none(), "sample_every"_a = 8, "warmup"_a = 0.0, "reference"_a = false,
      "Run `threads` native threads doing rounds of 8 poolkeeper_malloc then 8 poolkeeper_free on the "
      "registered pool of `device` for `seconds`; returns aggregate pairs/s and per-size p50/p99 call "
      "latency (one cycle of sizes in sample_every timed). cross_thread_frees: each round's blocks are "
      "freed by the next thread. warmup: seconds of the same traffic before the measured window. "
      "reference: no pool, each call writes one word of a per-thread record (the pattern's own cost).");
}

}  // namespace poolkeeper::py
