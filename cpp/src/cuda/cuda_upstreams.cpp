#include "poolkeeper/cuda/cuda_upstreams.hpp"

#include <algorithm>
#include <array>
#include <optional>
#include <vector>

#include "poolkeeper/core/registry.hpp"
#include "poolkeeper/cuda/cuda_driver.hpp"

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

std::atomic<int>& CudaDeviceUpstreamBase::capture_counter() const {
  // Immortal: an upstream may be destroyed during exit(), after static destructors ran. Devices
  // past the registry's range (none on a real host) keep a count of their own object.
  static auto* per_device = new std::array<std::atomic<int>, registry::kMaxDevices>{};
  if (device_ >= 0 && device_ < registry::kMaxDevices) return (*per_device)[static_cast<std::size_t>(device_)];
  return Upstream::capture_counter();
}

void CudaDeviceUpstreamBase::synchronize() {
  cuda::ScopedContext ctx(device_);
  cuda::check(cuda::api().cuCtxSynchronize(), "cuCtxSynchronize", name());
}

bool CudaDeviceUpstreamBase::stream_capturing(Stream s) {
  if (s == kNoStream || cuda::shutting_down()) return false;
  try {
    const cuda::DriverApi& a = cuda::api();
    if (!a.cuStreamIsCapturing) return false;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    const auto st = reinterpret_cast<CUstream>(static_cast<std::uintptr_t>(s));
    const CUresult r = cuda::on_stream_call(static_cast<std::uintptr_t>(s), device_,
                                            [&] { return a.cuStreamIsCapturing(st, &status); });
    if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return true;
    return r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
  } catch (...) {
    return false;
  }
}

int CudaDeviceUpstreamBase::exchange_capture_mode(int mode) {
  if (cuda::shutting_down()) return mode;
  try {
    const cuda::DriverApi& a = cuda::api();
    if (!a.cuThreadExchangeStreamCaptureMode) return mode;
    int m = mode;
    if (a.cuThreadExchangeStreamCaptureMode(&m) != CUDA_SUCCESS) return mode;
    return m;
  } catch (...) {
    return mode;
  }
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
  if (stream_ > CU_STREAM_PER_THREAD) {
    // An explicit stream names its own context: cuMemAllocAsync would draw from that device's pool
    // whatever `device` says (and warm the wrong one), so a stream of another device is refused.
    int on = -1;
    try {
      cuda::ScopedContext in_stream_ctx = cuda::ScopedContext::for_stream(static_cast<std::uintptr_t>(stream_));
      on = cuda::current_device();
    } catch (const UpstreamFailure& e) {
      throw InvalidArgument("CudaAsync(device=" + std::to_string(device) + "): stream " + format_stream(stream_) +
                            " is not a usable stream handle: " + e.what());
    }
    if (on != device)
      throw InvalidArgument("CudaAsync(device=" + std::to_string(device) + "): stream " + format_stream(stream_) +
                            " belongs to device " + std::to_string(on) + "; its allocations would come from device " +
                            std::to_string(on) + "'s memory pool. Pass a stream of device " + std::to_string(device) +
                            " (or device=" + std::to_string(on) + ")");
  }
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

// ---- virtual memory ----

namespace {
CUmemAllocationProp device_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}
std::string at_ptr(const char* call, std::uintptr_t a, std::size_t n, int device) {
  return std::string(call) + "(" + format_ptr(a) + ", " + format_bytes(n) + ") on device " + std::to_string(device);
}
// Read/write for the device over a freshly mapped range (cuMemMap alone grants no access).
CUresult allow_access(CUdeviceptr dp, std::size_t bytes, int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return cuda::api().cuMemSetAccess(dp, bytes, &access, 1);
}

// A run (upstream.hpp, "Runs"): up to n items mapped end to end from `base` by map_one(i, at),
// which returns the bytes it mapped or throws having undone itself; then one grant of access over
// all of them (cuMemMap alone gives none; one cuMemSetAccess may cover any run of mappings). A
// refused item: the items before it are granted and booked (book(k, bytes)) and its error
// rethrown. A refused grant: every item mapped is undone (undo_one(i, at, size)), nothing is
// booked, and the grant's error is thrown: nothing of the run is reachable without it.
template <class MapOne, class UndoOne, class Book>
void granted_run(std::uintptr_t base, std::size_t n, int device, const std::string& who, MapOne&& map_one,
                 UndoOne&& undo_one, Book&& book) {
  std::vector<std::size_t> sizes;  // of the items mapped so far
  std::size_t at = 0;
  auto grant = [&] {
    if (sizes.empty()) return;
    const CUresult r = allow_access(static_cast<CUdeviceptr>(base), at, device);
    if (r != CUDA_SUCCESS) {
      for (std::size_t i = 0, off = 0; i < sizes.size(); off += sizes[i++]) undo_one(i, off, sizes[i]);
      cuda::throw_error(r, at_ptr("cuMemSetAccess", base, at, device), who);
    }
    book(sizes.size(), at);
  };
  try {
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = map_one(i, at);
      sizes.push_back(k);
      at += k;
    }
  } catch (...) {
    grant();  // a refused grant throws its own error instead
    throw;
  }
  grant();
}

