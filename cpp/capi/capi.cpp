// The C ABI (see poolkeeper_capi.h). Exceptions stop here: each becomes a return code plus a
// thread-local message.
#include "poolkeeper_capi.h"

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "poolkeeper/pools/graph_registry.hpp"
#include "poolkeeper/core/registry.hpp"

#define PK_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
thread_local std::string t_last_error;
constexpr int kOk = 0, kInvalidArgument = 1, kInvalidPointer = 2, kOutOfMemory = 3, kUpstream = 4, kClosed = 5,
              kOther = 9;

int record(const std::exception& e, int code) {
  t_last_error = e.what();
  return code;
}

template <class F>
int guarded(F&& f) {
  using namespace poolkeeper;
  try {
    f();
    return kOk;
  } catch (const OutOfMemory& e) {
    return record(e, kOutOfMemory);
  } catch (const InvalidPointer& e) {
    return record(e, kInvalidPointer);
  } catch (const InvalidArgument& e) {
    return record(e, kInvalidArgument);
  } catch (const PoolClosed& e) {
    return record(e, kClosed);
  } catch (const UpstreamFailure& e) {
    return record(e, kUpstream);
  } catch (const std::exception& e) {
    return record(e, kOther);
  } catch (...) {
    t_last_error = "unknown error";
    return kOther;
  }
}

// Call timing (poolkeeper_capi.h). Relaxed atomics: the counters are statistics, read after the
// calls they count have returned on their threads.
std::atomic<bool> g_timing{false};
// One cache line each, so that malloc and free timing do not write the same line. The counters
// are still shared by every thread: timing is a diagnostic, and scales poorly across threads.
struct alignas(64) CallClock {
  std::atomic<std::uint64_t> calls{0}, ns{0};
};
CallClock g_malloc_clock, g_free_clock;

// Adds the wall time of its scope to a CallClock, when timing was on as the scope began.
class TimedCall {
 public:
  explicit TimedCall(CallClock& c) : c_(g_timing.load(std::memory_order_relaxed) ? &c : nullptr) {
    if (c_) t0_ = std::chrono::steady_clock::now();
  }
  ~TimedCall() {
    if (!c_) return;
    const auto d = std::chrono::steady_clock::now() - t0_;
    c_->ns.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()),
                     std::memory_order_relaxed);
    c_->calls.fetch_add(1, std::memory_order_relaxed);
  }
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

 private:
  CallClock* c_;
  std::chrono::steady_clock::time_point t0_{};
};

// `call` on the device's pool (pinned); when that pool refuses the pointer (or none is installed,
// the registry cleared), `elsewhere(refusing pool or null)` may know it: a block from before the
// device's pool was replaced that a GraphPools still serves -- a retired graph's, or one the
// replaced pool handed out during a capture. Asked only on that error path, so ordinary calls pay
// nothing for it; the error stands when it does not know the pointer either. Only for a device
// that can have graphs: the graph registry reads a negative index as "any device" (the record-
// stream hook, which is told none), so a free naming device -100 once freed device 0's graph block.
template <class Call, class Elsewhere>
void or_elsewhere(int device, Call&& call, Elsewhere&& elsewhere) {
  const poolkeeper::Pool* refused_by = nullptr;
  const bool has_graphs = device >= 0 && device < poolkeeper::registry::kMaxDevices;
  try {
    const poolkeeper::registry::Pinned p(device);
    refused_by = p.get();
    p->check_not_forked();
    call(*p.get());
  } catch (const poolkeeper::InvalidPointer&) {
    if (!has_graphs || !elsewhere(refused_by)) throw;
  } catch (const poolkeeper::InvalidArgument&) {
    if (!has_graphs || !elsewhere(refused_by)) throw;
  }
}

// A free the device's pool takes on its lock-free path (a thread-cache hit): that block is the
// pool's own, since no graph's block starts where a device-pool block does (see GraphPools), so
// it needs no graph lookup -- which, while any graph holds blocks, takes the GraphPools's lock.
// False sends the free down the full path (graphs first, then the pool, errors explained there).
bool free_fast(int device, void* ptr, poolkeeper::Stream s) noexcept {
  try {
    const poolkeeper::registry::Pinned p(device);
    return !p->forked() && p->try_deallocate_fast(ptr, s);
  } catch (...) {
    return false;  // a bad index, no pool: the full path reports it (or finds the block elsewhere)
  }
}

poolkeeper::Stream torch_stream(void* s) { return static_cast<poolkeeper::Stream>(reinterpret_cast<std::uintptr_t>(s)); }
}  // namespace

