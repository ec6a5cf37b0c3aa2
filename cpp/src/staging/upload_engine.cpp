// The native upload engine (contract in upload_engine.hpp).
#include "poolkeeper/staging/upload_engine.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <optional>
#include <string>

#include "poolkeeper/cuda/cuda_driver.hpp"
#include "poolkeeper/core/errors.hpp"

namespace poolkeeper {

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::size_t kRampMin = kUploadRampMin;

std::uint64_t ns_since(Clock::time_point t) {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count());
}

[[noreturn]] void injected(const char* what, long long k) {
  throw UpstreamFailure(std::string("injected fault: ") + what + " of chunk " + std::to_string(k), "upload engine",
                        "INJECTED_FAULT", -1);
}

cuda::drv::CUevent as_event(void* e) { return static_cast<cuda::drv::CUevent>(e); }
cuda::drv::CUstream as_stream(std::uintptr_t s) { return reinterpret_cast<cuda::drv::CUstream>(s); }
}  // namespace

// ---- the Host backend's copy thread: memcpys in submission order ------------------------------
struct UploadEngine::HostDma {
  struct Item {
    void* dst;
    const void* src;
    std::size_t n;
    std::atomic<std::uint64_t>* done;
    std::uint64_t seq;
  };
  std::mutex mu;
  std::condition_variable work_cv, done_cv;
  std::deque<Item> q;
  bool busy = false, stop = false;
  std::thread th;

  HostDma() : th([this] { run(); }) {}

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      work_cv.wait(lk, [&] { return stop || !q.empty(); });
      if (q.empty()) return;  // stop, and nothing left to copy
      Item it = q.front();
      q.pop_front();
      busy = true;
      lk.unlock();
      if (it.n) std::memcpy(it.dst, it.src, it.n);
      lk.lock();
      busy = false;
      it.done->store(it.seq, std::memory_order_release);
      done_cv.notify_all();
    }
  }
  void submit(const Item& it) {
    {
      std::lock_guard<std::mutex> lk(mu);
      q.push_back(it);
    }
    work_cv.notify_one();
  }
  void wait(const std::atomic<std::uint64_t>& done, std::uint64_t seq) {
    if (done.load(std::memory_order_acquire) >= seq) return;
    std::unique_lock<std::mutex> lk(mu);
    done_cv.wait(lk, [&] { return done.load(std::memory_order_acquire) >= seq; });
  }
  void drain() {
    std::unique_lock<std::mutex> lk(mu);
    done_cv.wait(lk, [&] { return q.empty() && !busy; });
  }
  void shutdown(bool join) {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    work_cv.notify_all();
    if (th.joinable()) join ? th.join() : th.detach();
  }
};

// ---- one upload ----------------------------------------------------------------------------------
namespace {
struct Slot {
  char* ptr = nullptr;
  std::size_t cap = 0;
  std::uint64_t issued = 0;                // copies enqueued from this slot (Host: their seq)
  std::atomic<std::uint64_t> done{0};      // Host: seq of the last completed copy
  void* event = nullptr;                   // Cuda: this slot's completion event
  std::size_t pending = 0;                 // bytes of the copy in flight
  std::uint64_t bytes = 0;                 // bytes of completed copies
  bool lost = false;
};
}  // namespace

std::vector<std::size_t> upload_ramp(std::size_t chunk, std::size_t total) {
  std::vector<std::size_t> head;
  std::size_t covered = 0;
  for (std::size_t size = std::max(std::min(chunk, kRampMin), chunk / 8); size < chunk && covered < total;
       size = std::min(size * 2, chunk)) {
    head.push_back(size);
    covered += size;
  }
  return head;
}

struct UploadEngine::Job {
  UploadRequest req;
  std::unique_ptr<Slot[]> slots;
  std::size_t nslots = 0;
  unsigned active = 0;
  std::vector<std::size_t> ramp;  // the first chunks' sizes
  std::size_t ramp_total = 0;
  std::vector<std::size_t> tail;  // the last chunks' sizes, in offset order
  std::size_t tail_total = 0, body_len = 0;
  std::uint64_t body_chunks = 0;
  std::atomic<std::uint64_t> next{0};
  std::atomic<bool> stop{false};
  cuda::drv::CUcontext ctx = nullptr;
  HostDma* dma = nullptr;
  std::atomic<std::uint64_t>* landed = nullptr;  // the engine's bytes_done_
  Clock::time_point t0;
  std::atomic<std::uint64_t> chunks{0}, overlapped{0}, fill_ns{0}, wait_ns{0}, enqueue_ns{0}, first_enqueue_ns{0};
  // Since t0: the last worker to start, and the last fill to end (what is left after it is the
  // copy engine draining the queue).
  std::atomic<std::uint64_t> last_start_ns{0}, last_fill_end_ns{0};
  static void raise_to(std::atomic<std::uint64_t>& a, std::uint64_t v) {
    std::uint64_t cur = a.load(std::memory_order_relaxed);
    while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }
  std::uint64_t wall_ns = 0;
  bool finished = false;  // under the engine's mutex
  std::mutex err_mu;
  std::exception_ptr error;
  std::vector<std::size_t> lost;

