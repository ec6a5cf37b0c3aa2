// A simulated PoolControl, so the warm-pool policy (warm_pool.hpp) is tested on machines without
// a GPU. It keeps a release threshold per device, logs every call the manager makes in order
// ("get 0", "set 0 max", "sync 1", "trim 1 0", ...), and can be told to fail an operation or to
// report a device as unsupported. It models no memory: what the driver does with a threshold is
// the GPU tests' business.
//
// Thread safety: every member may be called concurrently (one mutex).
#pragma once
#include <map>
#include <mutex>

#include "poolkeeper/detail/fork_safe_mutex.hpp"
#include <string>
#include <vector>

#include "poolkeeper/cuda/warm_pool.hpp"

namespace poolkeeper {

class SimulatedPoolControl final : public PoolControl {
 public:
  explicit SimulatedPoolControl(int devices = 1);

  std::string unsupported_reason(int device) override;
  std::uint64_t release_threshold(int device) override;
  void set_release_threshold(int device, std::uint64_t value) override;
  void synchronize(int device) override;
  void trim_to(int device, std::uint64_t keep_bytes) override;

  // --- test controls (not logged) ---
  // What "another user" of the pool does: set the threshold directly.
  void set_external(int device, std::uint64_t value);
  std::uint64_t threshold(int device) const;
  // The next `times` calls of op ("get", "set", "sync", "trim") fail with a CUDA-like error name.
  void fail_next(const std::string& op, const std::string& error_name, int times = 1);
  void set_unsupported(int device, const std::string& reason);
  std::vector<std::string> calls() const;
  void clear_calls();

 private:
  void check_device(int device) const;
  void maybe_fail(const std::string& op, int device);
  int devices_;
  mutable detail::ForkSafeMutex mu_;  // free in a forked child (see fork_safe_mutex.hpp)
  std::vector<std::uint64_t> threshold_;
  std::map<int, std::string> unsupported_;
  std::map<std::string, std::pair<std::string, int>> failures_;
  std::vector<std::string> calls_;
};

}  // namespace poolkeeper
