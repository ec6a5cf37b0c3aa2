// The process-wide pool registry behind the C ABI (PyTorch's pluggable allocator calls plain C
// functions with a device index, so "which pool" must be answerable without Python).
//
// - set(device, pool) installs a pool for a device index (-1: host). get_fast() is lock-free.
// - A factory, when set, creates a device's pool lazily on its first request (per-device pools for
//   torch), under the registry mutex.
// - A pool replaced by set() or removed by clear() while a C ABI call is inside it stays alive
//   until that call returns (Pinned publishes the pool it uses as a per-thread hazard pointer;
//   set/clear destroy only pools no hazard names, and retry the rest at the next set/clear).
// Thread-safe.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "poolkeeper/pool.hpp"

namespace poolkeeper::registry {

inline constexpr int kMaxDevices = 64;
using Factory = std::function<std::shared_ptr<Pool>(int device)>;

void set(int device, std::shared_ptr<Pool> pool);
void set_factory(Factory f);
bool has_factory();
// Lock-free lookup of an installed pool; nullptr if none (and no factory has made one yet).
Pool* get_fast(int device);
// Lookup, creating through the factory when needed. Throws InvalidArgument for a bad index or
// when no pool is installed and there is no factory. The raw pointer is valid only while the
// pool stays installed: calls that may race with set()/clear() use Pinned.
Pool* get(int device);

namespace detail {
struct Hazard;
}
// The device's pool (created through the factory when needed; throws like get()), kept alive
// for this object's lifetime even if set() or clear() replaces it meanwhile. Costs two atomic
// stores and a load on the calling thread's own cache line. Not copyable; one thread.
class Pinned {
 public:
  explicit Pinned(int device);
  ~Pinned();
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  Pool* operator->() const { return pool_; }
  Pool* get() const { return pool_; }

 private:
  Pool* pool_ = nullptr;
  detail::Hazard* hazard_ = nullptr;
  Pool* saved_ = nullptr;
};
std::shared_ptr<Pool> get_shared(int device);
void clear();
// Every installed pool (for empty_cache / stats).
std::vector<std::pair<int, std::shared_ptr<Pool>>> all();

}  // namespace poolkeeper::registry
