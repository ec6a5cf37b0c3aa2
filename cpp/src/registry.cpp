#include "poolkeeper/registry.hpp"

#include <array>
#include <atomic>
#include <mutex>

namespace poolkeeper::registry {

namespace {
std::mutex g_mu;
std::array<std::shared_ptr<Pool>, kMaxDevices + 1> g_pools;  // [0] = host (-1), [d+1] = device d
std::array<std::atomic<Pool*>, kMaxDevices + 1> g_fast{};
Factory g_factory;

int slot(int device) {
  if (device < -1 || device >= kMaxDevices)
    throw InvalidArgument("device index " + std::to_string(device) + " out of range [-1, " +
                          std::to_string(kMaxDevices) + ")");
  return device + 1;
}
}  // namespace

void set(int device, std::shared_ptr<Pool> pool) {
  const int i = slot(device);
  std::lock_guard<std::mutex> g(g_mu);
  g_fast[i].store(pool.get(), std::memory_order_release);
  g_pools[i] = std::move(pool);
}

void set_factory(Factory f) {
  std::lock_guard<std::mutex> g(g_mu);
  g_factory = std::move(f);
}

bool has_factory() {
  std::lock_guard<std::mutex> g(g_mu);
  return static_cast<bool>(g_factory);
}

Pool* get_fast(int device) {
  if (device < -1 || device >= kMaxDevices) return nullptr;
  return g_fast[device + 1].load(std::memory_order_acquire);
}

std::shared_ptr<Pool> get_shared(int device) {
  const int i = slot(device);
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_pools[i]) {
    if (!g_factory)
      throw InvalidArgument("no poolkeeper pool is installed for device " + std::to_string(device) +
                            " (install one first, e.g. poolkeeper.integrations.torch.install())");
    g_pools[i] = g_factory(device);
    g_fast[i].store(g_pools[i].get(), std::memory_order_release);
  }
  return g_pools[i];
}

Pool* get(int device) {
  if (Pool* p = get_fast(device)) return p;
  return get_shared(device).get();
}

void clear() {
  std::lock_guard<std::mutex> g(g_mu);
  for (int i = 0; i <= kMaxDevices; ++i) {
    g_fast[i].store(nullptr, std::memory_order_release);
    g_pools[i].reset();
  }
  g_factory = nullptr;
}

std::vector<std::pair<int, std::shared_ptr<Pool>>> all() {
  std::lock_guard<std::mutex> g(g_mu);
  std::vector<std::pair<int, std::shared_ptr<Pool>>> out;
  for (int i = 0; i <= kMaxDevices; ++i)
    if (g_pools[i]) out.emplace_back(i - 1, g_pools[i]);
  return out;
}

}  // namespace poolkeeper::registry
