#include "poolkeeper/cuda/warm_pool.hpp"

#include <cstdio>

#include "poolkeeper/cuda/cuda_driver.hpp"
#include "poolkeeper/core/errors.hpp"

namespace poolkeeper {

using namespace cuda::drv;

namespace {

constexpr std::size_t kMaxMessages = 32;

std::string fmt_threshold(std::uint64_t v) { return v == kMaxReleaseThreshold ? "max" : std::to_string(v); }

CUmemoryPool default_pool(int device) {
  const cuda::DriverApi& a = cuda::api();
  cuda::require_device(device);
  if (!a.has_stream_ordered_allocator())
    throw UpstreamFailure("the CUDA driver has no stream-ordered pool API", "CudaAsync", "CUDA_ERROR_NOT_SUPPORTED",
                          CUDA_ERROR_NOT_SUPPORTED);
  CUmemoryPool pool = nullptr;
  cuda::check(a.cuDeviceGetDefaultMemPool(&pool, device),
              ("cuDeviceGetDefaultMemPool(device " + std::to_string(device) + ")").c_str());
  return pool;
}

}  // namespace

// ---- the real control ----

std::string CudaPoolControl::unsupported_reason(int device) {
  try {
    const cuda::DriverApi& a = cuda::api();
    cuda::require_device(device);
    if (!a.has_stream_ordered_allocator())
      return "driver " + std::to_string(a.driver_version) + " has no stream-ordered allocator (needs CUDA 11.2+)";
    const cuda::DeviceInfo info = cuda::device_info(device);
    if (!info.memory_pools_supported) return "device " + std::to_string(device) + " does not support memory pools";
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::uint64_t CudaPoolControl::release_threshold(int device) {
  return cuda_mempool_attribute(device, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD);
}

void CudaPoolControl::set_release_threshold(int device, std::uint64_t value) {
  cuda_mempool_set_release_threshold(device, value);
}

void CudaPoolControl::synchronize(int device) {
  cuda::ScopedContext ctx(device);
  cuda::check(cuda::api().cuCtxSynchronize(), ("cuCtxSynchronize(device " + std::to_string(device) + ")").c_str());
}

void CudaPoolControl::trim_to(int device, std::uint64_t keep_bytes) { cuda_mempool_trim_to(device, keep_bytes); }

namespace {
// One driver call on device's default memory pool, in the device's context; `what` names it in
// the error.
template <class Call>
void mempool_call(int device, Call call, const std::string& what) {
  cuda::ScopedContext ctx(device);
  cuda::check(call(default_pool(device)), what.c_str());
}
std::string on(int device, const std::string& rest = "") {
  return "(device " + std::to_string(device) + rest + ")";
}
}  // namespace

std::uint64_t cuda_mempool_attribute(int device, int attribute) {
  std::uint64_t v = 0;
  mempool_call(device, [&](CUmemoryPool p) { return cuda::api().cuMemPoolGetAttribute(p, attribute, &v); },
               "cuMemPoolGetAttribute" + on(device, ", attr " + std::to_string(attribute)));
  return v;
}

void cuda_mempool_set_release_threshold(int device, std::uint64_t value) {
  mempool_call(device,
               [&](CUmemoryPool p) { return cuda::api().cuMemPoolSetAttribute(p, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &value); },
               "cuMemPoolSetAttribute" + on(device, ", release threshold"));
}

void cuda_mempool_trim_to(int device, std::uint64_t keep_bytes) {
  mempool_call(device, [&](CUmemoryPool p) { return cuda::api().cuMemPoolTrimTo(p, static_cast<std::size_t>(keep_bytes)); },
               "cuMemPoolTrimTo" + on(device));
}

void cuda_mempool_reset_high(int device, int attribute) {
  if (attribute != CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH && attribute != CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    throw InvalidArgument("only the high watermarks (reserved_mem_high, used_mem_high) can be reset");
  std::uint64_t zero = 0;
  mempool_call(device, [&](CUmemoryPool p) { return cuda::api().cuMemPoolSetAttribute(p, attribute, &zero); },
               "cuMemPoolSetAttribute" + on(device, ", reset attr " + std::to_string(attribute)));
}

// ---- the policy ----

WarmPoolManager::WarmPoolManager(std::shared_ptr<PoolControl> control, bool log_to_stderr)
    : control_(std::move(control)), log_to_stderr_(log_to_stderr) {}

WarmPoolManager& WarmPoolManager::global() {
  // Leaked on purpose: CudaAsync upstreams may be destroyed during process exit.
  static WarmPoolManager* m = new WarmPoolManager(std::make_shared<CudaPoolControl>());
  return *m;
}

void WarmPoolManager::log_locked(const std::string& line, bool failure) {
  if (failure) totals_.last_error = line;
  if (totals_.messages.size() == kMaxMessages) totals_.messages.erase(totals_.messages.begin());
  totals_.messages.push_back(line);
  if (log_to_stderr_ && failure) std::fprintf(stderr, "poolkeeper: warm pool: %s\n", line.c_str());
}

void WarmPoolManager::acquire(int device) {
  if (device < 0) throw InvalidArgument("warm pool: device must be >= 0; got " + std::to_string(device));
  std::lock_guard<std::mutex> lk(mu_);
  WarmDeviceState& d = devices_[device];
  d.device = device;
  const bool first = d.handles == 0;
  ++d.handles;
  ++totals_.total_handles;
  if (first && !d.raised) configure_locked(device, d);
}

void WarmPoolManager::configure_locked(int device, WarmDeviceState& d) {
  d.unsupported = control_->unsupported_reason(device);
  if (!d.unsupported.empty()) {
    log_locked("device " + std::to_string(device) + ": not configured (no-op): " + d.unsupported, false);
    return;
  }
  try {
    const std::uint64_t cur = control_->release_threshold(device);
    if (cur >= kMaxReleaseThreshold) {
      ++totals_.left_alone;
      log_locked("device " + std::to_string(device) + ": release threshold already max; left as it is", false);
      return;
    }
    control_->set_release_threshold(device, kMaxReleaseThreshold);
    d.raised = true;
    d.previous = cur;
    ++totals_.raises;
    log_locked("device " + std::to_string(device) + ": release threshold raised " + fmt_threshold(cur) + " -> max",
               false);
  } catch (const std::exception& e) {
    ++totals_.configure_failures;
    log_locked("device " + std::to_string(device) + ": could not raise the release threshold (continuing cold): " +
                   e.what(),
               true);
  }
}

void WarmPoolManager::release(int device) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = devices_.find(device);
  if (it == devices_.end() || it->second.handles <= 0)
    throw InvalidArgument("warm pool: release of device " + std::to_string(device) + " without a matching acquire");
  --it->second.handles;
  --totals_.total_handles;
  if (totals_.total_handles == 0) restore_all_locked();
}

void WarmPoolManager::restore_all_locked() {
  // Every device in our record, whatever device the calling thread is current on.
  for (auto& [dev, d] : devices_) {
    if (!d.raised) continue;
    const std::string who = "device " + std::to_string(dev) + ": ";
    d.raised = false;  // dropped even on failure: retrying at every later release would spam and
                       // cannot help once the device is unusable
    try {
      control_->synchronize(dev);
      const std::uint64_t cur = control_->release_threshold(dev);
      if (cur != kMaxReleaseThreshold) {
        ++totals_.left_alone;
        log_locked(who + "release threshold was changed by someone else to " + fmt_threshold(cur) +
                       "; left as it is, not trimmed",
                   false);
        continue;
      }
      control_->set_release_threshold(dev, d.previous);
      ++totals_.restores;
      control_->trim_to(dev, d.previous);
      ++totals_.trims;
      log_locked(who + "release threshold restored to " + fmt_threshold(d.previous) + " and pool trimmed", false);
    } catch (const std::exception& e) {
      ++totals_.release_failures;
      log_locked(who + "could not restore/trim the default pool: " + e.what(), true);
    }
  }
}

WarmPoolState WarmPoolManager::state() const {
  std::lock_guard<std::mutex> lk(mu_);
  WarmPoolState s = totals_;
  for (const auto& [dev, d] : devices_) s.devices.push_back(d);
  return s;
}

}  // namespace poolkeeper