  // The schedule: head (ramp-up sizes from offset 0), body (full chunks), tail (ramp-down sizes
  // ending at total). Head and tail are short lists; the body is arithmetic, so a schedule of any
  // length costs nothing to plan.
  void plan_ramp() {
    const std::size_t chunk = req.chunk;
    if (req.ramp) {
      ramp = upload_ramp(chunk, req.total);
      for (std::size_t s : ramp) ramp_total += s;
    }
    if (req.tail_ramp && chunk / 2 >= kRampMin) {
      std::vector<std::size_t> t;  // from the end backwards: smallest first
      std::size_t sum = 0;
      for (std::size_t size = kRampMin; size <= chunk / 2; size *= 2)
        for (unsigned w = 0; w < std::max(1u, active); ++w) t.push_back(size), sum += size;
      // Only where the body is long enough that the tail replaces full chunks.
      if (ramp_total + sum + chunk <= req.total) {
        tail.assign(t.rbegin(), t.rend());
        tail_total = sum;
      }
    }
    body_len = req.total - std::min(req.total, ramp_total + tail_total);
    body_chunks = chunk ? (body_len + chunk - 1) / chunk : 0;
  }
  // Chunk k of the schedule; false past the end.
  bool chunk_at(std::uint64_t k, std::size_t& off, std::size_t& n) const {
    if (k < ramp.size()) {
      off = 0;
      for (std::uint64_t i = 0; i < k; ++i) off += ramp[i];
      n = ramp[k];
    } else if (k - ramp.size() < body_chunks) {
      const std::uint64_t i = k - ramp.size();
      off = ramp_total + static_cast<std::size_t>(i) * req.chunk;
      n = std::min(req.chunk, ramp_total + body_len - off);
    } else if (k - ramp.size() - body_chunks < tail.size()) {
      const std::uint64_t i = k - ramp.size() - body_chunks;
      off = req.total - tail_total;
      for (std::uint64_t x = 0; x < i; ++x) off += tail[x];
      n = tail[i];
    } else {
      return false;
    }
    if (off >= req.total) return false;
    n = std::min(n, req.total - off);
    return true;
  }
  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> lk(err_mu);
    if (!error) error = e;
    stop.store(true, std::memory_order_relaxed);
  }
  void mark_lost(std::size_t b) {
    slots[b].lost = true;
    std::lock_guard<std::mutex> lk(err_mu);
    lost.push_back(b);
  }

  // -- backend operations ------------------------------------------------------------------------
  bool query(std::size_t b) {
    Slot& s = slots[b];
    if (req.backend == CopyBackend::Host) return s.done.load(std::memory_order_acquire) >= s.issued;
    return cuda::api().cuEventQuery(as_event(s.event)) == cuda::drv::CUDA_SUCCESS;
  }
  // Block until slot b's copy completed; throws if that cannot be established.
  void wait(std::size_t b) {
    Slot& s = slots[b];
    if (req.backend == CopyBackend::Host) {
      dma->wait(s.done, s.issued);
      return;
    }
    const auto& a = cuda::api();
    cuda::drv::CUresult r = a.cuEventQuery(as_event(s.event));
    if (r == cuda::drv::CUDA_ERROR_NOT_READY) r = a.cuEventSynchronize(as_event(s.event));
    cuda::check(r, "cuEventSynchronize");
  }
  // Enqueue the copy of chunk k (n bytes at off) out of slot b and record its completion marker.
  // Throws with nothing enqueued, or with the slot marked lost when the copy is enqueued but its
  // completion cannot be tracked.
  void enqueue(std::size_t b, std::uint64_t k, std::size_t off, std::size_t n) {
    Slot& s = slots[b];
    const long long kk = static_cast<long long>(k);
    if (kk == req.fail_copy_at) injected("copy", kk);
    if (req.backend == CopyBackend::Host) {
      ++s.issued;
      dma->submit({reinterpret_cast<void*>(req.dst + off), s.ptr, n, &s.done, s.issued});
      if (kk == req.fail_record_at) {
        mark_lost(b);
        injected("completion record", kk);
      }
    } else {
      const auto& a = cuda::api();
      cuda::check(a.cuMemcpyHtoDAsync(static_cast<cuda::drv::CUdeviceptr>(req.dst + off), s.ptr, n,
                                      as_stream(req.stream)),
                  "cuMemcpyHtoDAsync");
      ++s.issued;
      const cuda::drv::CUresult r = kk == req.fail_record_at ? cuda::drv::CUDA_SUCCESS
                                                             : a.cuEventRecord(as_event(s.event), as_stream(req.stream));
      if (kk == req.fail_record_at) {
        mark_lost(b);
        injected("completion record", kk);
      }
      if (r != cuda::drv::CUDA_SUCCESS) {
        mark_lost(b);
        cuda::throw_error(r, "cuEventRecord");
      }
    }
    s.pending = n;
  }
  void land(std::size_t b) {
    Slot& s = slots[b];
    s.bytes += s.pending;
    landed->fetch_add(s.pending, std::memory_order_acq_rel);
    s.pending = 0;
  }
};

