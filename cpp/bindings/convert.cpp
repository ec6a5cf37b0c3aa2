// Argument conversion and result dictionaries.
#include <nanobind/stl/vector.h>

#include "bindings.hpp"

namespace poolkeeper::py {

namespace {
long long to_ll(nb::handle h, const char* what, bool& overflow) {
  overflow = false;
  if (PyBool_Check(h.ptr())) throw InvalidArgument(std::string(what) + " must be an integer, not bool");
  PyObject* idx = PyLong_Check(h.ptr()) ? (Py_INCREF(h.ptr()), h.ptr()) : PyNumber_Index(h.ptr());
  if (!idx) {
    PyErr_Clear();
    throw InvalidArgument(std::string(what) + " must be an integer; got " +
                              nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(h.ptr()))))),
                          false);
  }
  int of = 0;
  long long v = PyLong_AsLongLongAndOverflow(idx, &of);
  if (of > 0) {
    // Above 2^63: maybe still a valid unsigned pointer.
    unsigned long long u = PyLong_AsUnsignedLongLong(idx);
    Py_DECREF(idx);
    if (PyErr_Occurred()) {
      PyErr_Clear();
      overflow = true;
      return 0;
    }
    overflow = true;
    return static_cast<long long>(u);
  }
  Py_DECREF(idx);
  if (of < 0) {
    overflow = true;
    return -1;
  }
  return v;
}
}  // namespace

std::size_t parse_size(nb::handle h, const char* what) {
  bool of;
  long long v = to_ll(h, what, of);
  if (of || v < 0) {
    if (!of || v < 0)
      throw InvalidArgument(std::string(what) + " must be positive; got " + nb::cast<std::string>(nb::repr(h)));
    throw InvalidArgument(std::string(what) + " " + nb::cast<std::string>(nb::repr(h)) + " is absurd (above 2^62)");
  }
  return static_cast<std::size_t>(v);
}

std::uintptr_t parse_ptr(nb::handle h) {
  bool of;
  long long v = to_ll(h, "ptr", of);
  if (of) {
    if (v == 0 || v == -1) throw InvalidPointer("pointer " + nb::cast<std::string>(nb::repr(h)) + " is not an address", 0, "unknown");
    return static_cast<std::uintptr_t>(static_cast<unsigned long long>(v));
  }
  if (v < 0) throw InvalidPointer("pointer " + std::to_string(v) + " is negative: not an address", 0, "unknown");
  return static_cast<std::uintptr_t>(v);
}

Stream parse_stream(nb::handle h) {
  if (h.is_none()) return kNoStream;
  PyObject* o = h.ptr();
  if (PyLong_Check(o) && !PyBool_Check(o)) {
    int of = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &of);
    if (of == 0 && v >= 0) return static_cast<Stream>(v);
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (!PyErr_Occurred() && u != kNoStream) return u;
    PyErr_Clear();
    throw InvalidArgument("stream " + nb::cast<std::string>(nb::repr(h)) + " is not a stream handle", true);
  }
  if (nb::hasattr(h, "__cuda_stream__")) {
    nb::object r = h.attr("__cuda_stream__")();
    if (nb::isinstance<nb::tuple>(r) && nb::len(r) == 2) return parse_stream(nb::tuple(r)[1]);
    throw InvalidArgument("__cuda_stream__() must return (version, handle)", true);
  }
  if (nb::hasattr(h, "cuda_stream")) return parse_stream(h.attr("cuda_stream"));  // torch.cuda.Stream
  if (nb::hasattr(h, "ptr")) return parse_stream(h.attr("ptr"));                  // cupy.cuda.Stream
  throw InvalidArgument("stream must be None, an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr; got " +
                            nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(o))))),
                        true);
}

nb::object stream_to_py(Stream s) {
  if (s == kNoStream) return nb::none();
  return nb::int_(s);
}

nb::dict stats_to_dict(const PoolStats& st) {
  nb::dict d;
  d["reserved_bytes"] = st.reserved;
  d["live_bytes"] = st.live;
  d["free_bytes"] = st.free;
  d["pending_bytes"] = st.pending;
  d["overhead_bytes"] = st.overhead;
  d["thread_cached_bytes"] = st.thread_cached;
  d["thread_cached_pending_bytes"] = st.thread_cached_pending;
  d["largest_free_block"] = st.largest_free;
  d["fragmentation"] = st.free ? 1.0 - double(st.largest_free) / double(st.free) : 0.0;
  d["peak_reserved_bytes"] = st.peak_reserved;
  d["peak_live_bytes"] = st.peak_live;
  d["live_blocks"] = st.live_blocks;
  d["free_chunks"] = st.free_chunks;
  d["pending_blocks"] = st.pending_blocks;
  d["backings"] = st.backings;
  d["limit_bytes"] = st.limit ? nb::object(nb::int_(st.limit)) : nb::none();
  nb::dict ps;
  for (auto& [s, b] : st.pending_by_stream) ps[stream_to_py(s)] = nb::int_(b);
  d["pending_by_stream"] = ps;
  for (auto& [k, v] : st.extra) d[nb::str(k.c_str())] = nb::int_(v);
  return d;
}

nb::dict snapshot_to_dict(const Snapshot& snap) {
  nb::dict d;
  d["version"] = 1;
  d["pool"] = snap.pool;
  d["upstream"] = snap.upstream;
  d["alignment"] = snap.alignment;
  d["stats"] = stats_to_dict(snap.stats);
  nb::list backings;
  for (const auto& b : snap.backings) {
    nb::dict bd;
    bd["address"] = nb::int_(b.address);
    bd["size"] = b.size;
    bd["resident"] = b.resident;
    bd["oversize"] = b.oversize;
    nb::list chunks;
    for (const auto& c : b.chunks) {
      nb::dict cd;
      cd["offset"] = c.offset;
      cd["size"] = c.size;
      cd["state"] = chunk_state_name(c.state);
      cd["requested"] = c.state == ChunkState::Live ? nb::object(nb::int_(c.requested)) : nb::none();
      cd["alloc_stream"] = stream_to_py(c.alloc_stream);
      cd["last_stream"] = stream_to_py(c.last_stream);
      cd["event"] = c.event ? nb::object(nb::int_(c.event)) : nb::none();
      nb::list w;
      for (Stream s : c.waits_on) w.append(stream_to_py(s));
      cd["waits_on"] = w;
      chunks.append(cd);
    }
    bd["chunks"] = chunks;
    backings.append(bd);
  }
  d["backings"] = backings;
  return d;
}

nb::dict upstream_counters_to_dict(const UpstreamCounters& c) {
  nb::dict d;
  d["allocations"] = c.allocations;
  d["deallocations"] = c.deallocations;
  d["bytes_allocated"] = c.bytes_allocated;
  d["bytes_deallocated"] = c.bytes_deallocated;
  d["outstanding_bytes"] = c.outstanding_bytes;
  d["peak_outstanding_bytes"] = c.peak_outstanding_bytes;
  d["alloc_ns"] = c.alloc_ns;
  d["dealloc_ns"] = c.dealloc_ns;
  d["failed_allocations"] = c.failed_allocations;
  d["failed_deallocations"] = c.failed_deallocations;
  d["maps"] = c.maps;
  d["unmaps"] = c.unmaps;
  d["reserves"] = c.reserves;
  d["unreserves"] = c.unreserves;
  return d;
}

}  // namespace poolkeeper::py
