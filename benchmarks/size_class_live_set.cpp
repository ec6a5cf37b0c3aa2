// SizeClassPool's upstream allocations against the live set, in thread_scaling.py's
// "mixed, cross-thread frees" pattern (issue 20): does the pool ever take from the upstream what
// it holds free elsewhere (in another shard, on a remote list), or only what the live set needs?
//
// Each thread runs rounds of 8 allocations of one of 4 KiB / 256 KiB / 2 MiB / 32 MiB (in turn,
// offset by the thread's index), hands the round to the next thread (at most 32 blocks queued
// there; else frees it itself) and frees what the previous thread handed it -- the pattern of
// capi_bench_threads, on the pool directly (lock-free attempt, then the full path, as the C ABI
// does), over Simulated(latency none). Per class, the blocks live at once are counted after each
// allocation returns and before each free starts (so the count never exceeds the true number);
// the sum over classes of their peaks is a lower bound of the blocks any size-class pool must
// have held (classes do not share blocks). Prints one JSON object per thread count.
//
//   g++ -std=c++20 -O2 -Icpp/include benchmarks/size_class_live_set.cpp build/dev/libpoolkeeper_core.a \
//       -lpthread -ldl -o /tmp/size_class_live_set && /tmp/size_class_live_set 2 1,2,4,8,16
//   (build/dev/libpoolkeeper_core.a: left by tools/dev_build.sh)
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "poolkeeper/pools/size_class_pool.hpp"
#include "poolkeeper/upstreams/simulated_upstream.hpp"

using namespace poolkeeper;

namespace {
constexpr int kBlocks = 8, kQueued = 4 * kBlocks;
constexpr std::size_t kSizes[4] = {4 << 10, 256 << 10, 2 << 20, 32 << 20};

std::uint64_t extra(const PoolStats& st, const char* name) {
  for (auto& [k, v] : st.extra)
    if (k == name) return v;
  return 0;
}

void run(int threads, double seconds) {
  auto up = std::make_shared<SimulatedUpstream>(LatencyModel::none());
  auto pool = std::make_shared<SizeClassPool>(up);
  std::atomic<long> live[4] = {}, peak[4] = {};
  struct Inbox {
    std::mutex mu;
    std::vector<std::pair<void*, int>> items;
  };
  std::vector<Inbox> inbox(threads);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> pairs{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      std::vector<std::pair<void*, int>> got;
      std::uint64_t n = 0;
      for (std::uint64_t round = 0; !stop.load(std::memory_order_relaxed); ++round) {
        const int k = static_cast<int>((t + round) % 4);
        void* blk[kBlocks];
        for (auto& b : blk) {
          b = pool->try_allocate_fast(kSizes[k], kNoStream);
          if (!b) b = pool->allocate(kSizes[k], kNoStream);
          const long v = live[k].fetch_add(1) + 1;
          long p = peak[k].load();
          while (v > p && !peak[k].compare_exchange_weak(p, v)) {
          }
        }
        bool handed = false;
        if (threads > 1) {
          {
            Inbox& next = inbox[(t + 1) % threads];
            std::lock_guard<std::mutex> g(next.mu);
            if (next.items.size() < kQueued) {
              for (void* b : blk) next.items.emplace_back(b, k);
              handed = true;
            }
          }
          std::lock_guard<std::mutex> g(inbox[t].mu);
          got.swap(inbox[t].items);
        }
        if (!handed)
          for (void* b : blk) got.emplace_back(b, k);
        for (auto [b, kb] : got) {
          live[kb].fetch_sub(1);
          if (!pool->try_deallocate_fast(b, kNoStream)) pool->deallocate(b, kNoStream);
        }
        got.clear();
        n += kBlocks;
      }
      pairs += n;
    });
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : ts) t.join();
  for (auto& ib : inbox)
    for (auto [b, k] : ib.items) pool->deallocate(b, kNoStream);
  pool->validate();
  const PoolStats st = pool->stats();
  const long need = peak[0] + peak[1] + peak[2] + peak[3];
  std::printf(
      "{\"threads\": %d, \"seconds\": %.2f, \"pairs\": %llu, \"upstream_allocations\": %llu, "
      "\"upstream_deallocations\": %llu, \"live_blocks_at_class_peaks\": %ld, \"class_peaks\": [%ld, %ld, %ld, %ld], "
      "\"shard_migrations\": %llu, \"remote_frees\": %llu}\n",
      threads, seconds, static_cast<unsigned long long>(pairs.load()),
      static_cast<unsigned long long>(up->counters().allocations),
      static_cast<unsigned long long>(up->counters().deallocations), need, peak[0].load(), peak[1].load(),
      peak[2].load(), peak[3].load(), static_cast<unsigned long long>(extra(st, "shard_migrations")),
      static_cast<unsigned long long>(extra(st, "remote_frees")));
  std::fflush(stdout);
}
}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 2.0;
  std::string list = argc > 2 ? argv[2] : "1,2,4,8,16";
  for (std::size_t i = 0; i < list.size();) {
    const std::size_t j = list.find(',', i);
    run(std::atoi(list.substr(i, j - i).c_str()), seconds);
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return 0;
}
