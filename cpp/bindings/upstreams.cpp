// Upstream bindings: the base class (counters, stream interface) and Host / Simulated.
#include <nanobind/stl/shared_ptr.h>

#include <vector>

#include "bindings.hpp"
#include "poolkeeper/upstreams/host_upstream.hpp"
#include "poolkeeper/upstreams/simulated_upstream.hpp"

namespace poolkeeper::py {

namespace {
// map / unmap / unreserve: a range given as (addr, nbytes), the size parsed like every size, the
// call (a driver call on a device) without the GIL.
// Addresses and event ids are converted here too: nanobind's own conversion of an int outside
// [0, 2^64) is a TypeError ("incompatible function arguments"), not a poolkeeper error.
template <void (Upstream::*F)(std::uintptr_t, std::size_t)>
void range_call(Upstream& u, nb::handle addr_, nb::handle nbytes) {
  const std::uintptr_t addr = parse_ptr(addr_);
  const std::size_t n = parse_size(nbytes, "nbytes");
  ReleaseGil nogil;
  (u.*F)(addr, n);
}
// A run given from Python holds at most this many pieces (2 TiB of 2 MiB pieces, more than any
// device has): the length of a sequence that claims more is refused before any item is read.
constexpr Py_ssize_t kMaxRunPieces = Py_ssize_t{1} << 20;
constexpr std::size_t kMaxRunBytes = std::size_t{1} << 62;
Py_ssize_t run_length(nb::handle h, const std::string& what) {
  const Py_ssize_t n = PySequence_Size(h.ptr());
  if (n < 0) {
    clear_bad_input_error();
    throw InvalidArgument(what + " must be a sequence with a length; got " + shown(h));
  }
  if (n > kMaxRunPieces)
    throw InvalidArgument(what + " holds " + std::to_string(n) + " pieces; a run holds at most " + std::to_string(kMaxRunPieces));
  return n;
}
// alias_pieces' sources: a sequence of (src, nbytes) pairs, each converted like every address and
// size (anything else is an InvalidArgumentError naming the item, never a TypeError). Read item by
// item: a __len__ that lies must not size an allocation. An interrupt raised while reading one
// (KeyboardInterrupt, SystemExit, MemoryError) propagates (clear_bad_input_error).
std::vector<Upstream::AliasSource> alias_sources(nb::handle h) {
  const std::string what = "sources must be a sequence of (src, nbytes) pairs; got ";
  if (!PySequence_Check(h.ptr()) || PyUnicode_Check(h.ptr()) || PyBytes_Check(h.ptr())) throw InvalidArgument(what + shown(h));
  const Py_ssize_t n = run_length(h, "sources");
  auto get = [&](PyObject* seq, Py_ssize_t i, const std::string& name) {
    nb::object o = nb::steal(PySequence_GetItem(seq, i));
    if (!o.is_valid()) {
      clear_bad_input_error();
      throw InvalidArgument(name + " could not be read");
    }
    return o;
  };
  std::vector<Upstream::AliasSource> out;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const std::string name = "sources[" + std::to_string(i) + "]";
    nb::object item = get(h.ptr(), i, name);
    const Py_ssize_t k = PySequence_Check(item.ptr()) ? PySequence_Size(item.ptr()) : -1;
    if (k < 0) clear_bad_input_error();
    if (k != 2) throw InvalidArgument(name + " must be a (src, nbytes) pair; got " + shown(item));
    nb::object src = get(item.ptr(), 0, name), bytes = get(item.ptr(), 1, name);
    out.push_back({parse_ptr(src), parse_size(bytes, "nbytes")});
  }
  return out;
}
// unmap_pieces/unalias_pieces' sizes: a sequence of positive sizes, read item by item as
// alias_sources reads its pairs (an InvalidArgumentError naming a bad item; interrupts
// propagate), at most kMaxRunPieces of them summing to at most kMaxRunBytes: a lazy sequence of
// billions of items (range(...)) is refused at once instead of read for minutes into memory.
std::vector<std::size_t> piece_sizes(nb::handle h) {
  const std::string what = "sizes must be a sequence of piece sizes in bytes; got ";
  if (!PySequence_Check(h.ptr()) || PyUnicode_Check(h.ptr()) || PyBytes_Check(h.ptr())) throw InvalidArgument(what + shown(h));
  const Py_ssize_t n = run_length(h, "sizes");
  std::vector<std::size_t> out;
  std::size_t total = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const std::string name = "sizes[" + std::to_string(i) + "]";
    nb::object o = nb::steal(PySequence_GetItem(h.ptr(), i));
    if (!o.is_valid()) {
      clear_bad_input_error();
      throw InvalidArgument(name + " could not be read");
    }
    const std::size_t k = parse_size(o, name.c_str());
    if (!k) throw InvalidArgument(name + " is 0: a piece has at least one byte");
    total += k;
    if (total > kMaxRunBytes) throw InvalidArgument("sizes sum past 2^62 bytes at " + name);
    out.push_back(k);
  }
  return out;
}
// unmap_pieces / unalias_pieces: the run's base and its piece sizes converted here; returns how
// many went.
template <void (Upstream::*F)(std::uintptr_t, const std::size_t*, std::size_t, std::size_t&)>
std::size_t run_down(Upstream& u, nb::handle base_, nb::handle sizes_) {
  const std::uintptr_t base = parse_ptr(base_);
  const std::vector<std::size_t> sizes = piece_sizes(sizes_);
  std::size_t done = 0;
  ReleaseGil nogil;
  (u.*F)(base, sizes.data(), sizes.size(), done);
  return done;
}
// A capture mode as the driver numbers them: 0 global, 1 thread-local, 2 relaxed.
int capture_mode(nb::handle h) {
  std::uint64_t m = 3;
  try {
    m = parse_u64(h, "mode");
  } catch (const InvalidArgument&) {  // not an int in [0, 2^64): told as any other wrong mode
  }
  if (m > 2) throw InvalidArgument("mode must be 0 (global), 1 (thread-local) or 2 (relaxed); got " + shown(h));
  return static_cast<int>(m);
}
}  // namespace

