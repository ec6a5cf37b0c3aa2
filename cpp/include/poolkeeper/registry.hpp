// The process-wide pool registry behind the C ABI (PyTorch's pluggable allocator calls plain C
// functions with a device index, so "which pool" must be answerable without Python).
//
// - set(device, pool) installs a pool for a device index (-1: host). get_fast() is lock-free.
// - A factory, when set, creates a device's pool lazily on its first request (per-device pools for
//   torch), under the registry mutex.
// Thread-safe.
#pragma once
#include <functional>
#include <memory>

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
// when no pool is installed and there is no factory.
Pool* get(int device);
std::shared_ptr<Pool> get_shared(int device);
void clear();
// Every installed pool (for empty_cache / stats).
std::vector<std::pair<int, std::shared_ptr<Pool>>> all();

}  // namespace poolkeeper::registry