// The n entries lying end to end from `base` (sizes[i] bytes each) taken out of `books` (a
// CudaVirtual book: pieces or aliases, under its lock). Each is checked first -- `check(at, bytes,
// entry)` throws for one that is missing (null) or may not go -- so a refusal takes none.
template <class Books, class Check>
std::vector<typename Books::mapped_type> take_run(Books& books, std::uintptr_t base, const std::size_t* sizes, std::size_t n,
                                                  Check&& check) {
  for (std::size_t i = 0, at = 0; i < n; at += sizes[i++]) {
    auto it = books.find(base + at);
    check(base + at, sizes[i], it == books.end() || it->second.size != sizes[i] ? nullptr : &it->second);
  }
  std::vector<typename Books::mapped_type> taken;
  taken.reserve(n);
  for (std::size_t i = 0, at = 0; i < n; at += sizes[i++]) {
    auto it = books.find(base + at);
    taken.push_back(it->second);
    books.erase(it);
  }
  return taken;
}

// The first k of a run take_run took back into `books` (the driver kept them); returns where
// they end.
template <class Books>
std::uintptr_t put_back(Books& books, std::uintptr_t base, const std::size_t* sizes, std::size_t k,
                        const std::vector<typename Books::mapped_type>& taken) {
  std::uintptr_t at = base;
  for (std::size_t i = 0; i < k; at += sizes[i++]) books.emplace(at, taken[i]);
  return at;
}
}  // namespace