// ---- the engine ----------------------------------------------------------------------------------
UploadEngine::UploadEngine(unsigned threads) : threads_(threads), pid_(static_cast<long>(::getpid())) {
  if (threads == 0) throw InvalidArgument("an upload engine needs at least one thread");
  if (threads >= kWakeShutdown)
    throw InvalidArgument("an upload engine takes at most " + std::to_string(kWakeShutdown - 1) + " threads");
  workers_.reserve(threads);
  for (unsigned i = 0; i < threads; ++i) {
    workers_.emplace_back([this, i] { worker_main(i); });
    threads_created_.fetch_add(1);
  }
}

UploadEngine::~UploadEngine() {
  try {
    close();
  } catch (...) {
  }
  if (static_cast<long>(::getpid()) != pid_) {
    // A forked child: leak what the parent's threads may have been blocked in (see close()).
    (void)done_cv_p_.release();
    (void)job_.release();
  }
}

bool UploadEngine::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closed_;
}

bool UploadEngine::finished() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !job_ || job_->finished;
}

bool UploadEngine::running() const { return !finished(); }

void UploadEngine::cancel() {
  std::lock_guard<std::mutex> lk(mu_);
  if (job_ && !job_->finished) job_->stop.store(true);
}

std::uint64_t UploadEngine::wait(double timeout_s) {
  // NaN passes both tests below, and a NaN duration cast to the clock's integer ticks is undefined.
  if (std::isnan(timeout_s)) throw InvalidArgument("wait: timeout_s must be a number of seconds, not NaN");
  std::unique_lock<std::mutex> lk(mu_);
  auto done = [&] { return !job_ || job_->finished; };
  if (timeout_s < 0)
    done_cv_.wait(lk, done);
  else
    done_cv_.wait_for(lk, std::chrono::duration<double>(std::min(timeout_s, 1e6)), done);
  return bytes_done_.load(std::memory_order_acquire);
}

