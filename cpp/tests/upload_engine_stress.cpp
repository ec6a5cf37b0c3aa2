// Native stress of the upload engine's Host backend (for the sanitizers): many uploads of odd
// sizes through engines of several thread counts, with faults injected at random chunks, two
// engines running at once, close() while an upload runs. Every successful upload is verified
// byte for byte; a failed one must report its injected error and leave no copy running.
//   upload_engine_stress [--rounds N] [--seed S]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "poolkeeper/core/errors.hpp"
#include "poolkeeper/staging/upload_engine.hpp"

using namespace poolkeeper;

namespace {
int failures = 0;
void expect(bool ok, const char* what, int round) {
  if (!ok) {
    std::fprintf(stderr, "FAIL round %d: %s\n", round, what);
    ++failures;
  }
}

void run_engine(unsigned threads, int rounds, unsigned seed) {
  std::mt19937_64 rng(seed);
  UploadEngine eng(threads);
  const std::size_t chunk = 64 * 1024;
  std::vector<std::vector<char>> bufs(threads * 2, std::vector<char>(chunk));
  for (int r = 0; r < rounds; ++r) {
    const std::size_t n = rng() % (40 * chunk);
    std::vector<char> src(n), dst(n, 0);
    for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<char>(rng());
    UploadRequest q;
    q.src = src.data();
    q.total = n;
    q.dst = reinterpret_cast<std::uintptr_t>(dst.data());
    const std::size_t nb = 2 + rng() % (bufs.size() - 1);
    for (std::size_t i = 0; i < nb; ++i) q.buffers.push_back({bufs[i].data(), chunk});
    q.chunk = chunk;
    q.ramp = rng() % 2;
    q.nt_fill = rng() % 2;
    const int fault = static_cast<int>(rng() % 4);  // 0: none, 1: fill, 2: copy, 3: record
    const long long at = static_cast<long long>(rng() % 12);
    if (fault == 1) q.fail_fill_at = at;
    if (fault == 2) q.fail_copy_at = at;
    if (fault == 3) q.fail_record_at = at;
    eng.start(std::move(q));
    eng.wait(-1);
    const UploadOutcome o = eng.outcome();
    std::uint64_t sum = 0;
    for (auto b : o.buffer_bytes) sum += b;
    expect(sum == o.counters.bytes, "per-buffer bytes add up", r);
    if (o.error) {
      expect(fault != 0, "an error without a fault", r);
      expect(o.lost.size() == (fault == 3 ? 1u : 0u), "lost buffers", r);
    } else {
      expect(o.counters.bytes == n, "all bytes landed", r);
      expect(std::memcmp(src.data(), dst.data(), n) == 0, "bytes verified", r);
      expect(o.lost.empty(), "no lost buffer", r);
    }
  }
  // close() while an upload runs: it cancels and waits.
  std::vector<char> src(64 * chunk, 1), dst(64 * chunk);
  UploadRequest q;
  q.src = src.data();
  q.total = src.size();
  q.dst = reinterpret_cast<std::uintptr_t>(dst.data());
  for (auto& b : bufs) q.buffers.push_back({b.data(), chunk});
  q.chunk = chunk;
  eng.start(std::move(q));
  eng.close();
  expect(eng.finished(), "finished after close", -1);
}
}  // namespace

int main(int argc, char** argv) {
  int rounds = 200;
  unsigned seed = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seed")) seed = static_cast<unsigned>(std::atoi(argv[i + 1]));
  }
  std::thread a([&] { run_engine(3, rounds, seed); });
  std::thread b([&] { run_engine(1, rounds, seed + 1); });
  run_engine(5, rounds / 2, seed + 2);
  a.join();
  b.join();
  std::printf("upload_engine_stress: %d failures\n", failures);
  return failures ? 1 : 0;
}
