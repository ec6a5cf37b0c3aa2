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
//
// Virtual memory (optional; supports_virtual() says whether an upstream has it): reserve a range
// of addresses once, then map physical memory onto granule-aligned pieces of it and unmap them
// again -- CUDA's cuMemAddressReserve / cuMemCreate+cuMemMap+cuMemSetAccess / cuMemUnmap+cuMemRelease.
// Counting: a map is the device cost of taking memory, an unmap that of giving it back, so each
// map counts as one allocation (bytes_allocated, outstanding) and each unmap as one deallocation;
// tables of upstream calls keep their meaning whichever way a pool takes its memory. maps/unmaps
// count the same calls again under their own names; reserves/unreserves are counted apart (they
// take no memory). Contracts:
// - reserve(bytes): bytes > 0, a multiple of vm_granularity(). Returns the range's base (aligned
//   to the granularity). Throws UpstreamOutOfMemory when the address space is not there.
// - map(addr, bytes): [addr, addr+bytes) granule-aligned, inside one reserved range, and not
//   mapped yet. Throws UpstreamOutOfMemory when the physical memory is not there, UpstreamFailure
//   otherwise; a failing map leaves nothing mapped (state unchanged).
// - unmap(addr, bytes): exactly one earlier map's range (pieces are unmapped whole, as CUDA
//   releases whole physical allocations). Throws UpstreamFailure; a failing unmap leaves the
//   piece mapped.
// - unreserve(addr, bytes): a whole range from reserve() with nothing mapped in it any more.
// Aliases (optional; supports_alias() says whether an upstream has them): a second mapping of
// physical memory that is already mapped, at another address (CUDA: cuMemMap of the same
// physical handle + cuMemSetAccess). They take no memory, so they are counted apart
// (aliases/unaliases), never as allocations.
// - alias(dst, src, bytes): [src, src+bytes) is exactly one earlier map's range, still mapped;
//   [dst, dst+bytes) is granule-aligned, inside a reserved range, and neither mapped nor aliased.
//   Afterwards the same bytes are reachable at both. Throws UpstreamFailure (a failing alias maps
//   nothing).
// - unalias(dst, bytes): exactly one earlier alias's range; the memory stays mapped at its source.
//   Throws UpstreamFailure (the alias stays).
// - unmap(src) while an alias of src exists, or unreserve of a range with an alias in it, is a
//   contract violation (UpstreamFailure on the simulated device and the fake driver).
// Runs: several pieces mapped (or aliased) end to end in one call, so that a device whose access
// grant covers any run of mappings grants it once (CUDA: cuMemMap per piece, then one
// cuMemSetAccess over the run, where map() pays one per piece). Each piece counts as one map
// (alias) and stays one piece (unmap/unalias take them one at a time).
// - map_pieces(addr, bytes, piece, done): [addr, addr+bytes) in pieces of `piece` bytes (the last
//   one what is left), each as map() would. Stops at the first refusal and rethrows it; `done`
//   holds the bytes mapped before it (mapped and accessible; a refused grant maps none: 0).
// - alias_pieces(dst, srcs, n, done): the n pieces srcs[i] (address, bytes) aliased end to end
//   from dst, each as alias() would. A refusal likewise: `done` holds the pieces aliased before it.
// - unmap_pieces(addr, sizes, n, done): the n pieces lying end to end from addr (sizes[i] bytes,
//   each exactly one earlier map's range), unmapped last first, each as unmap() would and counted
//   as one unmap. Stops at the first refusal and rethrows it; `done` holds how many of the last
//   pieces are unmapped (the first n - done stay mapped). n == 0 is refused.
// - unalias_pieces(dst, sizes, n, done): likewise for n aliases end to end from dst.
// The defaults call do_map/do_alias/do_unmap/do_unalias once per piece; an upstream overrides the
// do_*_pieces hooks to grant access once, or to take a run down in one driver call.
// Every call may come from any thread; a pool serializes the calls on its own range.
//
// CUDA-graph capture (capture.hpp; docs/integrations.md, "CUDA graphs"): while a stream is being
// captured, a call that may synchronize (cuMemAlloc, cuEventQuery, ...) invalidates a capture in
// the default ("global") mode unless the calling thread has switched itself to relaxed mode, and
// an event recorded on the capturing stream becomes part of the graph (it can never be queried).
// - stream_capturing(s): is s being captured now? (CUDA: cuStreamIsCapturing; a driver without
//   it, and every upstream without streams: false). Never throws.
// - exchange_capture_mode(m): set this thread's capture mode, returning the previous one
//   (CUstreamCaptureMode values: 0 global, 1 thread-local, 2 relaxed). No-op without CUDA.
// - captures_underway(): how many allocate-to-private-pool scopes (graph_pools.hpp) are open on
//   this upstream's device now; pools hand no memory back to it and never synchronize it while any
//   is (a free or a synchronize would invalidate the capture). The count belongs to the device, not
//   to the object (capture_counter()): two upstream objects of one CUDA device share it (a device
//   synchronize through either invalidates a capture opened through the other), an upstream that
//   adapts another (ForwardingUpstream) uses its inner one's, and a Simulated upstream, a device of
//   its own, has its own. capture_scope_begin/end move it; a scope may be opened through any of
//   them. Never throws; thread-safe.
// allocate/deallocate/map/unmap/reserve/unreserve run with the thread in relaxed mode (capture.hpp
// RelaxedCapture), so growth during a capture never invalidates it.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "poolkeeper/core/errors.hpp"
#include "poolkeeper/core/types.hpp"

