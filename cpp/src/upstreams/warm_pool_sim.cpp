#include "poolkeeper/upstreams/warm_pool_sim.hpp"

#include "poolkeeper/core/errors.hpp"

namespace poolkeeper {

namespace {
std::string fmt(std::uint64_t v) { return v == kMaxReleaseThreshold ? "max" : std::to_string(v); }
}  // namespace

SimulatedPoolControl::SimulatedPoolControl(int devices) : devices_(devices) {
  if (devices < 1) throw InvalidArgument("SimulatedPoolControl needs at least one device");
  threshold_.assign(static_cast<std::size_t>(devices), 0);
}

void SimulatedPoolControl::check_device(int device) const {
  if (device < 0 || device >= devices_)
    throw UpstreamFailure("simulated device " + std::to_string(device) + " does not exist", "SimulatedPoolControl",
                          "CUDA_ERROR_INVALID_DEVICE", 101);
}

void SimulatedPoolControl::maybe_fail(const std::string& op, int device) {
  auto it = failures_.find(op);
  if (it == failures_.end() || it->second.second <= 0) return;
  const std::string name = it->second.first;
  if (--it->second.second == 0) failures_.erase(it);
  throw UpstreamFailure("simulated " + op + " on device " + std::to_string(device) + " failed: " + name,
                        "SimulatedPoolControl", name, 999);
}

std::string SimulatedPoolControl::unsupported_reason(int device) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  calls_.push_back("support " + std::to_string(device));
  if (device < 0 || device >= devices_) return "simulated device " + std::to_string(device) + " does not exist";
  auto it = unsupported_.find(device);
  return it == unsupported_.end() ? std::string() : it->second;
}

std::uint64_t SimulatedPoolControl::release_threshold(int device) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  calls_.push_back("get " + std::to_string(device));
  check_device(device);
  maybe_fail("get", device);
  return threshold_[static_cast<std::size_t>(device)];
}

void SimulatedPoolControl::set_release_threshold(int device, std::uint64_t value) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  calls_.push_back("set " + std::to_string(device) + " " + fmt(value));
  check_device(device);
  maybe_fail("set", device);
  threshold_[static_cast<std::size_t>(device)] = value;
}

void SimulatedPoolControl::synchronize(int device) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  calls_.push_back("sync " + std::to_string(device));
  check_device(device);
  maybe_fail("sync", device);
}

void SimulatedPoolControl::trim_to(int device, std::uint64_t keep_bytes) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  calls_.push_back("trim " + std::to_string(device) + " " + fmt(keep_bytes));
  check_device(device);
  maybe_fail("trim", device);
}

void SimulatedPoolControl::set_external(int device, std::uint64_t value) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  check_device(device);
  threshold_[static_cast<std::size_t>(device)] = value;
}

std::uint64_t SimulatedPoolControl::threshold(int device) const {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  check_device(device);
  return threshold_[static_cast<std::size_t>(device)];
}

void SimulatedPoolControl::fail_next(const std::string& op, const std::string& error_name, int times) {
  if (op != "get" && op != "set" && op != "sync" && op != "trim")
    throw InvalidArgument("fail_next: op must be get, set, sync or trim; got '" + op + "'");
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  failures_[op] = {error_name, times};
}

void SimulatedPoolControl::set_unsupported(int device, const std::string& reason) {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  if (reason.empty()) unsupported_.erase(device);
  else unsupported_[device] = reason;
}

std::vector<std::string> SimulatedPoolControl::calls() const {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  return calls_;
}

void SimulatedPoolControl::clear_calls() {
  std::lock_guard<detail::ForkSafeMutex> lk(mu_);
  calls_.clear();
}

}  // namespace poolkeeper
