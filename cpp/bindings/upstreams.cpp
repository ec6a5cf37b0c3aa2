// Upstream bindings: the base class (counters, stream interface) and Host / Simulated.
#include <nanobind/stl/shared_ptr.h>

#include "bindings.hpp"
#include "poolkeeper/host_upstream.hpp"
#include "poolkeeper/simulated_upstream.hpp"

namespace poolkeeper::py {

namespace {
// map / unmap / unreserve: a range given as (addr, nbytes), the size parsed like every size, the
// call (a driver call on a device) without the GIL.
template <void (Upstream::*F)(std::uintptr_t, std::size_t)>
void range_call(Upstream& u, std::uintptr_t addr, nb::handle nbytes) {
  const std::size_t n = parse_size(nbytes, "nbytes");
  GilRelease nogil;
  (u.*F)(addr, n);
}
}  // namespace

void bind_upstreams(nb::module_& m) {
  nb::class_<Upstream>(m, "Upstream", "Where backing memory comes from (abstract).")
      .def(
          "allocate",
          [](Upstream& u, nb::handle nbytes) {
            const std::size_t n = check_request(parse_size(nbytes));
            GilRelease nogil;
            return reinterpret_cast<std::uintptr_t>(u.allocate(n));
          },
          "nbytes"_a.none(), "Allocate nbytes of backing memory directly (counted). Returns the address.")
      .def(
          "deallocate",
          [](Upstream& u, nb::handle ptr, nb::handle nbytes) {
            const std::uintptr_t p = parse_ptr(ptr);
            const std::size_t n = parse_size(nbytes);
            if (!p) throw InvalidPointer("cannot free a null pointer", 0, "null");
            GilRelease nogil;
            u.deallocate(reinterpret_cast<void*>(p), n);
          },
          "ptr"_a.none(), "nbytes"_a.none(), "Return memory from allocate() with the same nbytes (counted).")
      .def("counters", [](const Upstream& u) { return upstream_counters_to_dict(u.counters()); },
           "Call counters: allocations, deallocations, bytes, outstanding, cumulative ns.")
      .def("reset_counters", &Upstream::reset_counters)
      .def_prop_ro("name", &Upstream::name)
      .def_prop_ro("kind", [](const Upstream& u) { return std::string(memory_kind_name(u.kind())); })
      .def_prop_ro("device", &Upstream::device)
      .def_prop_ro("alignment", &Upstream::alignment)
      .def_prop_ro("streams_supported", &Upstream::streams_supported)
      .def_prop_ro("supports_virtual", &Upstream::supports_virtual,
                   "Whether reserve/map/unmap/unreserve (virtual memory) are available.")
      .def_prop_ro("vm_granularity", &Upstream::vm_granularity)
      .def_prop_ro("memory_capacity", &Upstream::memory_capacity, "Physical memory in all (0: unknown).")
      .def(
          "reserve",
          [](Upstream& u, nb::handle nbytes) {
            const std::size_t n = parse_size(nbytes, "nbytes");
            GilRelease nogil;
            return u.reserve(n);
          },
          "nbytes"_a.none(), "Reserve a virtual range (granule multiple). Returns its base.")
      .def(
          "map", &range_call<&Upstream::map>,
          "addr"_a, "nbytes"_a.none(), "Map physical memory onto [addr, addr+nbytes) of a reserved range (counted as an allocation).")
      .def(
          "unmap", &range_call<&Upstream::unmap>,
          "addr"_a, "nbytes"_a.none(), "Unmap exactly one earlier map's range (counted as a deallocation).")
      .def(
          "unreserve", &range_call<&Upstream::unreserve>,
          "addr"_a, "nbytes"_a.none(), "Give back a reserved range with nothing mapped in it.")
      .def(
          "record_event", [](Upstream& u, nb::handle s) { return u.record_event(parse_stream(s)); }, "stream"_a.none())
      .def("query_event", &Upstream::query_event, "event"_a)
      .def(
          "wait_event",
          [](Upstream& u, EventId e) {
            GilRelease nogil;
            u.wait_event(e);
          },
          "event"_a)
      .def("release_event", &Upstream::release_event, "event"_a)
      .def("synchronize", [](Upstream& u) {
        GilRelease nogil;
        u.synchronize();
      });

  nb::class_<HostUpstream, Upstream>(m, "HostUpstream")
      .def("__init__", [](HostUpstream* self, std::size_t alignment) { new (self) HostUpstream(alignment); },
           "alignment"_a = 256);

  nb::class_<SimulatedUpstream, Upstream>(m, "SimulatedUpstream")
      .def(
          "__init__",
          [](SimulatedUpstream* self, nb::handle latency, nb::handle latency_us, nb::handle capacity,
             std::size_t alignment) {
            LatencyModel model;
            if (!latency_us.is_none()) {
              const double us = nb::cast<double>(latency_us);
              if (!(us >= 0)) throw InvalidArgument("latency_us must be >= 0");
              model = LatencyModel::fixed(us);
            } else {
              const std::string name = latency.is_none() ? "h200" : nb::cast<std::string>(latency);
              if (name == "h200") model = LatencyModel::h200();
              else if (name == "none") model = LatencyModel::none();
              else throw InvalidArgument("latency must be 'h200' or 'none' (or give latency_us); got '" + name + "'");
            }
            const std::size_t cap = capacity.is_none() ? (std::size_t{140} << 30) : parse_size(capacity, "capacity");
            new (self) SimulatedUpstream(model, cap, alignment);
          },
          "latency"_a = nb::none(), "latency_us"_a = nb::none(), "capacity"_a = nb::none(), "alignment"_a = 256)
      .def("stream", &SimulatedUpstream::new_stream, "A new simulated stream (an int handle).")
      .def(
          "enqueue", [](SimulatedUpstream& u, nb::handle s, double us) { u.enqueue(parse_stream(s), us); }, "stream"_a.none(),
          "work_us"_a, "Enqueue work_us of device work on stream.")
      .def("advance", &SimulatedUpstream::advance, "us"_a, "Move the virtual clock forward.")
      .def_prop_ro("now", &SimulatedUpstream::now, "The virtual clock, in microseconds.")
      .def(
          "busy_until", [](SimulatedUpstream& u, nb::handle s) { return u.stream_busy_until(parse_stream(s)); },
          "stream"_a.none())
      .def_prop_ro("live_events", &SimulatedUpstream::live_events)
      .def_prop_ro("capacity", &SimulatedUpstream::capacity)
      .def_prop_ro("latency_model", [](const SimulatedUpstream& u) {
        const auto& m = u.model();
        nb::dict d;
        d["alloc_base_us"] = m.alloc_base_us;
        d["alloc_per_mib_us"] = m.alloc_per_mib_us;
        d["free_base_us"] = m.free_base_us;
        d["free_per_mib_us"] = m.free_per_mib_us;
        return d;
      });
}

}  // namespace poolkeeper::py
