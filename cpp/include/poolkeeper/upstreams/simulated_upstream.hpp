// Simulated: a device that does not exist, so CI can test device logic without a GPU.
//
// - Addresses are fake and never touched: they come from a 1 TiB virtual range of its own (one
//   per instance, so two simulated devices never share an address), so a GB-scale
//   high-water mark costs nothing. A capacity (default 140 GiB, an H200) is enforced, so upstream
//   exhaustion is real.
// - Latency: each call busy-waits a calibrated time. The "h200" model is fitted on
//   measured by a native C++ loop on an H200 host (benchmarks/results/cuda_alloc_h200.txt): a cudaMalloc+cudaFree pair costs 86.1 us + 0.787 us per MiB
//   (1 MiB: 86.9 us, 1 GiB: 892 us), split evenly between the two calls. latency_us=x makes every
//   call cost x us (0 for fast tests).
// - Streams and events run on a deterministic virtual clock (microseconds): enqueue(s, work)
//   makes stream s busy until max(now, busy(s)) + work; an event recorded on s completes when the
//   clock reaches the busy time of s at recording; advance() moves the clock; synchronize() jumps
//   it to the end of all enqueued work. Any stream id may be used; unknown ids are idle streams.
//   destroy_stream(s) models cuStreamDestroy: work already enqueued on s still completes (the
//   clock and synchronize() still see it), but recording an event on s or enqueueing on it fails
//   with UpstreamFailure CUDA_ERROR_INVALID_HANDLE, as the driver answers for a dead handle. A
//   later new_stream() never returns a destroyed id.
// - Virtual memory (supports_virtual()): reserve() takes a 2 MiB-aligned range from the same fake
//   address space (it costs nothing and counts against no capacity); map()/unmap() of
//   granule-aligned pieces inside it count against the capacity like allocations, and every
//   contract of upstream.hpp is checked (a map over a mapped piece, outside a range, an unmap that
//   is not exactly one earlier map: UpstreamFailure). Aliases (supports_alias()): a second
//   mapping of one mapped piece at another address of a reserved range; no capacity; an unmap of
//   a piece with aliases left, an alias over anything mapped or aliased, an unreserve with aliases
//   left: UpstreamFailure. An alias costs what a map costs, an unalias what an unmap costs (the
//   same driver calls minus create/release). Latency ASSUMPTION until measured on the
//   H200: a map costs what the model's allocation of the same size costs, an unmap what its free
//   costs (cuMemCreate+cuMemMap+cuMemSetAccess and cuMemUnmap+cuMemRelease are of the order of
//   cudaMalloc/cudaFree); reserve/unreserve cost nothing.
// - Graph capture, a model of CUDA's rules (capture.hpp) so CI can check that pools keep a capture
//   valid: begin_capture(s, mode) / end_capture(s) (true when the capture stayed valid). While
//   any capture is active, a call that would invalidate one on a GPU is a *violation*: counted,
//   described (last_capture_violation()), and every active capture is marked invalid; the call
//   itself still succeeds. Violations: allocate/query_event/wait_event/map while a global-mode
//   capture is active and the calling thread is not in relaxed mode; deallocate/unmap/synchronize
//   (they synchronize the device) during any capture; record_event on a capturing stream.
//
// - A request the device cannot hold fails before any latency is paid; one call never busy-waits
//   longer than kMaxSimulatedCallUs. enqueue()/advance() refuse negative and non-finite times
//   (InvalidArgument), which would never complete.
//
// Thread safety: all members may be called concurrently (one internal mutex).
#pragma once
#include <map>
#include <string>
#include <mutex>

#include "poolkeeper/detail/fork_safe_mutex.hpp"
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "poolkeeper/core/upstream.hpp"

