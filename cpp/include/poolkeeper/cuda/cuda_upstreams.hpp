// CUDA upstreams over the driver API (cuda_driver.hpp), usable under every pool.
//
// - CudaDeviceUpstream(device): cuMemAlloc / cuMemFree. cuMemFree may synchronize the device
//   (the driver's behaviour), which is why pools hold backings instead of returning them.
// - CudaAsyncUpstream(device, stream): cuMemAllocAsync / cuMemFreeAsync on the device's default
//   pool, ordered on `stream` (0 = the legacy default stream). Holds a warm-pool handle
//   (warm_pool.hpp) for its lifetime unless constructed with warm=false.
// - CudaVirtualUpstream(device): the virtual memory interface (upstream.hpp) over the driver's
//   VMM calls: reserve = cuMemAddressReserve (aligned to the granularity), map = cuMemCreate
//   (pinned, on the device) + cuMemMap + cuMemSetAccess (read/write for the device), unmap =
//   cuMemUnmap + cuMemRelease, unreserve = cuMemAddressFree. Each mapped piece keeps its physical
//   handle, so unmap releases exactly what map created (pieces are unmapped whole). A failing map
//   undoes its own steps (unmap, release) before throwing. alias = cuMemMap of a mapped piece's
//   handle at a second address + cuMemSetAccess; unalias = cuMemUnmap of that address (the handle
//   stays with its piece, which refuses to be unmapped while aliases of it remain). allocate(n) is a reserve + map of one
//   piece (n rounded up to the granularity) and deallocate its undo, so it also serves every pool.
//   vm_granularity() = cuMemGetAllocationGranularity(MINIMUM); memory_capacity() = total memory.
//   Needs the driver's VMM entry points and the device attribute
//   VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; otherwise construction throws CudaUnavailable.
// - CudaPinnedUpstream(device): page-locked host memory, cuMemHostAlloc(PORTABLE) / cuMemFreeHost,
//   kind Pinned. No streams of its own.
//
// The two device upstreams implement the stream interface with real CUDA events, so the pools'
// stream-ordered release (stream_order.hpp) runs on the device:
// - record_event(s): an event from a per-upstream pool of reusable events created with
//   CU_EVENT_DISABLE_TIMING, recorded on stream s in s's context; returns its id. kNoStream
//   (no stream: nothing to wait for) returns kNullEvent.
// - query_event(e): cuEventQuery; CUDA_ERROR_NOT_READY is "not yet" (false), never an error and
//   never latched; any other failure throws UpstreamFailure.
// - wait_event(e): cuEventSynchronize. release_event(e): the event goes back to the free list.
// - synchronize(): cuCtxSynchronize in the device's primary context.
// - captures_underway() counts the capture scopes opened through every device upstream of the
//   same device (CudaDevice, CudaAsync, CudaVirtual: one process-wide count per device), since a
//   device synchronize or free through any of them invalidates a capture opened through another.
//
// Every call makes the device's primary context current for its duration and restores the
// calling thread's previous context. Errors: UpstreamOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY,
// UpstreamFailure (with the CUDA error's name) otherwise; constructing one without a driver or
// device throws CudaUnavailable, with a bad device index InvalidArgument.
// Thread safety: every member may be called concurrently.
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "poolkeeper/core/upstream.hpp"
#include "poolkeeper/cuda/warm_pool.hpp"

namespace poolkeeper {

// The event pool behind the device upstreams' stream interface.
class CudaEventPool {
 public:
  explicit CudaEventPool(int device) : device_(device) {}
  ~CudaEventPool();
  CudaEventPool(const CudaEventPool&) = delete;
  CudaEventPool& operator=(const CudaEventPool&) = delete;

  EventId record(Stream s);
  bool query(EventId e);
  void wait(EventId e);
  void release(EventId e);
  std::size_t created() const;  // events ever created (the pool's size)
  std::size_t in_use() const;

 private:
  std::uintptr_t lookup(EventId e, const char* what) const;
  int device_;
  mutable std::mutex mu_;
  std::vector<std::uintptr_t> events_;  // id - 1 -> CUevent
  std::vector<bool> busy_;
  std::vector<EventId> free_;
};

class CudaDeviceUpstreamBase : public Upstream {
 public:
  int device() const override { return device_; }
  MemoryKind kind() const override { return MemoryKind::Device; }
  bool streams_supported() const override { return true; }
  EventId record_event(Stream s) override { return events_.record(s); }
  bool query_event(EventId e) override { return events_.query(e); }
  void wait_event(EventId e) override { events_.wait(e); }
  void release_event(EventId e) override { events_.release(e); }
  void synchronize() override;
  // cuStreamIsCapturing: active or invalidated captures both count (neither may get our events);
  // the legacy stream implicated in another stream's capture counts too. Never throws.
  bool stream_capturing(Stream s) override;
  // cuThreadExchangeStreamCaptureMode (thread-local in the driver: no context needed).
  int exchange_capture_mode(int mode) override;
  const CudaEventPool& events() const { return events_; }

