// A native pipelined host-to-device upload: the whole transfer of a pageable source through a
// set of staging buffers runs on native threads, behind one GIL release on the Python side.
//
// Why: the Python uploader crosses the GIL several times per chunk (take, acquire, fill, copy
// enqueue, event record, wait, retire); with a dozen threads on a VM where futexes are slow those
// hand-offs convoy and the link idles. Here a chunk costs an atomic increment, a memcpy, a driver
// call and an event record, none of which touches Python.
//
// Model. One upload = (src, total bytes, dst base, staging buffers, chunk size, ramp, backend).
// Chunks are handed out by an atomic counter; with the ramp the first chunks are chunk/8, /4, /2
// (never below 256 KiB), then whole chunks. Worker w of `active = min(threads, buffers)` owns the
// buffers i with i % active == w. Per chunk a worker picks a free buffer of its own, or -- only
// when all its buffers are in flight -- waits for its oldest copy; fills the buffer from the source
// (memcpy, or non-temporal stores); enqueues the copy and records the buffer's completion marker.
//
// Backends:
//  - Cuda: cuMemcpyHtoDAsync on the given stream + cuEventRecord of the buffer's event (events are
//    created once per engine, timing disabled, in the stream's context); waits use cuEventQuery
//    then cuEventSynchronize. Each worker makes the stream's context current for the upload.
//  - Host: a "DMA" emulation for CI: the copy is a memcpy into host memory run by the engine's own
//    copy thread in submission (FIFO) order, with a per-buffer completion flag. Ordering, overlap
//    and failure handling are thereby testable without a GPU.
//
// Contracts:
//  - Thread safety: one upload at a time per engine (start() while one runs throws
//    InvalidArgument). All other members may be called from any thread while an upload runs.
//  - Stream order (Cuda): every copy is ordered on `stream`; a chunk's bytes are on the device when
//    its buffer's event has completed. When the upload is finished, every copy it enqueued has
//    completed, except those of buffers reported in `lost`.
//  - Never returns with a DMA possibly reading a staging buffer: the upload only finishes after
//    every enqueued copy was waited for. A copy that was enqueued but whose completion marker
//    could not be recorded makes its buffer "lost": the caller must leak it, never recycle or free
//    it (the DMA may still read it).
//  - Errors: the first error (a driver call, an injected fault) stops the handing out of chunks;
//    the workers drain what they enqueued; the error is kept and rethrown by rethrow() as the
//    core's typed exception (UpstreamFailure for driver errors, CudaUnavailable without a driver).
//  - Lifetime: src, dst and the staging buffers must stay valid until finished() is true.
//  - close() (and the destructor) wait for a running upload (after cancelling it) and join the
//    threads. An engine inherited through fork() has no threads in the child: it is unusable there
//    and close() detaches instead of joining.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace poolkeeper {

enum class CopyBackend { Host, Cuda };

struct StagingSlot {
  void* ptr = nullptr;
  std::size_t capacity = 0;
};

struct UploadRequest {
  const void* src = nullptr;
  std::size_t total = 0;
  std::uintptr_t dst = 0;             // device pointer (Cuda) or host address (Host)
  std::vector<StagingSlot> buffers;   // at least 2, each at least `chunk` bytes
  std::size_t chunk = 0;
  bool ramp = true;
  // The last bytes go in pieces that halve toward the end (chunk/2 per worker, then chunk/4, ...,
  // down to 256 KiB): the copies still queued when the last fill completes are then a few small
  // ones, not one full chunk per worker, which nothing overlaps.
  bool tail_ramp = false;  // measured: helps 8 MiB chunks, neutral at 2-4 MiB (docs/staging.md)
  bool nt_fill = false;               // fill with non-temporal stores (ignored where unsupported)
  CopyBackend backend = CopyBackend::Host;
  std::uintptr_t stream = 0;          // Cuda: 0 = legacy default stream
  // Test-only fault hooks (-1: off), by chunk index: the fill of chunk k fails; the copy of chunk k
  // fails before anything is enqueued; the completion marker of chunk k's copy cannot be recorded
  // after the copy was enqueued (its buffer becomes lost).
  long long fail_fill_at = -1, fail_copy_at = -1, fail_record_at = -1;
};

struct UploadCounters {
  std::uint64_t chunks = 0;            // copies enqueued
  std::uint64_t bytes = 0;             // bytes of copies observed complete
  std::uint64_t overlapped_fills = 0;  // fills started while a copy of the same worker was in flight
  std::uint64_t fill_ns = 0, wait_ns = 0, enqueue_ns = 0;  // summed over workers
  std::uint64_t wall_ns = 0;           // start() to finished
  std::uint64_t first_enqueue_ns = 0;  // start() to the first copy enqueued
  std::uint64_t last_start_ns = 0;     // start() to the last worker starting (wake-up spread)
  std::uint64_t last_fill_end_ns = 0;  // start() to the last fill ending (the rest is the copy tail)
  unsigned workers = 0;                // workers that took part
  bool nt_fill = false;                // non-temporal fill was used
};