CudaVirtualUpstream::CudaVirtualUpstream(int device) : CudaDeviceUpstreamBase(device) {
  const cuda::DriverApi& a = cuda::api();
  if (!a.has_virtual_memory())
    throw CudaUnavailable("CudaVirtual needs the driver's virtual memory management (cuMemCreate, cuMemMap, ...); " +
                          a.library + " lacks it");
  int vmm = 0;
  cuda::check(a.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device),
              "cuDeviceGetAttribute", name());
  if (!vmm)
    throw CudaUnavailable("CudaVirtual: device " + std::to_string(device) + " does not support virtual memory management");
  const CUmemAllocationProp prop = device_prop(device);
  cuda::ScopedContext ctx(device_);
  cuda::check(a.cuMemGetAllocationGranularity(&granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity", name());
  if (!granularity_ || (granularity_ & (granularity_ - 1)))
    throw UpstreamFailure("CudaVirtual: the driver's granularity " + std::to_string(granularity_) + " is not a power of two",
                          name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
  capacity_ = cuda::device_info(device).total_memory;
}

CudaVirtualUpstream::~CudaVirtualUpstream() {
  // Pools unmap what they mapped; whatever is left (a pool destroyed with live blocks) dies with
  // the context.
}

std::string CudaVirtualUpstream::name() const { return "CudaVirtual(" + std::to_string(device_) + ")"; }

std::size_t CudaVirtualUpstream::mapped_pieces() const {
  std::lock_guard<std::mutex> g(mu_);
  return pieces_.size();
}

std::uintptr_t CudaVirtualUpstream::do_reserve(std::size_t bytes) {
  if (!bytes || bytes % granularity_)  // the contract's error type, as the simulated device's
    throw UpstreamFailure("CudaVirtual: reserve of " + format_bytes(bytes) + " is not a multiple of the granularity " +
                              format_bytes(granularity_),
                          name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
  cuda::ScopedContext ctx(device_);
  CUdeviceptr p = 0;
  const CUresult r = cuda::api().cuMemAddressReserve(&p, bytes, granularity_, 0, 0);
  if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemAddressReserve", bytes, device_), name());
  return static_cast<std::uintptr_t>(p);
}

void CudaVirtualUpstream::do_unreserve(std::uintptr_t addr, std::size_t bytes) {
  if (cuda::shutting_down()) return;
  cuda::ScopedContext ctx(device_);
  const CUresult r = cuda::api().cuMemAddressFree(static_cast<CUdeviceptr>(addr), bytes);
  if (r != CUDA_SUCCESS) cuda::throw_error(r, at_ptr("cuMemAddressFree", addr, bytes, device_), name());
}

// Each piece created and mapped, then the run granted at once (granted_run). A refused create or
// map releases that piece's handle; `done` gets the bytes granted and booked.
void CudaVirtualUpstream::do_map_pieces(std::uintptr_t addr, std::size_t bytes, std::size_t piece, std::size_t& done) {
  if (!bytes || bytes % granularity_ || addr % granularity_ || !piece || piece % granularity_)
    throw UpstreamFailure("CudaVirtual: map of " + format_bytes(bytes) + " at " + format_ptr(addr) + " in pieces of " +
                              format_bytes(piece) + " is not granule-aligned (" + format_bytes(granularity_) + ")",
                          name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
  const cuda::DriverApi& a = cuda::api();
  const CUmemAllocationProp prop = device_prop(device_);
  cuda::ScopedContext ctx(device_);
  std::vector<CUmemGenericAllocationHandle> handles;  // of the pieces mapped so far
  auto map_one = [&](std::size_t, std::size_t at) {
    const std::size_t n = std::min(piece, bytes - at);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = a.cuMemCreate(&h, n, &prop, 0);
    if (r != CUDA_SUCCESS) cuda::throw_error(r, on_device("cuMemCreate", n, device_), name());
    if ((r = a.cuMemMap(static_cast<CUdeviceptr>(addr + at), n, 0, h, 0)) != CUDA_SUCCESS) {
      a.cuMemRelease(h);
      cuda::throw_error(r, at_ptr("cuMemMap", addr + at, n, device_), name());
    }
    handles.push_back(h);
    return n;
  };
  auto undo_one = [&](std::size_t i, std::size_t at, std::size_t n) {
    driver_unmaps_.fetch_add(1, std::memory_order_relaxed);
    a.cuMemUnmap(static_cast<CUdeviceptr>(addr + at), n);
    a.cuMemRelease(handles[i]);
  };
  auto book = [&](std::size_t k, std::size_t mapped) {
    std::lock_guard<std::mutex> g(mu_);
    for (std::size_t i = 0, at = 0; i < k; ++i, at += piece) pieces_[addr + at] = Piece{std::min(piece, bytes - at), handles[i]};
    done = mapped;
  };
  granted_run(addr, (bytes + piece - 1) / piece, device_, name(), map_one, undo_one, book);
}

void CudaVirtualUpstream::do_map(std::uintptr_t addr, std::size_t bytes) {
  std::size_t done = 0;
  do_map_pieces(addr, bytes, bytes, done);
}

// Takes down the n mappings lying end to end from `base` (sizes[i] bytes each; the caller has
// taken them out of its books): one cuMemUnmap over the run while the driver takes runs, else one
// per mapping, last first. Whether one cuMemUnmap may span several mappings is the driver's to
// say: runs of several pieces ask it until it answers. Taken: runs from then on (unmap_runs() =
// 1). Refused as an invalid range (CUDA_ERROR_INVALID_VALUE) where the mappings then go one by one,
// kRunRefusals runs in a row: one per mapping from then on (-1). A single refusal is not an answer
// (a driver call may fail once for its own reasons), nor one that the single unmaps share.
// Returns how many of the last mappings are down; `err` holds the refusal that stopped it. Call
// with this upstream's context current.
std::size_t CudaVirtualUpstream::unmap_run(std::uintptr_t base, const std::size_t* sizes, std::size_t n, CUresult& err) {
  constexpr int kRunRefusals = 2;
  const cuda::DriverApi& a = cuda::api();
  err = CUDA_SUCCESS;
  std::size_t end = 0;
  for (std::size_t i = 0; i < n; ++i) end += sizes[i];
  bool refused = false;
  if (n > 1 && unmap_runs_.load(std::memory_order_relaxed) >= 0) {
    driver_unmaps_.fetch_add(1, std::memory_order_relaxed);
    const CUresult r = a.cuMemUnmap(static_cast<CUdeviceptr>(base), end);
    if (r == CUDA_SUCCESS) {
      unmap_runs_.store(1, std::memory_order_relaxed);
      run_refusals_.store(0, std::memory_order_relaxed);
      return n;
    }
    refused = r == CUDA_ERROR_INVALID_VALUE;
  }
  std::size_t done = 0;
  for (; done < n; ++done) {
    const std::size_t k = sizes[n - 1 - done];
    end -= k;
    driver_unmaps_.fetch_add(1, std::memory_order_relaxed);
    if ((err = a.cuMemUnmap(static_cast<CUdeviceptr>(base + end), k)) != CUDA_SUCCESS) return done;
  }
  int unknown = 0;
  if (refused && run_refusals_.fetch_add(1, std::memory_order_relaxed) + 1 >= kRunRefusals)
    unmap_runs_.compare_exchange_strong(unknown, -1, std::memory_order_relaxed);
  return done;
}

// Each piece checked, then all out of the books before any unmap, under the lock that checked
// that none has an alias: an alias of one that comes now finds no source and is refused, instead
// of mapping a handle this unmap is about to release (a hostile test's race: a leaked handle, and
// its unalias then counted down another piece's aliases). Those the driver keeps go back in.
// The context is made current before anything leaves the books: switching may fail, and a run
// taken out but never unmapped would be lost from them (a review found it).
void CudaVirtualUpstream::do_unmap_pieces(std::uintptr_t addr, const std::size_t* sizes, std::size_t n, std::size_t& done) {
  const bool gone = cuda::shutting_down();  // the driver is going: nothing to unmap, only the books
  std::optional<cuda::ScopedContext> ctx;
  if (!gone) ctx.emplace(device_);
  std::vector<Piece> taken;
  {
    std::lock_guard<std::mutex> g(mu_);
    taken = take_run(pieces_, addr, sizes, n, [&](std::uintptr_t at, std::size_t bytes, const Piece* p) {
      if (!p)
        throw UpstreamFailure("CudaVirtual: unmap of " + format_ptr(at) + " (" + format_bytes(bytes) + ") is not one mapped piece",
                              name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
      if (p->aliases)
        throw UpstreamFailure("CudaVirtual: unmap of " + format_ptr(at) + " while " + std::to_string(p->aliases) +
                                  " alias(es) of it are mapped",
                              name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
    });
  }
  if (gone) {
    done = n;
    return;
  }
  CUresult err = CUDA_SUCCESS;
  done = unmap_run(addr, sizes, n, err);
  // Unmapped: the unmap has happened, so it must not be reported as failed (the pool would keep
  // the range as mapped and hand out unmapped addresses). A refused release only leaks the
  // physical memory: counted (leaked_handles()), not thrown.
  for (std::size_t i = n - done; i < n; ++i)
    if (cuda::api().cuMemRelease(taken[i].handle) != CUDA_SUCCESS) leaked_handles_.fetch_add(1, std::memory_order_relaxed);
  if (done == n) return;
  std::uintptr_t end = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    end = put_back(pieces_, addr, sizes, n - done, taken);
  }
  const std::size_t k = sizes[n - done - 1];
  cuda::throw_error(err, at_ptr("cuMemUnmap", end - k, k, device_), name());  // that one and those before it still mapped
}

void CudaVirtualUpstream::do_unmap(std::uintptr_t addr, std::size_t bytes) {
  std::size_t done = 0;
  do_unmap_pieces(addr, &bytes, 1, done);
}

std::size_t CudaVirtualUpstream::aliases() const {
  std::lock_guard<std::mutex> g(mu_);
  return aliases_.size();
}

// Each source's handle mapped again, one after another from dst, then the run granted at once
// (granted_run). A source is held (its alias count raised, under mu_) before its map: an unmap
// either saw the hold and refused, or took the piece out of pieces_ first and this alias finds no
// source (unmap_piece). Undoing an alias lets go of its hold.
void CudaVirtualUpstream::do_alias_pieces(std::uintptr_t dst, const AliasSource* srcs, std::size_t n, std::size_t& done) {
  const cuda::DriverApi& a = cuda::api();
  cuda::ScopedContext ctx(device_);
  auto let_go = [&](std::uintptr_t src) {
    std::lock_guard<std::mutex> g(mu_);
    --pieces_.at(src).aliases;  // held: still there
  };
  auto map_one = [&](std::size_t i, std::size_t at) {
    const AliasSource& p = srcs[i];
    unsigned long long h = 0;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = pieces_.find(p.src);
      if (it == pieces_.end() || it->second.size != p.bytes || (dst + at) % granularity_)
        throw UpstreamFailure("CudaVirtual: alias of " + format_ptr(p.src) + " (" + format_bytes(p.bytes) + ") at " +
                                  format_ptr(dst + at) +
                                  ": the source is not one mapped piece or the target is not granule-aligned",
                              name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
      h = it->second.handle;
      ++it->second.aliases;  // now: the source must not be unmapped while this map runs
    }
    const CUresult r = a.cuMemMap(static_cast<CUdeviceptr>(dst + at), p.bytes, 0, h, 0);
    if (r != CUDA_SUCCESS) {
      let_go(p.src);
      cuda::throw_error(r, at_ptr("cuMemMap", dst + at, p.bytes, device_), name());
    }
    return p.bytes;
  };
  auto undo_one = [&](std::size_t i, std::size_t at, std::size_t bytes) {
    driver_unmaps_.fetch_add(1, std::memory_order_relaxed);
    a.cuMemUnmap(static_cast<CUdeviceptr>(dst + at), bytes);
    let_go(srcs[i].src);
  };
  auto book = [&](std::size_t k, std::size_t) {
    std::lock_guard<std::mutex> g(mu_);
    for (std::size_t i = 0, at = 0; i < k; at += srcs[i++].bytes) aliases_[dst + at] = Alias{srcs[i].src, srcs[i].bytes};
    done = k;
  };
  granted_run(dst, n, device_, name(), map_one, undo_one, book);
}

void CudaVirtualUpstream::do_alias(std::uintptr_t dst, std::uintptr_t src, std::size_t bytes) {
  std::size_t done = 0;
  const AliasSource one{src, bytes};
  do_alias_pieces(dst, &one, 1, done);
}

// Out of the books before the unmap (a second unalias of the same range is refused, not unmapped
// twice); each source keeps its hold until its alias is down, so it cannot be unmapped under it.
void CudaVirtualUpstream::do_unalias_pieces(std::uintptr_t dst, const std::size_t* sizes, std::size_t n, std::size_t& done) {
  const bool gone = cuda::shutting_down();
  std::optional<cuda::ScopedContext> ctx;  // current before the books change (do_unmap_pieces)
  if (!gone) ctx.emplace(device_);
  std::vector<Alias> taken;
  {
    std::lock_guard<std::mutex> g(mu_);
    taken = take_run(aliases_, dst, sizes, n, [&](std::uintptr_t at, std::size_t bytes, const Alias* al) {
      if (!al)
        throw UpstreamFailure("CudaVirtual: unalias of " + format_ptr(at) + " (" + format_bytes(bytes) + ") is not one alias",
                              name(), "CUDA_ERROR_INVALID_VALUE", CUDA_ERROR_INVALID_VALUE);
    });
  }
  CUresult err = CUDA_SUCCESS;
  done = gone ? n : unmap_run(dst, sizes, n, err);
  std::uintptr_t end = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    end = put_back(aliases_, dst, sizes, n - done, taken);
    // The sources cannot have gone: their unmap is refused while these aliases hold them.
    for (std::size_t i = n - done; i < n; ++i)
      if (auto it = pieces_.find(taken[i].src); it != pieces_.end()) --it->second.aliases;
  }
  if (done == n) return;
  const std::size_t k = sizes[n - done - 1];
  cuda::throw_error(err, at_ptr("cuMemUnmap", end - k, k, device_), name());  // those aliases stay
}

void CudaVirtualUpstream::do_unalias(std::uintptr_t dst, std::size_t bytes) {
  std::size_t done = 0;
  do_unalias_pieces(dst, &bytes, 1, done);
}


void* CudaVirtualUpstream::do_allocate(std::size_t nbytes) {
  const std::size_t n = align_up(nbytes, granularity_);
  const std::uintptr_t a = do_reserve(n);
  try {
    do_map(a, n);
  } catch (...) {
    try {
      do_unreserve(a, n);
    } catch (...) {
    }
    throw;
  }
  return reinterpret_cast<void*>(a);
}

void CudaVirtualUpstream::do_deallocate(void* p, std::size_t nbytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const std::size_t n = align_up(nbytes, granularity_);
  do_unmap(a, n);  // throws only while the piece is still mapped: then nothing changed
  try {
    do_unreserve(a, n);
  } catch (const Error&) {
    leaked_ranges_.fetch_add(1, std::memory_order_relaxed);  // the memory itself was given back
  }
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