void UploadEngine::start(UploadRequest req) {
  const std::size_t nbuf = req.buffers.size();
  if (nbuf < 2)
    throw InvalidArgument("an upload needs at least 2 staging buffers, so a fill can overlap a copy; got " +
                          std::to_string(nbuf));
  if (req.chunk == 0) throw InvalidArgument("chunk must be a positive number of bytes");
  for (std::size_t i = 0; i < nbuf; ++i)
    if (!req.buffers[i].ptr || req.buffers[i].capacity < req.chunk)
      throw InvalidArgument("staging buffer " + std::to_string(i) + " holds " +
                            std::to_string(req.buffers[i].capacity) + " bytes; a chunk needs " +
                            std::to_string(req.chunk));
  if (req.total && (!req.src || !req.dst)) throw InvalidArgument("src and dst must be non-null addresses");

  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw InvalidArgument("this upload engine was closed");
  if (job_ && !job_->finished) throw InvalidArgument("this upload engine is busy: one upload at a time");
  if (static_cast<long>(::getpid()) != pid_)
    throw InvalidArgument("this upload engine was created in another process (before fork): make a new one");

  auto job = std::make_unique<Job>();
  Job& j = *job;
  j.req = std::move(req);
  j.nslots = nbuf;
  j.slots.reset(new Slot[nbuf]);
  for (std::size_t i = 0; i < nbuf; ++i) {
    j.slots[i].ptr = static_cast<char*>(j.req.buffers[i].ptr);
    j.slots[i].cap = j.req.buffers[i].capacity;
  }
  j.active = static_cast<unsigned>(std::min<std::size_t>(threads_, nbuf));
  j.plan_ramp();
  j.landed = &bytes_done_;
  j.req.nt_fill = j.req.nt_fill && *stream_copy_isa();

  if (j.req.backend == CopyBackend::Cuda && j.req.total) {
    // Resolved here, on the caller's thread: the legacy stream means the caller's current context.
    j.ctx = cuda::context_for_stream(j.req.stream);
    const auto& a = cuda::api();
    if (events_ctx_ != j.ctx) {
      for (void* e : events_) a.cuEventDestroy(as_event(e));
      events_.clear();
      events_ctx_ = j.ctx;
    }
    if (events_.size() < nbuf) {
      cuda::ScopedContext in(j.ctx);
      while (events_.size() < nbuf) {
        cuda::drv::CUevent e = nullptr;
        cuda::check(a.cuEventCreate(&e, cuda::drv::CU_EVENT_DISABLE_TIMING), "cuEventCreate");
        events_.push_back(e);
      }
    }
    for (std::size_t i = 0; i < nbuf; ++i) j.slots[i].event = events_[i];
  }
  if (j.req.backend == CopyBackend::Host && !dma_) {
    dma_ = std::make_unique<HostDma>();
    threads_created_.fetch_add(1);
  }
  j.dma = dma_.get();

  bytes_done_.store(0);
  uploads_.fetch_add(1);
  j.t0 = Clock::now();
  job_ = std::move(job);
  have_outcome_ = true;
  if (j.req.total == 0) {  // nothing to copy: finished without waking anyone
    j.finished = true;
    done_cv_.notify_all();
    return;
  }
  pending_workers_ = j.active;
  ++generation_;
  current_.store(&j, std::memory_order_release);
  wake_.store((generation_ << 16) | j.active, std::memory_order_release);
  lk.unlock();
  wake_.notify_all();
}

// Workers sleep on one atomic word, (generation << 16) | active workers, with a futex wait:
// start() wakes them all with one store and one notify, and none needs the engine's mutex to
// learn its part (a condition variable made every wake-up queue on that mutex; under gVisor each
// hand-off costs tens of microseconds, multiplied by the workers). A worker may read the job
// without the lock only when it is one of its active workers: that job cannot finish, so cannot
// be replaced, before this worker has done its part.
void UploadEngine::worker_main(unsigned index) {
  std::uint64_t seen = 0;  // the constructor's value, not a load: a start() may come before we run
  for (;;) {
    wake_.wait(seen, std::memory_order_acquire);
    seen = wake_.load(std::memory_order_acquire);
    const auto active = static_cast<unsigned>(seen & 0xffff);
    if (active == kWakeShutdown) return;
    if (index >= active) continue;
    Job* j = current_.load(std::memory_order_acquire);
    run_part(*j, index);
    std::unique_lock<std::mutex> lk(mu_);
    if (--pending_workers_ == 0) {
      // The last worker out: every copy was waited for by its owner. The Host copy thread may
      // still hold a copy whose marker was "lost"; let it finish so dst is not written later.
      lk.unlock();
      if (j->dma) j->dma->drain();
      j->wall_ns = ns_since(j->t0);
      lk.lock();
      j->finished = true;
      done_cv_.notify_all();
    }
  }
}