PK_EXPORT void* poolkeeper_malloc(size_t size, int device, uint64_t stream) {
  const TimedCall timed(g_malloc_clock);
  void* out = nullptr;
  guarded([&] {
    // While a CUDA-graph scope is open on the device, its GraphPools decides (graph_pools.hpp).
    // Pinned: a get() or clear() on another thread may replace that GraphPools meanwhile.
    {
      const poolkeeper::graph_registry::Pinned g(device);
      if (poolkeeper::GraphPools* gp = g.get(); gp && gp->routing()) {
        try {
          out = gp->allocate(size, stream);
        } catch (const poolkeeper::CaptureFilterAbort& a) {
          // A Python filter was interrupted (Ctrl-C). This caller is a framework's allocator and
          // cannot raise it: the interrupt is raised again once Python runs, and the filter that
          // could not answer does not claim the allocation (the device pool serves it).
          if (a.redeliver) a.redeliver();
          out = gp->main()->allocate(size, stream);
        }
        return;
      }
    }
    const poolkeeper::registry::Pinned p(device);  // stays alive even if replaced meanwhile
    p->check_not_forked();
    out = p->try_allocate_fast(size, stream);
    if (!out) out = p->allocate(size, stream);
  });
  return out;
}

PK_EXPORT int poolkeeper_free(void* ptr, int device, uint64_t stream) {
  const TimedCall timed(g_free_clock);
  return guarded([&] {
    if (free_fast(device, ptr, stream)) return;
    {
      const poolkeeper::graph_registry::Pinned g(device);
      if (poolkeeper::GraphPools* gp = g.get(); gp && gp->deallocate_private(ptr, stream))
        return;  // a graph's block goes back to its private pool
    }
    or_elsewhere(
        device, [&](poolkeeper::Pool& p) { p.deallocate(ptr, stream); },  // (free_fast tried the lock-free path)
        [&](const poolkeeper::Pool* refused_by) {
          return poolkeeper::graph_registry::deallocate_elsewhere(device, ptr, stream, refused_by);
        });
  });
}

PK_EXPORT void* poolkeeper_torch_malloc(size_t size, int device, void* stream) {
  if (size == 0) return nullptr;
  return poolkeeper_malloc(size, device, torch_stream(stream));
}

PK_EXPORT void poolkeeper_torch_free(void* ptr, size_t, int device, void* stream) {
  if (!ptr) return;
  poolkeeper_free(ptr, device, torch_stream(stream));
}

PK_EXPORT int poolkeeper_torch_record_stream(void* ptr, int device, void* stream) {
  return guarded([&] {
    {
      const poolkeeper::graph_registry::Pinned g(device);
      if (poolkeeper::GraphPools* gp = g.get(); gp && gp->record_stream_private(ptr, torch_stream(stream))) return;
    }
    or_elsewhere(
        device, [&](poolkeeper::Pool& p) { p.record_stream(ptr, torch_stream(stream)); },
        [&](const poolkeeper::Pool* refused_by) {
          return poolkeeper::graph_registry::record_stream_elsewhere(device, ptr, torch_stream(stream), refused_by);
        });
  });
}

PK_EXPORT int64_t poolkeeper_empty_cache(void) {
  std::size_t total = 0;
  // Each pool on its own: a closed (or failing) pool must not keep the others from trimming. The
  // last failure stays readable through poolkeeper_last_error().
  std::vector<std::pair<int, std::shared_ptr<poolkeeper::Pool>>> pools;
  // First the graphs' pools released earlier that could not close then: their memory goes back
  // to the device pools, which the trims below can return.
  guarded([&] { poolkeeper::graph_registry::close_deferred(); });
  guarded([&] { pools = poolkeeper::registry::all(); });
  for (auto& [d, p] : pools) {
    if (p->closed()) continue;  // (a forked pool is closed too)
    guarded([&] { total += p->trim(); });
  }
  return total > static_cast<std::size_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(total);
}

PK_EXPORT const char* poolkeeper_last_error(void) { return t_last_error.c_str(); }

PK_EXPORT int poolkeeper_set_call_timing(int on) {
  if (on < 0) return g_timing.load(std::memory_order_relaxed) ? 1 : 0;
  return g_timing.exchange(on != 0, std::memory_order_relaxed) ? 1 : 0;
}

PK_EXPORT void poolkeeper_call_timing(uint64_t* out4) {
  if (!out4) return;
  out4[0] = g_malloc_clock.calls.load(std::memory_order_relaxed);
  out4[1] = g_malloc_clock.ns.load(std::memory_order_relaxed);
  out4[2] = g_free_clock.calls.load(std::memory_order_relaxed);
  out4[3] = g_free_clock.ns.load(std::memory_order_relaxed);
}

// ---- CUDA-graph private pools (graph_pools.hpp), plain C for callers other than PyTorch ----

PK_EXPORT int poolkeeper_graph_begin(int device, uint64_t id0, uint64_t id1, uint64_t stream) {
  return guarded([&] {
    const poolkeeper::Stream s = stream;
    poolkeeper::graph_registry::get(device)->begin({id0, id1}, [s](poolkeeper::Stream x) { return x == s; });
  });
}

PK_EXPORT int poolkeeper_graph_end(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] { poolkeeper::graph_registry::end(device, {id0, id1}); });
}

PK_EXPORT int poolkeeper_graph_release(int device, uint64_t id0, uint64_t id1) {
  return guarded([&] {
    poolkeeper::graph_registry::release(device, {id0, id1});
  });
}