namespace poolkeeper {

struct UpstreamCounters {
  std::uint64_t allocations = 0, deallocations = 0;
  std::uint64_t bytes_allocated = 0, bytes_deallocated = 0;  // cumulative
  std::uint64_t outstanding_bytes = 0, peak_outstanding_bytes = 0;
  std::uint64_t alloc_ns = 0, dealloc_ns = 0;  // cumulative wall time inside the calls
  std::uint64_t failed_allocations = 0, failed_deallocations = 0;
  // Virtual memory: maps/unmaps are also in allocations/deallocations (see above).
  std::uint64_t maps = 0, unmaps = 0, reserves = 0, unreserves = 0;
  std::uint64_t aliases = 0, unaliases = 0;  // second mappings (not allocations)
};

// The hooks of an upstream with virtual memory (supports_virtual()), declared once for every
// such upstream.
#define POOLKEEPER_VIRTUAL_UPSTREAM_HOOKS                                              \
  void* do_allocate(std::size_t nbytes) override;                                    \
  void do_deallocate(void* p, std::size_t nbytes) override;                          \
  std::uintptr_t do_reserve(std::size_t bytes) override;                             \
  void do_map(std::uintptr_t addr, std::size_t bytes) override;                      \
  void do_unmap(std::uintptr_t addr, std::size_t bytes) override;                    \
  void do_unreserve(std::uintptr_t addr, std::size_t bytes) override;                \
  void do_alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) override; \
  void do_unalias(std::uintptr_t dst, std::size_t bytes) override

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

  // --- virtual memory (see the contracts at the top); counted ---
  std::uintptr_t reserve(std::size_t bytes);
  void map(std::uintptr_t addr, std::size_t bytes);
  void unmap(std::uintptr_t addr, std::size_t bytes);
  void unreserve(std::uintptr_t addr, std::size_t bytes);
  void alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes);
  void unalias(std::uintptr_t dst, std::size_t bytes);
  struct AliasSource {
    std::uintptr_t src;  // one mapped piece
    std::size_t bytes;   // its size
  };
  void map_pieces(std::uintptr_t addr, std::size_t bytes, std::size_t piece, std::size_t& done);
  void alias_pieces(std::uintptr_t dst, const AliasSource* srcs, std::size_t n, std::size_t& done);
  void unmap_pieces(std::uintptr_t addr, const std::size_t* sizes, std::size_t n, std::size_t& done);
  void unalias_pieces(std::uintptr_t dst, const std::size_t* sizes, std::size_t n, std::size_t& done);
  virtual bool supports_virtual() const { return false; }
  virtual bool supports_alias() const { return false; }
  // The unit of reserve/map/unmap sizes and addresses (CUDA: cuMemGetAllocationGranularity).
  virtual std::size_t vm_granularity() const { return std::size_t{2} << 20; }
  // Physical memory the upstream can hand out in all, or 0 when unknown (sizes a default range).
  virtual std::size_t memory_capacity() const { return 0; }

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

  // --- CUDA-graph capture (see the contract at the top) ---
  virtual bool stream_capturing(Stream s) { return false; }
  virtual int exchange_capture_mode(int mode) { return mode; }
  int captures_underway() const { return capture_counter().load(std::memory_order_acquire); }
  void capture_scope_begin() { capture_counter().fetch_add(1, std::memory_order_acq_rel); }
  void capture_scope_end() { capture_counter().fetch_sub(1, std::memory_order_acq_rel); }

 protected:
  // The device's count of open capture scopes (see captures_underway): this object's own unless
  // it shares its device with other objects. Must live as long as any object that returns it.
  virtual std::atomic<int>& capture_counter() const { return captures_; }
  // Another upstream's counter (a decorator shares its inner upstream's).
  static std::atomic<int>& counter_of(const Upstream& u) { return u.capture_counter(); }
  virtual void* do_allocate(std::size_t nbytes) = 0;
  virtual void do_deallocate(void* p, std::size_t nbytes) = 0;
  // Defaults throw UpstreamFailure("... has no virtual memory"): only supports_virtual() upstreams override.
  virtual std::uintptr_t do_reserve(std::size_t bytes);
  virtual void do_map(std::uintptr_t addr, std::size_t bytes);
  virtual void do_unmap(std::uintptr_t addr, std::size_t bytes);
  virtual void do_unreserve(std::uintptr_t addr, std::size_t bytes);
  virtual void do_alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes);
  virtual void do_unalias(std::uintptr_t dst, std::size_t bytes);
  // Runs (see the contract at the top): the defaults call do_map / do_alias once per piece.
  // `done` counts what is mapped so far and must be right when a refusal is thrown.
  virtual void do_map_pieces(std::uintptr_t addr, std::size_t bytes, std::size_t piece, std::size_t& done);
  virtual void do_alias_pieces(std::uintptr_t dst, const AliasSource* srcs, std::size_t n, std::size_t& done);
  // `done` counts the last pieces taken down so far and must be right when a refusal is thrown.
  virtual void do_unmap_pieces(std::uintptr_t addr, const std::size_t* sizes, std::size_t n, std::size_t& done);
  virtual void do_unalias_pieces(std::uintptr_t dst, const std::size_t* sizes, std::size_t n, std::size_t& done);

 private:
  std::atomic<std::uint64_t> allocations_{0}, deallocations_{0}, bytes_allocated_{0}, bytes_deallocated_{0};
  std::atomic<std::uint64_t> outstanding_{0}, peak_outstanding_{0}, alloc_ns_{0}, dealloc_ns_{0};
  std::atomic<std::uint64_t> failed_allocations_{0}, failed_deallocations_{0};
  std::atomic<std::uint64_t> maps_{0}, unmaps_{0}, reserves_{0}, unreserves_{0}, aliases_{0}, unaliases_{0};
  mutable std::atomic<int> captures_{0};
  void count_alloc(std::size_t nbytes, std::uint64_t t0, std::uint64_t calls = 1);
  void count_dealloc(std::size_t nbytes, std::uint64_t t0, std::uint64_t calls = 1);
};

}  // namespace poolkeeper
