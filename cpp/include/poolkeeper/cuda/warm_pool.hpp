// The warm-pool manager (docs/cuda.md): keeps CUDA's default stream-ordered pool from handing its
// memory back to the driver at every synchronize while poolkeeper uses it, and gives it back
// when poolkeeper is done.
//
// CUDA's default pool (one per device, shared with every user of cudaMallocAsync in the process)
// releases reserved memory above its release threshold whenever a synchronize observes a pending
// free; the default threshold is 0, so almost every allocation maps memory again. The policy:
//
// - acquire(d) (a handle's birth): when device d has no handles yet and is not already raised,
//   read its current release threshold; if it is below the maximum, raise it to the maximum
//   (UINT64_MAX) and remember the previous value for d. Never lower it: a value someone else
//   set that is already the maximum is left alone and not recorded.
// - release(d) (a handle's death): when the *last* handle of the process goes, every device in
//   our own record (not the calling thread's current device, which on a multi-GPU host is often
//   another one) is synchronized -- the pool can only release frees the driver has observed --
//   then its threshold is put back to the recorded value (only if it is still the maximum we set:
//   a value another user chose since is theirs), then the pool is trimmed to that value
//   (cuMemPoolTrimTo: it never releases memory backing live allocations, so a block still in use
//   survives).
// - A failure to configure only costs speed: it is logged (stderr, once per failure, and kept in
//   state().messages / last_error), counted, and execution continues. Nothing is latched: the
//   driver API keeps no sticky "last error" for such failures, and neither do we.
// - No pool support (driver without the stream-ordered allocator, device without memory pools):
//   acquire/release are no-ops that say so in state().unsupported.
//
// The driver calls go through PoolControl, so the policy is tested on CI against a simulated
// control and on a GPU against the real one (CudaPoolControl, which makes each device's primary
// context current for its calls).
//
// Thread safety: every member may be called from any thread; one mutex serializes the policy
// (a release that synchronizes devices blocks concurrent acquires until it is done).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace poolkeeper {

inline constexpr std::uint64_t kMaxReleaseThreshold = ~std::uint64_t{0};

class PoolControl {
 public:
  virtual ~PoolControl() = default;
  // "" when device's default pool can be configured, else why it cannot. Never throws.
  virtual std::string unsupported_reason(int device) = 0;
  // The calls below throw UpstreamFailure (or CudaUnavailable) on failure.
  virtual std::uint64_t release_threshold(int device) = 0;
  virtual void set_release_threshold(int device, std::uint64_t value) = 0;
  virtual void synchronize(int device) = 0;
  virtual void trim_to(int device, std::uint64_t keep_bytes) = 0;
};

// The real control: the driver's default pool of each device, in that device's primary context.
class CudaPoolControl final : public PoolControl {
 public:
  std::string unsupported_reason(int device) override;
  std::uint64_t release_threshold(int device) override;
  void set_release_threshold(int device, std::uint64_t value) override;
  void synchronize(int device) override;
  void trim_to(int device, std::uint64_t keep_bytes) override;
};

// Read-outs of the default pool (for tests and the Python view). Throw like the control.
std::uint64_t cuda_mempool_attribute(int device, int attribute);
void cuda_mempool_set_release_threshold(int device, std::uint64_t value);
void cuda_mempool_trim_to(int device, std::uint64_t keep_bytes);
// Reset one of the default pool's high watermarks (CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH or
// CU_MEMPOOL_ATTR_USED_MEM_HIGH; the driver accepts only 0, which restarts it from the current
// value). Lets a caller measure the pool's footprint over one interval. Any thread; throws
// InvalidArgument for another attribute, UpstreamFailure if the driver refuses.
void cuda_mempool_reset_high(int device, int attribute);

struct WarmDeviceState {
  int device = 0;
  long handles = 0;
  bool raised = false;             // in our record: we raised it and will restore it
  std::uint64_t previous = 0;      // the value we will restore (meaningful when raised)
  std::string unsupported;         // non-empty: no-op on this device, and why
};

struct WarmPoolState {
  std::vector<WarmDeviceState> devices;  // every device ever acquired, by index
  long total_handles = 0;
  std::uint64_t raises = 0, restores = 0, trims = 0, left_alone = 0;
  std::uint64_t configure_failures = 0, release_failures = 0;
  std::string last_error;              // "" when nothing has failed
  std::vector<std::string> messages;   // the most recent log lines (bounded)
};

class WarmPoolManager {
 public:
  explicit WarmPoolManager(std::shared_ptr<PoolControl> control, bool log_to_stderr = true);
  // The process-wide manager over CudaPoolControl (created on first use, never destroyed).
  static WarmPoolManager& global();

  // Never throw for driver failures (they are logged); throw InvalidArgument for a negative
  // device or a release without a matching acquire.
  void acquire(int device);
  void release(int device);
  WarmPoolState state() const;

 private:
  void configure_locked(int device, WarmDeviceState& d);
  void restore_all_locked();
  void log_locked(const std::string& line, bool failure);

  std::shared_ptr<PoolControl> control_;
  bool log_to_stderr_;
  mutable std::mutex mu_;
  std::map<int, WarmDeviceState> devices_;
  WarmPoolState totals_;  // counters and messages (devices filled in by state())
};

// RAII: acquire on construction, release on destruction (used by CudaAsyncUpstream).
class WarmPoolHandle {
 public:
  WarmPoolHandle(WarmPoolManager& m, int device) : m_(&m), device_(device) { m_->acquire(device_); }
  ~WarmPoolHandle() {
    if (m_) m_->release(device_);
  }
  WarmPoolHandle(const WarmPoolHandle&) = delete;
  WarmPoolHandle& operator=(const WarmPoolHandle&) = delete;
  // Forget the handle without releasing it (process exit: the driver may be gone).
  void dismiss() { m_ = nullptr; }

 private:
  WarmPoolManager* m_;
  int device_;
};

}  // namespace poolkeeper