void UploadEngine::run_part(Job& j, unsigned w) {
  std::vector<std::size_t> free_slots;
  for (std::size_t b = w; b < j.nslots; b += j.active) free_slots.push_back(b);
  std::reverse(free_slots.begin(), free_slots.end());  // take the lowest index first
  std::deque<std::size_t> inflight;
  std::uint64_t chunks = 0, overlapped = 0, fill_ns = 0, wait_ns = 0, enqueue_ns = 0;
  std::optional<cuda::ScopedContext> ctx;
  const bool nt = j.req.nt_fill;
  Job::raise_to(j.last_start_ns, ns_since(j.t0));
  std::uint64_t last_fill_end = 0;
  try {
    if (j.req.backend == CopyBackend::Cuda) ctx.emplace(j.ctx);
    while (!j.stop.load(std::memory_order_relaxed)) {
      const std::uint64_t k = j.next.fetch_add(1, std::memory_order_relaxed);
      std::size_t off = 0, n = 0;
      if (!j.chunk_at(k, off, n)) break;
      std::size_t b;
      if (free_slots.empty()) {  // all my buffers are in flight: wait for the oldest
        b = inflight.front();
        inflight.pop_front();
        const auto t = Clock::now();
        try {
          j.wait(b);
        } catch (...) {
          j.mark_lost(b);
          throw;
        }
        wait_ns += ns_since(t);
        j.land(b);
      } else {
        b = free_slots.back();
        free_slots.pop_back();
      }
      if (!inflight.empty() && !j.query(inflight.back())) ++overlapped;  // copies complete in order
      if (static_cast<long long>(k) == j.req.fail_fill_at) {
        free_slots.push_back(b);
        injected("fill", static_cast<long long>(k));
      }
      auto t = Clock::now();
      const char* src = static_cast<const char*>(j.req.src) + off;
      if (nt)
        stream_copy(j.slots[b].ptr, src, n);
      else
        std::memcpy(j.slots[b].ptr, src, n);
      fill_ns += ns_since(t);
      last_fill_end = ns_since(j.t0);
      t = Clock::now();
      try {
        j.enqueue(b, k, off, n);
      } catch (...) {
        if (!j.slots[b].lost) free_slots.push_back(b);  // nothing enqueued: nothing reads it
        throw;
      }
      const std::uint64_t e = ns_since(t);
      enqueue_ns += e;
      if (chunks == 0) {
        std::uint64_t zero = 0;
        j.first_enqueue_ns.compare_exchange_strong(zero, ns_since(j.t0));
      }
      ++chunks;
      inflight.push_back(b);
    }
  } catch (...) {
    j.fail(std::current_exception());
  }
  // Drain: nothing returns while a copy of ours may still read a staging buffer.
  while (!inflight.empty()) {
    const std::size_t b = inflight.front();
    inflight.pop_front();
    const auto t = Clock::now();
    try {
      j.wait(b);
      wait_ns += ns_since(t);
      j.land(b);
    } catch (...) {
      j.mark_lost(b);
      j.fail(std::current_exception());
    }
  }
  Job::raise_to(j.last_fill_end_ns, last_fill_end);
  j.chunks.fetch_add(chunks);
  j.overlapped.fetch_add(overlapped);
  j.fill_ns.fetch_add(fill_ns);
  j.wait_ns.fetch_add(wait_ns);
  j.enqueue_ns.fetch_add(enqueue_ns);
}

UploadOutcome UploadEngine::outcome() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!have_outcome_ || !job_) throw InvalidArgument("no upload has run on this engine");
  if (!job_->finished) throw InvalidArgument("the upload is still running");
  const Job& j = *job_;
  UploadOutcome o;
  UploadCounters& c = o.counters;
  c.chunks = j.chunks.load();
  c.bytes = bytes_done_.load();
  c.overlapped_fills = j.overlapped.load();
  c.fill_ns = j.fill_ns.load();
  c.wait_ns = j.wait_ns.load();
  c.enqueue_ns = j.enqueue_ns.load();
  c.wall_ns = j.wall_ns;
  c.first_enqueue_ns = j.first_enqueue_ns.load();
  c.last_start_ns = j.last_start_ns.load();
  c.last_fill_end_ns = j.last_fill_end_ns.load();
  c.workers = j.req.total ? j.active : 0;
  c.nt_fill = j.req.nt_fill;
  o.lost = j.lost;
  std::sort(o.lost.begin(), o.lost.end());
  o.buffer_bytes.reserve(j.nslots);
  for (std::size_t i = 0; i < j.nslots; ++i) o.buffer_bytes.push_back(j.slots[i].bytes);
  o.error = j.error;
  return o;
}

void UploadEngine::close() {
  if (static_cast<long>(::getpid()) != pid_) {
    // A forked child has none of the parent's threads, and any lock or condition variable here
    // may have been held or waited on by one of them at the fork: touch none. The std::thread
    // objects name threads that do not exist here (joining or detaching them fails, destroying
    // them joinable terminates): move them where no destructor runs, and leak the copy thread's
    // state and the events.
    if (closed_) return;
    closed_ = shutdown_ = true;
    (void)new std::vector<std::thread>(std::move(workers_));
    workers_.clear();
    (void)dma_.release();
    events_.clear();
    return;
  }
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) return;
  closed_ = true;
  if (job_ && !job_->finished) {
    job_->stop.store(true);
    done_cv_.wait(lk, [&] { return job_->finished; });
  }
  shutdown_ = true;
  ++generation_;
  wake_.store((generation_ << 16) | kWakeShutdown, std::memory_order_release);
  lk.unlock();
  wake_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  if (dma_) dma_->shutdown(true);
  if (!events_.empty() && !cuda::shutting_down()) {
    const auto& a = cuda::api();
    for (void* e : events_) a.cuEventDestroy(as_event(e));
  }
  events_.clear();
}

}  // namespace poolkeeper