 protected:
  explicit CudaDeviceUpstreamBase(int device);
  std::atomic<int>& capture_counter() const override;
  int device_;
  CudaEventPool events_;
};

class CudaDeviceUpstream final : public CudaDeviceUpstreamBase {
 public:
  explicit CudaDeviceUpstream(int device = 0);
  std::string name() const override;

 protected:
  void* do_allocate(std::size_t nbytes) override;
  void do_deallocate(void* p, std::size_t nbytes) override;
};

class CudaAsyncUpstream final : public CudaDeviceUpstreamBase {
 public:
  CudaAsyncUpstream(int device = 0, Stream stream = 0, bool warm = true);
  ~CudaAsyncUpstream() override;
  std::string name() const override;
  Stream stream() const { return stream_; }
  bool warm() const { return warm_ != nullptr; }

 protected:
  void* do_allocate(std::size_t nbytes) override;
  void do_deallocate(void* p, std::size_t nbytes) override;

 private:
  Stream stream_;
  std::unique_ptr<WarmPoolHandle> warm_;
};

class CudaVirtualUpstream final : public CudaDeviceUpstreamBase {
 public:
  explicit CudaVirtualUpstream(int device = 0);
  ~CudaVirtualUpstream() override;
  std::string name() const override;
  bool supports_virtual() const override { return true; }
  bool supports_alias() const override { return true; }
  std::size_t vm_granularity() const override { return granularity_; }
  std::size_t memory_capacity() const override { return capacity_; }
  std::size_t mapped_pieces() const;
  std::size_t aliases() const;  // second mappings now
  // Physical handles whose cuMemRelease failed after a successful unmap, and address ranges whose
  // cuMemAddressFree failed after their memory was unmapped: leaks, counted instead of thrown
  // because the unmap itself happened (a pool must then treat the range as unmapped).
  std::uint64_t leaked_handles() const { return leaked_handles_.load(std::memory_order_relaxed); }
  std::uint64_t leaked_ranges() const { return leaked_ranges_.load(std::memory_order_relaxed); }
  // Whether the driver takes down a run of adjacent mappings with one cuMemUnmap: 0 not settled
  // yet, 1 it does, -1 it refused (each mapping then goes alone). Unmap and unalias runs of several
  // pieces ask until it answers: once taken, or refused two runs in a row (unmap_run).
  int unmap_runs() const { return unmap_runs_.load(std::memory_order_relaxed); }
  // cuMemUnmap calls made (unmaps and unaliases, runs and refused runs, and those undoing a run
  // whose grant was refused): beside
  // counters().unmaps + unaliases, what runs saved.
  std::uint64_t driver_unmaps() const { return driver_unmaps_.load(std::memory_order_relaxed); }

 protected:
  POOLKEEPER_VIRTUAL_UPSTREAM_HOOKS;
  // One cuMemSetAccess over each run (the driver grants access over any run of mappings).
  void do_map_pieces(std::uintptr_t addr, std::size_t bytes, std::size_t piece, std::size_t& done) override;
  void do_alias_pieces(std::uintptr_t dst, const AliasSource* srcs, std::size_t n, std::size_t& done) override;
  // One cuMemUnmap over each run where the driver takes one (unmap_runs()).
  void do_unmap_pieces(std::uintptr_t addr, const std::size_t* sizes, std::size_t n, std::size_t& done) override;
  void do_unalias_pieces(std::uintptr_t dst, const std::size_t* sizes, std::size_t n, std::size_t& done) override;

 private:
  struct Piece {
    std::size_t size;
    unsigned long long handle;
    std::size_t aliases = 0;  // second mappings of this handle now
  };
  struct Alias {
    std::uintptr_t src;
    std::size_t size;
  };
  std::map<std::uintptr_t, Alias> aliases_;  // by address (guarded by mu_)
  std::size_t unmap_run(std::uintptr_t base, const std::size_t* sizes, std::size_t n, int& err);
  std::size_t granularity_ = 0, capacity_ = 0;
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Piece> pieces_;  // mapped pieces by address
  std::atomic<std::uint64_t> leaked_handles_{0}, leaked_ranges_{0}, driver_unmaps_{0};
  std::atomic<int> unmap_runs_{0}, run_refusals_{0};  // run_refusals_: refused runs in a row
};

class CudaPinnedUpstream final : public Upstream {
 public:
  explicit CudaPinnedUpstream(int device = 0);
  std::string name() const override { return "CudaPinned"; }
  MemoryKind kind() const override { return MemoryKind::Pinned; }
  int device() const override { return device_; }

 protected:
  void* do_allocate(std::size_t nbytes) override;
  void do_deallocate(void* p, std::size_t nbytes) override;

 private:
  int device_;
};

}  // namespace poolkeeper