void bind_upstreams(nb::module_& m) {
  nb::class_<Upstream>(m, "Upstream", "Where backing memory comes from (abstract).")
      .def(
          "allocate",
          [](Upstream& u, nb::handle nbytes) {
            const std::size_t n = check_request(parse_size(nbytes));
            void* r;
            {
              ReleaseGil nogil;
              r = u.allocate(n);
            }
            return keep_unless_interrupted(r, [&](void* q) { u.deallocate(q, n); });
          },
          "nbytes"_a.none(), "Allocate nbytes of backing memory directly (counted). Returns the address.")
      .def(
          "deallocate",
          [](Upstream& u, nb::handle ptr, nb::handle nbytes) {
            const std::uintptr_t p = parse_ptr(ptr);
            const std::size_t n = parse_size(nbytes);
            if (!p) throw InvalidPointer("cannot free a null pointer", 0, "null");
            ReleaseGil nogil;
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
            ReleaseGil nogil;
            return u.reserve(n);
          },
          "nbytes"_a.none(), "Reserve a virtual range (granule multiple). Returns its base.")
      .def(
          "map", &range_call<&Upstream::map>,
          "addr"_a.none(), "nbytes"_a.none(), "Map physical memory onto [addr, addr+nbytes) of a reserved range (counted as an allocation).")
      .def(
          "unmap", &range_call<&Upstream::unmap>,
          "addr"_a.none(), "nbytes"_a.none(), "Unmap exactly one earlier map's range (counted as a deallocation).")
      .def(
          "unreserve", &range_call<&Upstream::unreserve>,
          "addr"_a.none(), "nbytes"_a.none(), "Give back a reserved range with nothing mapped in it.")
      .def_prop_ro("supports_alias", &Upstream::supports_alias,
                   "Whether alias/unalias (a second mapping of mapped memory) are available.")
      .def(
          "alias",
          [](Upstream& u, nb::handle dst_, nb::handle src_, nb::handle nbytes) {
            const std::uintptr_t dst = parse_ptr(dst_), src = parse_ptr(src_);
            const std::size_t n = parse_size(nbytes, "nbytes");
            ReleaseGil nogil;
            u.alias(dst, src, n);
          },
          "dst"_a.none(), "src"_a.none(), "nbytes"_a.none(),
          "Map the memory of one mapped piece [src, src+nbytes) again at dst (not counted as an allocation).")
      .def(
          "unalias", &range_call<&Upstream::unalias>,
          "addr"_a.none(), "nbytes"_a.none(), "Remove exactly one earlier alias; the memory stays mapped at its source.")
      .def(
          "map_pieces",
          [](Upstream& u, nb::handle addr_, nb::handle nbytes, nb::handle piece_) {
            const std::uintptr_t addr = parse_ptr(addr_);
            const std::size_t n = parse_size(nbytes, "nbytes"), piece = parse_size(piece_, "piece");
            if (!piece) throw InvalidArgument("piece must be positive");
            std::size_t done = 0;
            ReleaseGil nogil;
            u.map_pieces(addr, n, piece, done);
            return done;
          },
          "addr"_a.none(), "nbytes"_a.none(), "piece"_a.none(),
          "Map [addr, addr+nbytes) in pieces of ``piece`` bytes (the last one what is left) in one run: "
          "each piece counts as one map and is unmapped alone; a device that can grants access once for "
          "the run. Returns the bytes mapped. A refused piece is raised with the pieces before it mapped "
          "(their count in ``counters()['maps']``); a refused access grant (CudaVirtual) maps none.")
      .def(
          "alias_pieces",
          [](Upstream& u, nb::handle dst_, nb::handle sources) {
            const std::uintptr_t dst = parse_ptr(dst_);
            const std::vector<Upstream::AliasSource> srcs = alias_sources(sources);
            std::size_t done = 0;
            ReleaseGil nogil;
            u.alias_pieces(dst, srcs.data(), srcs.size(), done);
            return done;
          },
          "dst"_a.none(), "sources"_a.none(),
          "Alias the mapped pieces ``sources`` ((src, nbytes) pairs) end to end from dst in one run: each "
          "counts as one alias and is unaliased alone. Returns how many were aliased. A refused piece is "
          "raised with the aliases before it in place (``counters()['aliases']``); a refused access grant "
          "(CudaVirtual) leaves none.")
      .def(
          "unmap_pieces", &run_down<&Upstream::unmap_pieces>, "addr"_a.none(), "sizes"_a.none(),
          "Unmap the pieces lying end to end from addr (``sizes``: each one earlier map's bytes) in one "
          "run, last first: each counts as one unmap; a device that can takes the run down in one call. "
          "Returns how many were unmapped. A refused piece is raised with it and the pieces before it "
          "still mapped.")
      .def(
          "unalias_pieces", &run_down<&Upstream::unalias_pieces>, "dst"_a.none(), "sizes"_a.none(),
          "Remove the aliases lying end to end from dst (``sizes``: each one earlier alias's bytes) in one "
          "run, last first; the memory stays mapped at its sources. Returns how many were removed. A "
          "refused one is raised with it and the aliases before it still in place.")
      .def(
          "record_event", [](Upstream& u, nb::handle s) { return u.record_event(parse_stream(s)); }, "stream"_a.none())
      .def("query_event", [](Upstream& u, nb::handle e) { return u.query_event(parse_u64(e, "event")); }, "event"_a.none())
      .def(
          "wait_event",
          [](Upstream& u, nb::handle e_) {
            const EventId e = parse_u64(e_, "event");
            ReleaseGil nogil;
            u.wait_event(e);
          },
          "event"_a.none())
      .def("release_event", [](Upstream& u, nb::handle e) { u.release_event(parse_u64(e, "event")); }, "event"_a.none())
      .def("synchronize", [](Upstream& u) {
        ReleaseGil nogil;
        u.synchronize();
      });

  // Constructor arguments are taken as handles and converted here, so a bad one is an
  // InvalidArgumentError naming it (nanobind's own conversion would raise a TypeError, or
  // std::bad_cast for a str where a float belongs).
  nb::class_<HostUpstream, Upstream>(m, "HostUpstream")
      .def("__init__",
           [](HostUpstream* self, nb::handle alignment) { new (self) HostUpstream(parse_size(alignment, "alignment")); },
           "alignment"_a.none() = 256);

  nb::class_<SimulatedUpstream, Upstream>(m, "SimulatedUpstream")
      .def(
          "__init__",
          [](SimulatedUpstream* self, nb::handle latency, nb::handle latency_us, nb::handle capacity,
             nb::handle alignment) {
            LatencyModel model;
            if (!latency_us.is_none()) {
              const double us = parse_duration_us(latency_us, "latency_us");
              if (us > kMaxSimulatedCallUs)
                throw InvalidArgument("latency_us " + shown(latency_us) +
                                      " is above the simulated device's bound of one second per call");
              model = LatencyModel::fixed(us);
            } else {
              if (!latency.is_none() && !nb::isinstance<nb::str>(latency))
                throw InvalidArgument("latency must be 'h200' or 'none' (or give latency_us); got " +
                                      shown(latency));
              const std::string name = latency.is_none() ? "h200" : nb::cast<std::string>(latency);
              if (name == "h200") model = LatencyModel::h200();
              else if (name == "none") model = LatencyModel::none();
              else throw InvalidArgument("latency must be 'h200' or 'none' (or give latency_us); got '" + name + "'");
            }
            const std::size_t cap = capacity.is_none() ? (std::size_t{140} << 30) : parse_size(capacity, "capacity");
            new (self) SimulatedUpstream(model, cap, parse_size(alignment, "alignment"));
          },
          "latency"_a = nb::none(), "latency_us"_a = nb::none(), "capacity"_a = nb::none(), "alignment"_a.none() = 256)
      .def("stream", &SimulatedUpstream::new_stream, "A new simulated stream (an int handle).")
      .def(
          "destroy_stream", [](SimulatedUpstream& u, nb::handle s) { u.destroy_stream(parse_stream(s)); }, "stream"_a.none(),
          "Destroy a stream, as cuStreamDestroy: its enqueued work still completes, but recording an event on it "
          "fails with CUDA_ERROR_INVALID_HANDLE from now on.")
      .def_prop_ro("events_recorded", &SimulatedUpstream::events_recorded, "Events recorded so far (all streams).")
      .def(
          "enqueue",
          [](SimulatedUpstream& u, nb::handle s, nb::handle us) {
            u.enqueue(parse_stream(s), parse_duration_us(us, "work_us"));
          },
          "stream"_a.none(), "work_us"_a.none(), "Enqueue work_us of device work on stream.")
      .def(
          "advance", [](SimulatedUpstream& u, nb::handle us) { u.advance(parse_duration_us(us, "us")); }, "us"_a.none(),
          "Move the virtual clock forward.")
      .def_prop_ro("now", &SimulatedUpstream::now, "The virtual clock, in microseconds.")
      .def(
          "busy_until", [](SimulatedUpstream& u, nb::handle s) { return u.stream_busy_until(parse_stream(s)); },
          "stream"_a.none())
      .def_prop_ro("live_events", &SimulatedUpstream::live_events)
      .def(
          "begin_capture",
          [](SimulatedUpstream& u, nb::handle s, nb::handle mode) { u.begin_capture(parse_stream(s), capture_mode(mode)); }, "stream"_a.none(),
          "mode"_a.none() = 0,
          "Start capturing stream (mode 0 global, 1 thread-local, 2 relaxed): CUDA's capture rules are "
          "checked from now on (capture_violations).")
      .def(
          "end_capture", [](SimulatedUpstream& u, nb::handle s) { return u.end_capture(parse_stream(s)); }, "stream"_a.none(),
          "Stop capturing stream; True when the capture stayed valid.")
      .def(
          "is_capturing", [](SimulatedUpstream& u, nb::handle s) { return u.stream_capturing(parse_stream(s)); },
          "stream"_a.none())
      .def_prop_ro("capture_violations", &SimulatedUpstream::capture_violations,
                   "Calls that would have invalidated an active capture on a GPU.")
      .def_prop_ro("last_capture_violation", &SimulatedUpstream::last_capture_violation)
      .def("set_capture_mode", [](SimulatedUpstream& u, nb::handle mode) { return u.exchange_capture_mode(capture_mode(mode)); },
           "mode"_a.none(), "Set this thread's capture mode (returns the previous one), like cudaThreadExchangeStreamCaptureMode.")
      .def_prop_ro("captures_underway", [](SimulatedUpstream& u) { return u.captures_underway(); })
      .def_prop_ro("capacity", &SimulatedUpstream::capacity)
      .def("mapped_bytes", &SimulatedUpstream::mapped_bytes, "Physical bytes mapped now (all reserved ranges).")
      .def("aliased_bytes", &SimulatedUpstream::aliased_bytes,
           "Bytes mapped a second time (aliases) now; they take no memory.")
      .def("physical", &SimulatedUpstream::physical, "address"_a,
           "The memory behind the byte at ``address``: that byte's address in its first mapping (itself in a mapped "
           "piece, the source piece's byte through an alias); 0 when nothing maps it.")
      .def_prop_ro("latency_model", [](const SimulatedUpstream& u) {
        const auto& m = u.model();
        return dict_of("alloc_base_us", m.alloc_base_us, "alloc_per_mib_us", m.alloc_per_mib_us, "free_base_us",
                       m.free_base_us, "free_per_mib_us", m.free_per_mib_us);
      });
}

}  // namespace poolkeeper::py