namespace poolkeeper {

struct LatencyModel {
  double alloc_base_us = 0, alloc_per_mib_us = 0, free_base_us = 0, free_per_mib_us = 0;
  static LatencyModel none() { return {}; }
  static LatencyModel fixed(double us) { return {us, 0, us, 0}; }
  static LatencyModel h200() { return {43.05, 0.3935, 43.05, 0.3935}; }
  double alloc_us(std::size_t n) const { return alloc_base_us + alloc_per_mib_us * double(n) / 1048576.0; }
  double free_us(std::size_t n) const { return free_base_us + free_per_mib_us * double(n) / 1048576.0; }
};

class SimulatedUpstream final : public Upstream {
 public:
  explicit SimulatedUpstream(LatencyModel model = LatencyModel::h200(),
                             std::size_t capacity = std::size_t{140} << 30, std::size_t alignment = 256);
  std::string name() const override { return "Simulated"; }
  MemoryKind kind() const override { return MemoryKind::Device; }
  std::size_t alignment() const override { return alignment_; }
  const LatencyModel& model() const { return model_; }
  std::size_t capacity() const { return capacity_; }
  std::size_t memory_capacity() const override { return capacity_; }
  bool supports_virtual() const override { return true; }
  bool supports_alias() const override { return true; }
  std::size_t vm_granularity() const override { return kGranule; }
  static constexpr std::size_t kGranule = std::size_t{2} << 20;
  std::size_t mapped_bytes() const;  // all ranges together
  std::size_t aliased_bytes() const;  // second mappings, all ranges together (no memory)
  // The memory behind the byte at `addr`: the address of that byte in its first mapping (addr
  // itself in a mapped piece, the source piece's byte through an alias); 0 when nothing maps it.
  // Tests use it to prove that no physical byte is reachable through two live blocks.
  std::uintptr_t physical(std::uintptr_t addr) const;

  // --- the virtual device ---
  Stream new_stream();
  void destroy_stream(Stream s);  // InvalidArgument for the default stream 0 or kNoStream
  std::uint64_t events_recorded() const;
  void enqueue(Stream s, double work_us);
  void advance(double us);
  double now() const;
  double stream_busy_until(Stream s) const;
  std::size_t live_events() const;

  bool streams_supported() const override { return true; }
  EventId record_event(Stream s) override;
  bool query_event(EventId e) override;
  void wait_event(EventId e) override;
  void release_event(EventId e) override;
  void synchronize() override;

  // --- graph capture (the model above) ---
  void begin_capture(Stream s, int mode = 0);
  bool end_capture(Stream s);
  bool stream_capturing(Stream s) override;
  int exchange_capture_mode(int mode) override;
  std::uint64_t capture_violations() const;
  std::string last_capture_violation() const;

 protected:
  POOLKEEPER_VIRTUAL_UPSTREAM_HOOKS;

 private:
  struct Range {
    std::size_t size = 0;
    std::map<std::uintptr_t, std::size_t> pieces;  // mapped: address -> bytes
    std::map<std::uintptr_t, std::pair<std::uintptr_t, std::size_t>> aliases;  // address -> (source piece, bytes)
  };
  bool occupied_locked(const Range& r, std::uintptr_t addr, std::size_t bytes) const;
  std::map<std::uintptr_t, std::size_t> alias_refs_;  // source piece -> aliases of it
  double busy_locked(Stream s) const;
  // A call that would invalidate an active capture on a GPU: record it (under mu_).
  void check_capture_locked(const char* call, bool synchronizes);
  [[noreturn]] void throw_oom_locked(std::size_t nbytes) const;
  std::uintptr_t place_locked(std::size_t span, std::size_t align);  // a free stretch of fake addresses
  Range* range_of_locked(std::uintptr_t addr, std::size_t bytes);
  std::map<std::uintptr_t, Range> ranges_;  // reserved; their addresses sit in live_ too
  LatencyModel model_;
  std::size_t capacity_, alignment_;
  mutable detail::ForkSafeMutex mu_;  // free in a forked child (see fork_safe_mutex.hpp)
  std::uintptr_t base_, next_addr_;
  std::size_t used_ = 0;
  std::map<std::uintptr_t, std::size_t> live_;  // validates every free the pools make
  double now_ = 0;
  Stream next_stream_ = 1;
  std::unordered_map<Stream, double> busy_;
  std::unordered_set<Stream> destroyed_;
  std::uint64_t events_recorded_ = 0;
  std::vector<double> event_time_;  // index = id - 1; <0 = released
  std::vector<EventId> free_events_;
  struct Capture {
    int mode = 0;
    bool valid = true;
  };
  std::map<Stream, Capture> captures_;  // guarded by mu_
  std::uint64_t capture_violations_ = 0;
  std::string last_violation_;
};

void busy_wait_us(double us);

// The longest one simulated call busy-waits (1 s): a real cudaMalloc of the whole of an H200
// costs well under that, and a bound keeps a hostile size (whose modelled cost would be days)
// from holding a thread -- and Ctrl-C -- hostage. Latencies above it are refused.
inline constexpr double kMaxSimulatedCallUs = 1e6;

}  // namespace poolkeeper
