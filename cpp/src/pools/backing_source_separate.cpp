// SeparateBackings: each backing is one upstream allocation (backing_source.hpp).
#include <algorithm>
#include <atomic>
#include <cmath>

#include "poolkeeper/pools/arena_pool.hpp"

namespace poolkeeper::detail {

class SeparateBackings final : public BackingSource {
 public:
  using BackingSource::BackingSource;

  // The upstream call runs with the lock let go: a cuMemAlloc costs 90-900 us, and under the lock
  // every other thread of the shard waited for it, even those its free memory could serve. The
  // bytes are claimed in the budget first, so concurrent growths cannot pass the limit together.
  ArenaChunk* grow(std::size_t rounded, std::unique_lock<SpinMutex>& g, Stream) override {
    const ArenaOptions& opt = a_.opt_;
    const bool oversize = rounded > opt.oversize_threshold;
    std::size_t size = rounded;
    if (!oversize) {
      // The ramp remembers how far it went: after a shrink, regrowth takes full-size backings
      // rather than climbing again from initial_backing (which multiplied upstream calls).
      const double ramp = double(opt.initial_backing) * std::pow(opt.growth_factor, double(ramp_steps_));
      const std::size_t r = ramp >= double(opt.max_backing) ? opt.max_backing : static_cast<std::size_t>(ramp);
      size = std::max(rounded, align_up(r, opt.alignment));
    }
    // Bytes on their way back count against the limit (a refused release comes back).
    if (!(size = a_.budget_.grant(rounded, size, opt.alignment)) || !a_.budget_.claim(size)) throw LimitHit{};
    InFlight in_flight{*this, size - rounded};  // ends under the lock, whichever way grow() leaves
    void* p = nullptr;
    for (;;) {
      g.unlock();
      bool again = false;
      try {
        p = a_.upstream_alloc(size);
      } catch (const UpstreamOutOfMemory&) {
        g.lock();
        a_.budget_.cancel(size);
        if (size == rounded) throw;
        size = rounded;  // the ramp asked for more than needed: ask for just the request
        in_flight.set_spare(0);
        if (!a_.budget_.claim(size)) throw LimitHit{};
        again = true;
      } catch (...) {
        g.lock();
        a_.budget_.cancel(size);
        throw;
      }
      if (!again) break;
    }
    g.lock();
    a_.budget_.cancel(size);  // adopt_locked() books them as reserved
    if (a_.closed()) {
      // Closed while the upstream was busy (close() needs a quiet pool; this keeps the memory
      // from leaking all the same). The lock is held again when grow() throws (its contract).
      g.unlock();
      try {
        a_.give_back_after_close(p, size);
      } catch (...) {
        g.lock();
        throw;
      }
    }
    ++a_.ev_.backings_created;
    if (oversize) ++a_.ev_.oversize_backings_created;
    return adopt(reinterpret_cast<std::uintptr_t>(p), size, oversize)->first;
  }

  // Waits only for growths whose spare (the step beyond their own request) could serve `rounded`:
  // an oversize request, or a step cut to its request, serves no one else, and waiting behind it
  // made N concurrent oversize requests pay N upstream calls one after another (hostile probing).
  bool wait_for_growth(std::unique_lock<SpinMutex>& g, std::size_t rounded) override {
    const std::uint32_t n = growing_.load(std::memory_order_acquire);
    if (!n || spare_in_flight_ < rounded) return false;
    g.unlock();
    growing_.wait(n, std::memory_order_acquire);
    g.lock();
    return true;
  }

  // Wholly free, non-resident backings: all of them, or those wholly free for shrink_hysteresis
  // consecutive scans.
  std::size_t release_free(Detached& out, bool hysteresis) override {
    std::size_t bytes = 0;
    for (ArenaBacking* b : std::vector<ArenaBacking*>(a_.backings_)) {
      std::uint64_t used = 0;
      if (b->resident || !wholly_free(b, &used)) {
        b->free_scans = 0;
        continue;
      }
      if (hysteresis && !a_.scan_may_release(b->free_scans = idle_scans_after(true, used, a_.scan_epoch_, b->free_scans)))
        continue;
      bytes += b->size;
      a_.release_backing_locked(b, out);
    }
    return bytes;
  }

  std::size_t release_for_oom(Detached& out) override { return release_free(out, false); }

  ArenaChunk* readopt(void* p, std::size_t n) override {
    return adopt(reinterpret_cast<std::uintptr_t>(p), n, n > a_.opt_.oversize_threshold)->first;
  }

  void close(Detached& out) override {
    for (ArenaBacking* b : std::vector<ArenaBacking*>(a_.backings_)) a_.release_backing_locked(b, out);
  }

  void release_unused(Detached& out) override {
    for (ArenaBacking* b : std::vector<ArenaBacking*>(a_.backings_))
      if (wholly_free(b)) a_.release_backing_locked(b, out);
  }

  void validate(const std::function<void(const std::string&)>&) const override {}
  void stats(PoolStats&) const override {}

 private:
  ArenaBacking* adopt(std::uintptr_t addr, std::size_t size, bool oversize) {
    // The first ramp backing is resident: a steady small workload keeps a warm arena. An inner
    // shard keeps none: its thread may never come back, and trim() must return all of it.
    const bool resident = !oversize && !resident_assigned_ && !a_.shard_child_;
    resident_assigned_ |= resident;
    if (!oversize) ++ramp_steps_;
    return a_.adopt_locked(addr, size, oversize, resident);
  }

  // Growths in their upstream call: how many (written under the arena's lock, waited on without
  // it) and the bytes their steps hold beyond their own requests (guarded by the arena's lock).
  // Invariant, under the lock: spare_in_flight_ == sum of the InFlight spares alive.
  class InFlight {
   public:
    InFlight(SeparateBackings& src, std::size_t spare) : src_(src), spare_(spare) {
      src_.spare_in_flight_ += spare_;
      src_.growing_.fetch_add(1, std::memory_order_relaxed);
    }
    void set_spare(std::size_t spare) {
      src_.spare_in_flight_ = src_.spare_in_flight_ - spare_ + spare;
      spare_ = spare;
    }
    ~InFlight() {
      src_.spare_in_flight_ -= spare_;
      src_.growing_.fetch_sub(1, std::memory_order_release);
      src_.growing_.notify_all();
    }

   private:
    SeparateBackings& src_;
    std::size_t spare_;
  };
  std::atomic<std::uint32_t> growing_{0};
  std::size_t spare_in_flight_ = 0;

  bool resident_assigned_ = false;
  std::size_t ramp_steps_ = 0;  // ramp backings ever made: the ramp never restarts after a shrink
};

std::unique_ptr<BackingSource> make_separate_backings(ArenaPool& arena) {
  return std::make_unique<SeparateBackings>(arena);
}

}  // namespace poolkeeper::detail
