// CUDA bindings: availability and device info, the CUDA upstreams (subclasses of the bound
// Upstream), the warm-pool manager's state (plus a simulated control for CPU tests), and the small
// driver helpers poolkeeper.cuda.driver wraps. Pointers and handles travel as ints. Calls that can
// block on the device release the GIL. Nothing here touches the driver until called.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>

#include "bindings.hpp"
#include "poolkeeper/cuda/cuda_driver.hpp"
#include "poolkeeper/cuda/cuda_ops.hpp"
#include "poolkeeper/cuda/cuda_upstreams.hpp"
#include "poolkeeper/cuda/warm_pool.hpp"
#include "poolkeeper/upstreams/warm_pool_sim.hpp"

namespace poolkeeper::py {

namespace {

std::uintptr_t stream_arg(nb::handle h) {
  const Stream s = parse_stream(h);
  return s == kNoStream ? 0 : static_cast<std::uintptr_t>(s);  // None: the legacy default stream
}

int mempool_attr_id(const std::string& name) {
  using namespace cuda::drv;
  if (name == "release_threshold") return CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
  if (name == "reserved_mem_current") return CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT;
  if (name == "reserved_mem_high") return CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH;
  if (name == "used_mem_current") return CU_MEMPOOL_ATTR_USED_MEM_CURRENT;
  if (name == "used_mem_high") return CU_MEMPOOL_ATTR_USED_MEM_HIGH;
  throw InvalidArgument("unknown mempool attribute '" + name +
                        "' (release_threshold, reserved_mem_current, reserved_mem_high, used_mem_current, "
                        "used_mem_high)");
}

nb::dict warm_state_to_dict(const WarmPoolState& s) {
  auto text_or_none = [](const std::string& t) { return t.empty() ? nb::none() : nb::object(nb::str(t.c_str())); };
  nb::list devices, raised, msgs;
  for (const auto& dev : s.devices) {
    devices.append(dict_of("device", dev.device, "handles", dev.handles, "raised", dev.raised, "previous",
                           dev.raised ? nb::object(nb::int_(dev.previous)) : nb::none(), "unsupported",
                           text_or_none(dev.unsupported)));
    if (dev.raised) raised.append(dev.device);
  }
  for (const auto& m : s.messages) msgs.append(nb::str(m.c_str()));
  return dict_of("devices", devices, "raised_devices", raised, "total_handles", s.total_handles, "raises", s.raises,
                 "restores", s.restores, "trims", s.trims, "left_alone", s.left_alone, "configure_failures",
                 s.configure_failures, "release_failures", s.release_failures, "last_error",
                 text_or_none(s.last_error), "messages", msgs);
}

void bind_driver_helpers(nb::module_& m) {
  m.def("cuda_is_available", &cuda::is_available, "Is a CUDA driver with at least one device present?");
  m.def("cuda_unavailable_reason", &cuda::unavailable_reason, "Why CUDA is unavailable ('' when it is available).");
  m.def("cuda_device_count", &cuda::device_count, "Visible CUDA devices (0 without a driver).");
  m.def("cuda_driver_version", []() { return cuda::api().driver_version; });
  m.def("cuda_driver_library", []() { return cuda::api().library; });
  m.def("cuda_device_info", [](int device) {
    const cuda::DeviceInfo i = cuda::device_info(device);
    return dict_of("index", i.index, "name", i.name, "pci_bus_id", i.pci_bus_id, "total_memory", i.total_memory,
                   "free_memory", i.free_memory, "compute_capability",
                   nb::make_tuple(i.compute_capability_major, i.compute_capability_minor), "multiprocessors",
                   i.multiprocessors, "memory_pools_supported", i.memory_pools_supported, "virtual_memory_supported",
                   i.virtual_memory_supported);
  }, "device"_a);
  m.def("cuda_virtual_memory_supported", &cuda::virtual_memory_supported, "device"_a,
        "Can CudaVirtual run on this device (the driver's virtual memory calls and the device's "
        "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)? False without a driver or for a bad index; makes no context.");
  m.def("cuda_current_device", &cuda::current_device,
        "Device of the calling thread's current context (-1 when none is current).");
  m.def("cuda_set_device", &cuda::set_current_device, "device"_a,
        "Make the device's primary context current on the calling thread.");

  m.def("cuda_stream_create", &cuda::stream_create, "device"_a = 0, "non_blocking"_a = true);
  m.def("cuda_stream_destroy", &cuda::stream_destroy, "stream"_a);
  m.def("cuda_stream_synchronize", [](nb::handle s) {
    const std::uintptr_t h = stream_arg(s);
    ReleaseGil nogil;
    cuda::stream_synchronize(h);
  }, "stream"_a);
  m.def("cuda_event_record_new", [](nb::handle s) { return cuda::event_record_new(stream_arg(s)); }, "stream"_a);
  m.def("cuda_event_record", [](std::uintptr_t e, nb::handle s) { cuda::event_record(e, stream_arg(s)); }, "event"_a,
        "stream"_a);
  m.def("cuda_event_query", &cuda::event_query, "event"_a);
  m.def("cuda_event_synchronize", [](std::uintptr_t e) {
    ReleaseGil nogil;
    cuda::event_synchronize(e);
  }, "event"_a);
  m.def("cuda_event_destroy", &cuda::event_destroy, "event"_a);

  m.def("cuda_memcpy_htod", [](std::uintptr_t dst, std::uintptr_t src, std::size_t n) {
    ReleaseGil nogil;
    cuda::memcpy_htod(dst, reinterpret_cast<const void*>(src), n);
  }, "dst"_a, "src"_a, "nbytes"_a);
  m.def("cuda_memcpy_htod_async", [](std::uintptr_t dst, std::uintptr_t src, std::size_t n, nb::handle s) {
    const std::uintptr_t h = stream_arg(s);
    ReleaseGil nogil;
    cuda::memcpy_htod_async(dst, reinterpret_cast<const void*>(src), n, h);
  }, "dst"_a, "src"_a, "nbytes"_a, "stream"_a);
  m.def("cuda_memcpy_dtoh", [](std::uintptr_t dst, std::uintptr_t src, std::size_t n) {
    ReleaseGil nogil;
    cuda::memcpy_dtoh(reinterpret_cast<void*>(dst), src, n);
  }, "dst"_a, "src"_a, "nbytes"_a);
  m.def("cuda_memcpy_dtoh_async", [](std::uintptr_t dst, std::uintptr_t src, std::size_t n, nb::handle s) {
    const std::uintptr_t h = stream_arg(s);
    ReleaseGil nogil;
    cuda::memcpy_dtoh_async(reinterpret_cast<void*>(dst), src, n, h);
  }, "dst"_a, "src"_a, "nbytes"_a, "stream"_a);
  m.def("cuda_memset_d8", [](std::uintptr_t dst, unsigned value, std::size_t n, nb::handle s) {
    if (value > 255) throw InvalidArgument("memset value must be 0..255; got " + std::to_string(value));
    if (s.is_none()) {
      ReleaseGil nogil;
      cuda::memset_d8(dst, static_cast<unsigned char>(value), n);
    } else {
      const std::uintptr_t h = stream_arg(s);
      ReleaseGil nogil;
      cuda::memset_d8_async(dst, static_cast<unsigned char>(value), n, h);
    }
  }, "dst"_a, "value"_a, "nbytes"_a, "stream"_a = nb::none());
  m.def("cuda_device_synchronize", [](int device) {
    ReleaseGil nogil;
    cuda::device_synchronize(device);
  }, "device"_a);
  // Benchmark helper: the allocate + free + stream-synchronize cycle timed in C++ (no Python in the
  // loop), so the bindings' share of a Python-level figure can be told apart.
  m.def("cuda_time_upstream_cycle", [](Upstream& up, std::size_t nbytes, std::size_t iters, nb::handle s) {
    const std::uintptr_t h = stream_arg(s);
    const std::size_t n = check_request(nbytes);
    ReleaseGil nogil;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < iters; ++i) {
      void* p = up.allocate(n);
      up.deallocate(p, n);
      cuda::stream_synchronize(h);
    }
    const auto dt = std::chrono::steady_clock::now() - t0;
    return std::chrono::duration<double, std::nano>(dt).count() / double(iters ? iters : 1);
  }, "upstream"_a, "nbytes"_a, "iters"_a, "stream"_a,
     "Mean ns per allocate + deallocate + stream synchronize, timed natively.");
  m.def("cuda_mem_get_info", [](int device) {
    std::size_t free = 0, total = 0;
    cuda::mem_get_info(device, free, total);
    return nb::make_tuple(free, total);
  }, "device"_a);
}

void bind_cuda_upstreams(nb::module_& m) {
  nb::class_<CudaDeviceUpstreamBase, Upstream>(m, "CudaDeviceUpstreamBase")
      .def_prop_ro("events_created", [](const CudaDeviceUpstreamBase& u) { return u.events().created(); },
                   "CUDA events ever created by this upstream's event pool (they are reused).")
      .def_prop_ro("events_in_use", [](const CudaDeviceUpstreamBase& u) { return u.events().in_use(); });

  nb::class_<CudaDeviceUpstream, CudaDeviceUpstreamBase>(m, "CudaDeviceUpstream")
      .def("__init__", [](CudaDeviceUpstream* self, int device) { new (self) CudaDeviceUpstream(device); },
           "device"_a = 0);

  nb::class_<CudaAsyncUpstream, CudaDeviceUpstreamBase>(m, "CudaAsyncUpstream")
      .def("__init__",
           [](CudaAsyncUpstream* self, int device, nb::handle stream, bool warm) {
             new (self) CudaAsyncUpstream(device, stream_arg(stream), warm);
           },
           "device"_a = 0, "stream"_a = nb::none(), "warm"_a = true)
      .def_prop_ro("stream", [](const CudaAsyncUpstream& u) { return static_cast<std::uint64_t>(u.stream()); })
      .def_prop_ro("warm", &CudaAsyncUpstream::warm);

  nb::class_<CudaVirtualUpstream, CudaDeviceUpstreamBase>(m, "CudaVirtualUpstream")
      .def("__init__", [](CudaVirtualUpstream* self, int device) { new (self) CudaVirtualUpstream(device); },
           "device"_a = 0)
      .def_prop_ro("aliases", &CudaVirtualUpstream::aliases, "Second mappings (aliases) now.")
      .def_prop_ro("mapped_pieces", &CudaVirtualUpstream::mapped_pieces,
                   "Physical pieces mapped now (each holds its own cuMemCreate handle).")
      .def_prop_ro("leaked_handles", &CudaVirtualUpstream::leaked_handles,
                   "Handles whose cuMemRelease failed after a successful unmap (leaked, not thrown).")
      .def_prop_ro("leaked_ranges", &CudaVirtualUpstream::leaked_ranges,
                   "Address ranges whose cuMemAddressFree failed after their memory was unmapped.")
      .def_prop_ro(
          "unmap_runs",
          [](const CudaVirtualUpstream& u) -> nb::object {
            const int r = u.unmap_runs();
            if (!r) return nb::none();
            return nb::bool_(r > 0);
          },
          "Whether the driver takes down a run of adjacent mappings with one cuMemUnmap: None until the "
          "first unmap or unalias run of several pieces asks it; False: each mapping goes alone.")
      .def_prop_ro("driver_unmaps", &CudaVirtualUpstream::driver_unmaps,
                   "cuMemUnmap calls made (unmaps and unaliases; a run taken down at once is one).");

  nb::class_<CudaPinnedUpstream, Upstream>(m, "CudaPinnedUpstream")
      .def("__init__", [](CudaPinnedUpstream* self, int device) { new (self) CudaPinnedUpstream(device); },
           "device"_a = 0);
}

void bind_warm_pool(nb::module_& m) {
  m.def("cuda_warm_state", []() { return warm_state_to_dict(WarmPoolManager::global().state()); },
        "State of the process-wide warm-pool manager (handles, raised devices, failures, messages).");
  m.def("cuda_mempool_attribute", [](int device, const std::string& name) {
    return cuda_mempool_attribute(device, mempool_attr_id(name));
  }, "device"_a, "name"_a);
  m.def("cuda_mempool_set_release_threshold", &cuda_mempool_set_release_threshold, "device"_a, "value"_a);
  m.def("cuda_mempool_reset_high", [](int device, const std::string& name) {
    cuda_mempool_reset_high(device, mempool_attr_id(name));
  }, "device"_a, "name"_a);
  m.def("cuda_mempool_trim_to", [](int device, std::uint64_t keep) {
    ReleaseGil nogil;
    cuda_mempool_trim_to(device, keep);
  }, "device"_a, "keep_bytes"_a);

  nb::class_<PoolControl>(m, "PoolControl");
  nb::class_<SimulatedPoolControl, PoolControl>(m, "SimulatedPoolControl")
      .def("__init__", [](SimulatedPoolControl* self, int devices) { new (self) SimulatedPoolControl(devices); },
           "devices"_a = 1)
      .def("set_external", &SimulatedPoolControl::set_external, "device"_a, "value"_a)
      .def("threshold", &SimulatedPoolControl::threshold, "device"_a)
      .def("fail_next", &SimulatedPoolControl::fail_next, "op"_a, "error_name"_a, "times"_a = 1)
      .def("set_unsupported", &SimulatedPoolControl::set_unsupported, "device"_a, "reason"_a)
      .def("calls", &SimulatedPoolControl::calls)
      .def("clear_calls", &SimulatedPoolControl::clear_calls);

  nb::class_<WarmPoolManager>(m, "WarmPoolManager")
      .def("__init__",
           [](WarmPoolManager* self, std::shared_ptr<PoolControl> control, bool log_to_stderr) {
             new (self) WarmPoolManager(std::move(control), log_to_stderr);
           },
           "control"_a, "log_to_stderr"_a = false)
      .def("acquire", [](WarmPoolManager& w, int device) {
        ReleaseGil nogil;
        w.acquire(device);
      }, "device"_a)
      .def("release", [](WarmPoolManager& w, int device) {
        ReleaseGil nogil;
        w.release(device);
      }, "device"_a)
      .def("state", [](const WarmPoolManager& w) { return warm_state_to_dict(w.state()); });
}

}  // namespace

void bind_cuda(nb::module_& m) {
  bind_driver_helpers(m);
  bind_cuda_upstreams(m);
  bind_warm_pool(m);
}

}  // namespace poolkeeper::py
