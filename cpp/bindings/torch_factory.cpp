// registry_set_factory: lets the C ABI create a device's pool on that device's first allocation.
// PyTorch calls poolkeeper_torch_malloc(size, device, stream) from any thread, GIL or not, so the
// factory must build pools without Python: options are read and validated here, once, into the
// pool's option struct, and the factory captures only that struct.
#include "torch_factory.hpp"

#include <nanobind/stl/shared_ptr.h>

#include <functional>

#include "options.hpp"
#include "poolkeeper/pools/arena_pool.hpp"
#include "poolkeeper/cuda/cuda_upstreams.hpp"
#include "poolkeeper/pools/direct_pool.hpp"
#include "poolkeeper/core/registry.hpp"
#include "poolkeeper/upstreams/simulated_upstream.hpp"
#include "poolkeeper/pools/size_class_pool.hpp"

namespace poolkeeper::py {

namespace {

using PoolMaker = std::function<std::shared_ptr<Pool>(std::shared_ptr<Upstream>)>;

PoolMaker pool_maker(const std::string& kind, nb::handle opts) {
  if (kind == "arena") {
    const ArenaOptions o = arena_options(opts);
    return [o](std::shared_ptr<Upstream> up) { return std::make_shared<ArenaPool>(std::move(up), o); };
  }
  if (kind == "arena_expandable") {
    // The expandable arena is an arena kind of its own everywhere (install, make_pool, bench,
    // replay), so its one fixed option is set here rather than asked of the caller.
    ArenaOptions o = arena_options(opts);
    o.expandable = true;
    return [o](std::shared_ptr<Upstream> up) { return std::make_shared<ArenaPool>(std::move(up), o); };
  }
  if (kind == "size_class") {
    const SizeClassOptions o = size_class_options(opts);
    return [o](std::shared_ptr<Upstream> up) { return std::make_shared<SizeClassPool>(std::move(up), o); };
  }
  if (kind == "direct") {
    const DirectOptions o = direct_options(opts);
    return [o](std::shared_ptr<Upstream> up) { return std::make_shared<DirectPool>(std::move(up), o); };
  }
  throw InvalidArgument("unknown pool kind '" + kind + "' (valid: arena, arena_expandable, size_class, direct)");
}

using UpstreamCtor = std::shared_ptr<Upstream> (*)(int device);
struct NamedUpstream {
  const char* name;
  UpstreamCtor make;
};
const NamedUpstream kUpstreams[] = {
    {"device", [](int d) -> std::shared_ptr<Upstream> { return std::make_shared<CudaDeviceUpstream>(d); }},
    {"async", [](int d) -> std::shared_ptr<Upstream> { return std::make_shared<CudaAsyncUpstream>(d); }},
    {"virtual", [](int d) -> std::shared_ptr<Upstream> { return std::make_shared<CudaVirtualUpstream>(d); }},
    // A simulated device per index: lets CPU tests drive the lazy per-device path through the C ABI.
    {"simulated", [](int) -> std::shared_ptr<Upstream> { return std::make_shared<SimulatedUpstream>(LatencyModel::none()); }},
};

UpstreamCtor find_upstream(const std::string& name) {
  for (const auto& u : kUpstreams)
    if (name == u.name) return u.make;
  throw InvalidArgument("unknown factory upstream '" + name + "' (valid: device, async, virtual, simulated)");
}

}  // namespace

std::shared_ptr<Upstream> upstream_by_name(const std::string& name, int device) { return find_upstream(name)(device); }

void bind_torch_factory(nb::module_& m) {
  m.def(
      "registry_set_factory",
      [](const std::string& kind, nb::handle options, const std::string& upstream) {
        PoolMaker make_pool = pool_maker(kind, options);  // throws on a bad kind or option, changing nothing
        const UpstreamCtor make_up = find_upstream(upstream);
        // An expandable arena maps pages into one reserved range: only the virtual-memory
        // upstream (or the simulated device, which has that interface) can back it.
        if (kind == "arena_expandable" && upstream != "virtual" && upstream != "simulated")
          throw InvalidArgument("pool kind 'arena_expandable' needs upstream 'virtual' (CudaVirtual: reserve a "
                                "range, map pages at its end); got upstream '" + upstream + "'");
        registry::set_factory([make_pool, make_up](int device) -> std::shared_ptr<Pool> {
          if (device < 0)
            throw InvalidArgument("the pool factory makes device pools; no host pool for device " +
                                  std::to_string(device));
          return make_pool(make_up(device));
        });
      },
      "kind"_a, "options"_a = nb::none(), "upstream"_a = "device",
      "Create each device's pool lazily, on its first request through the C ABI: a pool of `kind` "
      "('arena', 'arena_expandable', 'size_class', 'direct') with `options` over a `upstream` ('device': "
      "CudaDevice, 'async': CudaAsync, 'virtual': CudaVirtual, 'simulated': a simulated device, for "
      "tests). Options are validated now.");
  m.def("upstream_by_name", &upstream_by_name, "name"_a, "device"_a = 0,
        "A new upstream by name for device: 'device' (CudaDevice), 'async' (CudaAsync), 'virtual' (CudaVirtual), "
        "'simulated' (a simulated device). The names registry_set_factory accepts.");
  m.def("registry_clear_factory", []() { registry::set_factory(nullptr); },
        "Remove the factory (pools it already made stay installed).");
  m.def("registry_has_factory", &registry::has_factory);
}

}  // namespace poolkeeper::py