struct UploadOutcome {
  UploadCounters counters;
  std::vector<std::size_t> lost;             // indices into the request's buffers
  std::vector<std::uint64_t> buffer_bytes;   // bytes copied out of each buffer
  std::exception_ptr error;                  // the first error, or null
};

// The ramp-up head of an upload's schedule, the one both engines follow (the Python engine reads it
// through _core.upload_ramp): chunk sizes starting at chunk/8 (at least kUploadRampMin, at most
// chunk) and doubling, each below chunk, until they cover `total`. The link idles until the first
// fill completes and every worker starts filling at once, so small first chunks start the first
// copy sooner. Full chunks follow the head.
inline constexpr std::size_t kUploadRampMin = 256 * 1024;  // the ramp never makes chunks smaller
std::vector<std::size_t> upload_ramp(std::size_t chunk, std::size_t total);

// Copy n bytes with non-temporal (cache-bypassing) stores where the CPU has them, then fence so
// the stores are visible before a DMA is enqueued. dst should be 16-byte aligned (it is a staging
// buffer); src may be unaligned. Falls back to memcpy elsewhere.
void stream_copy(void* dst, const void* src, std::size_t n) noexcept;
// Whether stream_copy uses non-temporal stores on this CPU ("avx2", "sse2" or "" for memcpy).
const char* stream_copy_isa() noexcept;

class UploadEngine {
 public:
  // Starts `threads` persistent worker threads (>= 1) and, on first Host-backend use, one copy
  // thread. Throws InvalidArgument for threads == 0.
  explicit UploadEngine(unsigned threads);
  ~UploadEngine();
  UploadEngine(const UploadEngine&) = delete;
  UploadEngine& operator=(const UploadEngine&) = delete;

  // Validates and starts an upload; returns at once. Throws InvalidArgument (bad request, busy,
  // closed) or a driver error when the Cuda backend cannot be set up (nothing started then).
  void start(UploadRequest req);
  // Waits up to timeout_s for the upload to finish (negative: until it does; at most 1e6 s per
  // call); returns the bytes observed landed so far. NaN is InvalidArgument. Thread safe.
  std::uint64_t wait(double timeout_s);
  bool finished() const;
  bool running() const;
  // Stops handing out chunks (copies already enqueued still complete). No-op when idle.
  void cancel();
  // The finished upload's outcome (InvalidArgument while one runs or before any).
  UploadOutcome outcome() const;
  std::uint64_t bytes_done() const noexcept { return bytes_done_.load(std::memory_order_acquire); }
  unsigned threads() const noexcept { return threads_; }
  std::uint64_t uploads() const noexcept { return uploads_.load(); }
  // Threads this engine ever created (workers + copy thread); constant after the first upload.
  std::uint64_t threads_created() const noexcept { return threads_created_.load(); }
  void close();
  bool closed() const;

  struct Job;     // one upload's shared state (upload_engine.cpp)
  struct HostDma;

 private:
  void worker_main(unsigned index);
  void run_part(Job& j, unsigned w);

  const unsigned threads_;
  const long pid_;
  mutable std::mutex mu_;
  // On the heap so a forked child can leak it: the parent's threads may have been waiting on it
  // at the fork, and destroying such a condition variable waits for those waiters forever.
  std::unique_ptr<std::condition_variable> done_cv_p_ = std::make_unique<std::condition_variable>();
  std::condition_variable& done_cv_ = *done_cv_p_;
  std::vector<std::thread> workers_;
  std::uint64_t generation_ = 0;
  static constexpr unsigned kWakeShutdown = 0xffff;
  std::atomic<std::uint64_t> wake_{0};     // (generation << 16) | active workers, or kWakeShutdown
  std::atomic<Job*> current_{nullptr};     // the job of the generation in wake_
  unsigned pending_workers_ = 0;
  bool shutdown_ = false, closed_ = false, have_outcome_ = false;
  std::unique_ptr<Job> job_;
  std::unique_ptr<HostDma> dma_;
  std::vector<void*> events_;    // Cuda: one event per buffer index, reused across uploads
  void* events_ctx_ = nullptr;   // the context the events belong to
  std::atomic<std::uint64_t> bytes_done_{0}, uploads_{0}, threads_created_{0};
};

}  // namespace poolkeeper
