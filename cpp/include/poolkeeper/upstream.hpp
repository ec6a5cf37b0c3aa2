// Upstream: where backing memory comes from. Gives memory in big pieces, takes it back, and
// counts every call: on a device the call count *is* the cost, and it carries no machine noise.
//
// An upstream also owns the stream interface of its device (events on streams), because only it
// knows what a stream is there: CUDA events on a GPU, a virtual clock on the simulated device,
// nothing at all on the host (every event is complete at once).
//
// Thread safety: every member may be called from any thread concurrently.
// Errors: allocate throws UpstreamOutOfMemory when the memory is not there and UpstreamFailure
// (with the driver's error name) for anything else; deallocate throws UpstreamFailure. A throwing
// call changes no counter except failed_*.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "poolkeeper/errors.hpp"
#include "poolkeeper/types.hpp"

namespace poolkeeper {

struct UpstreamCounters {
  std::uint64_t allocations = 0, deallocations = 0;
  std::uint64_t bytes_allocated = 0, bytes_deallocated = 0;  // cumulative
  std::uint64_t outstanding_bytes = 0, peak_outstanding_bytes = 0;
  std::uint64_t alloc_ns = 0, dealloc_ns = 0;  // cumulative wall time inside the calls
  std::uint64_t failed_allocations = 0, failed_deallocations = 0;
};

class Upstream {
 public:
  virtual ~Upstream() = default;
  Upstream() = default;
  Upstream(const Upstream&) = delete;
  Upstream& operator=(const Upstream&) = delete;

  // Backing memory of at least nbytes (nbytes > 0), aligned to alignment(). Counted.
  void* allocate(std::size_t nbytes);
  // Return memory obtained from allocate with the same nbytes. Counted.
  void deallocate(void* p, std::size_t nbytes);

  UpstreamCounters counters() const;
  void reset_counters();

  virtual std::string name() const = 0;
  virtual MemoryKind kind() const = 0;
  virtual int device() const { return -1; }
  virtual std::size_t alignment() const { return 256; }

  // --- stream interface (defaults: a host with no streams; every event complete at once) ---
  virtual bool streams_supported() const { return false; }
  // Record an event on stream s covering all work enqueued on s so far. kNullEvent = complete.
  virtual EventId record_event(Stream s) { return kNullEvent; }
  // Has the event's work completed? Must be cheap (called on allocation pressure).
  virtual bool query_event(EventId e) { return true; }
  // Block the host until the event has completed.
  virtual void wait_event(EventId e) {}
  // The pool no longer needs the event.
  virtual void release_event(EventId e) {}
  // Block until all work on the device has completed.
  virtual void synchronize() {}

 protected:
  virtual void* do_allocate(std::size_t nbytes) = 0;
  virtual void do_deallocate(void* p, std::size_t nbytes) = 0;

 private:
  std::atomic<std::uint64_t> allocations_{0}, deallocations_{0}, bytes_allocated_{0}, bytes_deallocated_{0};
  std::atomic<std::uint64_t> outstanding_{0}, peak_outstanding_{0}, alloc_ns_{0}, dealloc_ns_{0};
  std::atomic<std::uint64_t> failed_allocations_{0}, failed_deallocations_{0};
};

}  // namespace poolkeeper
