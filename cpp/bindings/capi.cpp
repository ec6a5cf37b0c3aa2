// Python access to the C ABI registry, and a native loop to time the C-ABI pair without Python.
#include <chrono>
#include <nanobind/stl/shared_ptr.h>

#include "../capi/poolkeeper_capi.h"
#include "bindings.hpp"
#include "poolkeeper/pools/graph_registry.hpp"
#include "poolkeeper/core/registry.hpp"

namespace poolkeeper::py {

void bind_capi(nb::module_& m) {
  // The registry's device bound, for the Python code that checks device indices against it.
  m.attr("MAX_DEVICES") = registry::kMaxDevices;
  m.def("registry_set",
        [](nb::handle device, nb::handle pool) {
          const int d = parse_device(device);
          std::shared_ptr<Pool> p;
          if (!pool.is_none() && !nb::try_cast<std::shared_ptr<Pool>>(pool, p))
            throw InvalidArgument("registry_set: pool must be a poolkeeper pool or None; got " + shown(pool));
          registry::set(d, exit_safe(std::move(p)));
        },
        "device"_a.none(), "pool"_a.none(), "Install pool for device (-1: host) behind the C ABI; None removes it.");
  m.def("registry_get", [](nb::handle device) -> nb::object {
        const int d = parse_device(device);
        Pool* p = registry::get_fast(d);
        if (!p) return nb::none();
        return nb::cast(registry::get_shared(d));
      }, "device"_a.none());
  m.def("registry_ensure", [](nb::handle device) { registry::get_shared(parse_device(device)); }, "device"_a.none(),
        "Make device's pool now through the factory (in C++, so no Python object holds it: the "
        "interpreter-exit hook has nothing to release). Raises when there is no factory.");
  m.def("registry_clear", []() {
    graph_registry::clear();  // the device pools' graph pools go with them
    registry::clear();
  });
  m.def(
      "registry_python_owned",
      []() {
        // Devices whose pool has a live Python object. Such a pool is held by a Python reference
        // inside the registry's shared_ptr (a pool made in Python), or holds one (a wrapper made by
        // registry_get); the exit hook drops those entries so Python frees them before nanobind's
        // leak check, instead of a C++ static destroyed after the interpreter is gone.
        nb::list l;
        for (auto& [d, p] : registry::all())
          if (nb::find(p.get()).is_valid()) l.append(d);
        return l;
      },
      "Devices whose registry pool has a Python object (the interpreter-exit hook releases them).");
  m.def("_set_leak_warnings", [](bool on) { nb::set_leak_warnings(on); }, "on"_a,
        "nanobind's report of instances alive at interpreter exit (see poolkeeper._exit).");
  m.def("registry_retired", []() {
        return dict_of("pools", registry::retired_count(), "graph_pools", graph_registry::retired_count());
      },
      "Replaced pools and GraphPools the C ABI registry still keeps: a call was inside them when "
      "they were replaced, or (GraphPools) a captured graph's blocks or scope are still live.");
  m.def("registry_devices", []() {
    nb::list l;
    for (auto& [d, p] : registry::all()) l.append(d);
    return l;
  });
  m.def(
      "capi_bench_pair",
      [](int device, std::size_t nbytes, std::size_t iterations, nb::handle stream) {
        const Stream s = parse_stream(stream);
        ReleaseGil nogil;
        // Warm the path (first call may grow a backing and fill the thread cache).
        void* w = poolkeeper_malloc(nbytes, device, s);
        if (!w) throw Error(std::string("capi_bench_pair: ") + poolkeeper_last_error());
        poolkeeper_free(w, device, s);
        const auto t0 = std::chrono::steady_clock::now();
        for (std::size_t i = 0; i < iterations; ++i) {
          void* p = poolkeeper_malloc(nbytes, device, s);
          poolkeeper_free(p, device, s);
        }
        const auto t1 = std::chrono::steady_clock::now();
        return double(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()) / double(iterations);
      },
      "device"_a, "nbytes"_a, "iterations"_a, "stream"_a = nb::none(),
      "Time poolkeeper_malloc+poolkeeper_free pairs in a native loop; returns ns per pair.");
  m.def("capi_last_error", []() { return std::string(poolkeeper_last_error()); });
  bind_capi_threads(m);
}

}  // namespace poolkeeper::py
