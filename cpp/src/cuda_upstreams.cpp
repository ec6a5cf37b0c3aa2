#include "poolkeeper/cuda_upstreams.hpp"

#include "poolkeeper/cuda_driver.hpp"

namespace poolkeeper {

using namespace cuda::drv;

namespace {
CUevent as_event(std::uintptr_t e) { return reinterpret_cast<CUevent>(e); }
std::string on_device(const char* call, std::size_t n, int device) {
  return std::string(call) + "(" + format_bytes(n) + ") on device " + std::to_string(device);
}
}  // namespace

// ---- events ----

CudaEventPool::~CudaEventPool() {
  if (cuda::shutting_down() || events_.empty()) return;
  try {
    cuda::ScopedContext ctx(device_);
    for (std::uintptr_t e : events_) cuda::api().cuEventDestroy(as_event(e));
  } catch (...) {
    // A destructor cannot report; the events die with the context.
  }
}

EventId CudaEventPool::record(Stream s) {
  if (s == kNoStream) return kNullEvent;
  const cuda::DriverApi& a = cuda::api();
  cuda::ScopedContext ctx(device_);
  EventId id;
  std::uintptr_t ev;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      CUevent e = nullptr;
      cuda::check(a.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      events_.push_back(reinterpret_cast<std::uintptr_t>(e));
      busy_.push_back(false);
      id = events_.size();
    }
    busy_[id - 1] = true;
    ev = events_[id - 1];
  }
  const CUresult r = a.cuEventRecord(as_event(ev), reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(s)));
  if (r != CUDA_SUCCESS) {
    release(id);
    cuda::throw_error(r, "cuEventRecord(stream " + format_stream(s) + ") on device " + std::to_string(device_));
  }
  return id;
}

std::uintptr_t CudaEventPool::lookup(EventId e, const char* what) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (e == kNullEvent || e > events_.size() || !busy_[e - 1])
    throw InvalidArgument(std::string(what) + " of an unknown CUDA event id " + std::to_string(e));
  return events_[e - 1];
}

bool CudaEventPool::query(EventId e) {
  if (e == kNullEvent) return true;
  const std::uintptr_t ev = lookup(e, "query");
  cuda::ScopedContext ctx(device_);
  const CUresult r = cuda::api().cuEventQuery(as_event(ev));
  if (r == CUDA_SUCCESS) return true;
  if (r == CUDA_ERROR_NOT_READY) return false;  // an answer, not an error: nothing to clear
  cuda::throw_error(r, "cuEventQuery");
}

void CudaEventPool::wait(EventId e) {
  if (e == kNullEvent) return;
  const std::uintptr_t ev = lookup(e, "wait");
  cuda::ScopedContext ctx(device_);
  cuda::check(cuda::api().cuEventSynchronize(as_event(ev)), "cuEventSynchronize");
}

void CudaEventPool::release(EventId e) {
  if (e == kNullEvent) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (e > events_.size() || !busy_[e - 1]) return;  // releasing twice is harmless
  busy_[e - 1] = false;
  free_.push_back(e);
}

std::size_t CudaEventPool::created() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_.size();
}

std::size_t CudaEventPool::in_use() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_.size() - free_.size();
}

// ---- device upstreams ----

CudaDeviceUpstreamBase::CudaDeviceUpstreamBase(int device) : device_(device), events_(device) {
  cuda::require_device(device);
  cuda::primary_context(device);  // retain now: a broken device fails at construction
}

void CudaDeviceUpstreamBase::synchronize() {
  cuda::ScopedContext ctx(device_);
  cuda::check(cuda::api().cuCtxSynchronize(), "cuCtxSynchronize", name());
}

CudaDeviceUpstream::CudaDeviceUpstream(int device) : CudaDeviceUpstreamBase(device) {}

std::string CudaDeviceUpstream::name() const { return "CudaDevice(" + std::to_string(device_) + ")"; }

void* CudaDeviceUpstream::do_allocate(std::size_t nbytes) {
  cuda::ScopedContext ctx(device_);
  CUdeviceptr p = 0;
  const CUresult r = cuda::api().cuMemAlloc(&p, nbytes);
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemAlloc", nbytes, device_), name());
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

void CudaDeviceUpstream::do_deallocate(void* p, std::size_t nbytes) {
  if (cuda::shutting_down()) return;
  cuda::ScopedContext ctx(device_);
  const CUresult r = cuda::api().cuMemFree(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p)));
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemFree", nbytes, device_), name());
}

CudaAsyncUpstream::CudaAsyncUpstream(int device, Stream stream, bool warm)
    : CudaDeviceUpstreamBase(device), stream_(stream == kNoStream ? 0 : stream) {
  const cuda::DriverApi& a = cuda::api();
  if (!a.has_stream_ordered_allocator())
    throw CudaUnavailable("CudaAsync needs the stream-ordered allocator (cuMemAllocAsync, CUDA 11.2+); driver " +
                          std::to_string(a.driver_version) + " lacks it");
  if (!cuda::device_info(device).memory_pools_supported)
    throw CudaUnavailable("CudaAsync: device " + std::to_string(device) +
                          " does not support memory pools (cuMemAllocAsync)");
  if (warm) warm_ = std::make_unique<WarmPoolHandle>(WarmPoolManager::global(), device);
}

CudaAsyncUpstream::~CudaAsyncUpstream() {
  // At process exit the driver may be tearing down: leave the threshold to die with the process.
  if (warm_ && cuda::shutting_down()) warm_->dismiss();
  warm_.reset();
}

std::string CudaAsyncUpstream::name() const { return "CudaAsync(" + std::to_string(device_) + ")"; }

void* CudaAsyncUpstream::do_allocate(std::size_t nbytes) {
  CUdeviceptr p = 0;
  const auto st = reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream_));
  const CUresult r = cuda::on_stream_call(static_cast<std::uintptr_t>(stream_), device_,
                                          [&] { return cuda::api().cuMemAllocAsync(&p, nbytes, st); });
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemAllocAsync", nbytes, device_), name());
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

void CudaAsyncUpstream::do_deallocate(void* p, std::size_t nbytes) {
  if (cuda::shutting_down()) return;
  const auto st = reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(stream_));
  const auto dp = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(p));
  const CUresult r = cuda::on_stream_call(static_cast<std::uintptr_t>(stream_), device_,
                                          [&] { return cuda::api().cuMemFreeAsync(dp, st); });
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemFreeAsync", nbytes, device_), name());
}

// ---- pinned host memory ----

CudaPinnedUpstream::CudaPinnedUpstream(int device) : device_(device) {
  cuda::require_device(device);
  cuda::primary_context(device);
}

void* CudaPinnedUpstream::do_allocate(std::size_t nbytes) {
  cuda::ScopedContext ctx(device_);
  void* p = nullptr;
  const CUresult r = cuda::api().cuMemHostAlloc(&p, nbytes, CU_MEMHOSTALLOC_PORTABLE);
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemHostAlloc", nbytes, device_), name());
  return p;
}

void CudaPinnedUpstream::do_deallocate(void* p, std::size_t nbytes) {
  if (cuda::shutting_down()) return;
  cuda::ScopedContext ctx(device_);
  const CUresult r = cuda::api().cuMemFreeHost(p);
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemFreeHost", nbytes, device_), name());
}

}  // namespace poolkeeper
