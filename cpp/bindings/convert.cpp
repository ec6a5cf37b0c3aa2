// Argument conversion and result dictionaries.
#include <nanobind/stl/vector.h>

#include <cmath>

#include "bindings.hpp"
#include "poolkeeper/core/registry.hpp"

namespace poolkeeper::py {

void clear_bad_input_error() {
  if (!PyErr_Occurred()) return;
  if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError)) throw nb::python_error();
  PyErr_Clear();
}

namespace {
// Bits of a Python int's magnitude (int.bit_length()); 0 when asking fails.
std::size_t int_bits(PyObject* o) {
  PyObject* r = PyObject_CallMethod(o, "bit_length", nullptr);
  std::size_t bits = 0;
  if (r) {
    bits = PyLong_AsSize_t(r);
    Py_DECREF(r);
    if (bits == static_cast<std::size_t>(-1)) bits = 0;
  }
  clear_bad_input_error();
  return bits;
}
}  // namespace

std::string shown(nb::handle h) {
  PyObject* o = h.ptr();
  const std::string type = Py_TYPE(o)->tp_name;
  if (PyLong_Check(o)) {
    const std::size_t bits = int_bits(o);
    if (bits > 256) return "an int of " + std::to_string(bits) + " bits";
  }
  std::string out = "a " + type + " object";
  if (PyObject* rep = PyObject_Repr(o)) {
    Py_ssize_t n = 0;
    if (const char* u = PyUnicode_AsUTF8AndSize(rep, &n)) out.assign(u, static_cast<std::size_t>(n));
    Py_DECREF(rep);
  }
  clear_bad_input_error();
  if (out.size() > 120) {
    // Cut at a character's first byte: half a UTF-8 character made the message undecodable, and
    // the error reached the caller as "an error occurred and could not be converted".
    std::size_t cut = 117;
    while (cut && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) --cut;
    out = out.substr(0, cut) + "...";
  }
  return out;
}

namespace {
// overflow: 0 when the value fits a long long; +1 at or above 2^63 (the unsigned bits when below
// 2^64, else 0); -1 below -2^63.
long long to_ll(nb::handle h, const char* what, int& overflow) {
  overflow = 0;
  if (PyBool_Check(h.ptr())) throw InvalidArgument(std::string(what) + " must be an integer, not bool");
  PyObject* idx = PyLong_Check(h.ptr()) ? (Py_INCREF(h.ptr()), h.ptr()) : PyNumber_Index(h.ptr());
  if (!idx) {
    clear_bad_input_error();  // only "not an integer" is bad input
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
    overflow = 1;
    if (PyErr_Occurred()) {
      clear_bad_input_error();
      return 0;
    }
    return static_cast<long long>(u);
  }
  Py_DECREF(idx);
  if (of < 0) {
    overflow = -1;
    return -1;
  }
  return v;
}
}  // namespace

std::size_t parse_size(nb::handle h, const char* what) {
  int of;
  long long v = to_ll(h, what, of);
  if (of || v < 0) {
    if (of < 0 || (of == 0 && v < 0))
      throw InvalidArgument(std::string(what) + " must be positive; got " + shown(h));
    throw InvalidArgument(std::string(what) + " " + shown(h) + " is absurd (above 2^62)");
  }
  return static_cast<std::size_t>(v);
}

double parse_duration_us(nb::handle h, const char* what) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o) || !(PyFloat_Check(o) || PyLong_Check(o)))
    throw InvalidArgument(std::string(what) + " must be a number of microseconds; got " + shown(h));
  const double d = PyFloat_AsDouble(o);
  if (PyErr_Occurred()) {
    clear_bad_input_error();
    throw InvalidArgument(std::string(what) + " " + shown(h) + " is out of range");
  }
  // NaN compares false with everything, so a NaN duration never completes: refuse it (and inf)
  // here rather than wait forever on it later.
  if (!std::isfinite(d) || d < 0)
    throw InvalidArgument(std::string(what) + " must be a finite number >= 0; got " + shown(h));
  return d;
}

std::uint64_t parse_u64(nb::handle h, const char* what) {
  int of;
  const long long v = to_ll(h, what, of);
  if (of < 0 || (of == 0 && v < 0) || (of > 0 && v == 0))  // below 0, or at 2^64 and above
    throw InvalidArgument(std::string(what) + " " + shown(h) + " is not in [0, 2^64)");
  return static_cast<std::uint64_t>(v);
}

int parse_device(nb::handle h) {
  int of;
  const long long v = to_ll(h, "device", of);
  if (of || v < -1 || v >= registry::kMaxDevices)
    throw InvalidArgument("device index " + shown(h) + " out of range [-1, " + std::to_string(registry::kMaxDevices) + ")");
  return static_cast<int>(v);
}

std::uintptr_t parse_ptr(nb::handle h) {
  int of;
  long long v = to_ll(h, "ptr", of);
  if (of) {
    if (of < 0 || v == 0 || v == -1) throw InvalidPointer("pointer " + shown(h) + " is not an address", 0, "unknown");
    return static_cast<std::uintptr_t>(static_cast<unsigned long long>(v));
  }
  if (v < 0) throw InvalidPointer("pointer " + std::to_string(v) + " is negative: not an address", 0, "unknown");
  return static_cast<std::uintptr_t>(v);
}

namespace {
// Stream objects wrap a handle at most a few levels deep (a framework stream around a driver
// stream); an object that answers with itself, or with an endless chain, must be refused rather
// than followed until the C stack overflows.
constexpr int kMaxStreamNesting = 8;

// A wrapper whose handle attribute (or __cuda_stream__()) raises is not a stream:
// InvalidStreamError, with what it raised as the cause. KeyboardInterrupt and other errors that
// are not an Exception pass through unchanged.
[[noreturn]] void raise_not_a_stream(nb::handle h, nb::python_error& e) {
  if (!e.matches(PyExc_Exception)) throw e;
  const std::string what = shown(e.value());
  const std::string tp = nb::cast<std::string>(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(h.ptr()))).attr("__name__"));
  nb::raise_from(e, nb::module_::import_("poolkeeper.errors").attr("InvalidStreamError"),
                 "reading the stream handle of %s raised %s", tp.c_str(), what.c_str());
}

// Attribute `name` of a stream object, or a null object where it has none (AttributeError).
nb::object stream_attr(nb::handle h, const char* name) {
  if (PyObject* r = PyObject_GetAttrString(h.ptr(), name)) return nb::steal(r);
  if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
    PyErr_Clear();
    return nb::object();
  }
  nb::python_error e;
  raise_not_a_stream(h, e);
}

Stream parse_stream_at(nb::handle h, int depth) {
  if (h.is_none()) {
    if (depth == 0) return kNoStream;
    // None inside a stream object is not "no stream": the object claims to be a stream but has no
    // handle (a destroyed or not yet created stream).
    throw InvalidArgument("stream object gave None as its handle: not a stream", true);
  }
  PyObject* o = h.ptr();
  if (PyLong_Check(o) && !PyBool_Check(o)) {
    int of = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &of);
    if (of == 0 && v >= 0) return static_cast<Stream>(v);
    unsigned long long u = PyLong_AsUnsignedLongLong(o);
    if (!PyErr_Occurred() && u != kNoStream) return u;
    clear_bad_input_error();
    throw InvalidArgument("stream " + shown(h) + " is not a stream handle", true);
  }
  if (depth >= kMaxStreamNesting)
    throw InvalidArgument("stream object nests more than " + std::to_string(kMaxStreamNesting) +
                              " levels deep (does .cuda_stream, .ptr or __cuda_stream__() return the object itself?)",
                          true);
  if (nb::object proto = stream_attr(h, "__cuda_stream__")) {
    nb::object r;
    try {
      r = proto();
    } catch (nb::python_error& e) {
      raise_not_a_stream(h, e);
    }
    if (!nb::isinstance<nb::tuple>(r) || nb::len(r) != 2)
      throw InvalidArgument("__cuda_stream__() must return (version, handle)", true);
    // Version 0 is the protocol's only version: (0, handle). A later version may give the tuple
    // another meaning, so it is refused rather than read as version 0 (found by hostile probing).
    nb::handle ver = nb::tuple(r)[0];
    bool zero = false;  // any integer equal to 0 (an int subclass, an IntEnum, numpy.int64(0))
    if (PyObject* i = PyIndex_Check(ver.ptr()) ? PyNumber_Index(ver.ptr()) : nullptr) {
      int overflow = 0;
      zero = PyLong_AsLongLongAndOverflow(i, &overflow) == 0 && !overflow && !PyErr_Occurred();
      Py_DECREF(i);
    }
    clear_bad_input_error();
    if (!zero) {
      std::string shown = "of type " + nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(ver.ptr())))));
      if (PyObject* rep = PyObject_Repr(ver.ptr())) {  // a repr that raises must not escape
        if (const char* u = PyUnicode_AsUTF8(rep)) shown = u;
        Py_DECREF(rep);
      }
      clear_bad_input_error();
      throw InvalidArgument("__cuda_stream__() returned protocol version " + shown +
                                "; poolkeeper reads version 0: (0, handle)",
                            true);
    }
    return parse_stream_at(nb::tuple(r)[1], depth + 1);
  }
  if (nb::object v = stream_attr(h, "cuda_stream")) return parse_stream_at(v, depth + 1);  // torch.cuda.Stream
  if (nb::object v = stream_attr(h, "ptr")) return parse_stream_at(v, depth + 1);          // cupy.cuda.Stream
  throw InvalidArgument("stream must be None, an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr; got " +
                            nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(o))))),
                        true);
}
}  // namespace

Stream parse_stream(nb::handle h) { return parse_stream_at(h, 0); }

nb::object stream_to_py(Stream s) {
  if (s == kNoStream) return nb::none();
  return nb::int_(s);
}

nb::dict stats_to_dict(const PoolStats& st) {
  nb::dict d = dict_of(
      "reserved_bytes", st.reserved, "live_bytes", st.live, "free_bytes", st.free, "pending_bytes", st.pending,
      "overhead_bytes", st.overhead, "thread_cached_bytes", st.thread_cached, "thread_cached_pending_bytes",
      st.thread_cached_pending, "largest_free_block", st.largest_free, "fragmentation",
      st.free ? 1.0 - double(st.largest_free) / double(st.free) : 0.0, "peak_reserved_bytes", st.peak_reserved,
      "peak_live_bytes", st.peak_live, "live_blocks", st.live_blocks, "free_chunks", st.free_chunks, "pending_blocks",
      st.pending_blocks, "backings", st.backings, "limit_bytes", st.limit ? nb::object(nb::int_(st.limit)) : nb::none());
  nb::dict ps;
  for (auto& [s, b] : st.pending_by_stream) ps[stream_to_py(s)] = nb::int_(b);
  d["pending_by_stream"] = ps;
  for (auto& [k, v] : st.extra) d[nb::str(k.c_str())] = nb::int_(v);
  return d;
}

nb::dict snapshot_to_dict(const Snapshot& snap) {
  nb::list backings;
  for (const auto& b : snap.backings) {
    nb::list chunks;
    for (const auto& c : b.chunks) {
      nb::list w;
      for (Stream s : c.waits_on) w.append(stream_to_py(s));
      chunks.append(dict_of(
          "offset", c.offset, "size", c.size, "state", chunk_state_name(c.state), "requested",
          c.state == ChunkState::Live ? nb::object(nb::int_(c.requested)) : nb::none(), "alloc_stream",
          stream_to_py(c.alloc_stream), "last_stream", stream_to_py(c.last_stream), "event",
          c.event ? nb::object(nb::int_(c.event)) : nb::none(), "waits_on", w));
    }
    backings.append(dict_of("address", nb::int_(b.address), "size", b.size, "resident", b.resident, "oversize",
                            b.oversize, "chunks", chunks));
  }
  return dict_of("version", 1, "pool", snap.pool, "upstream", snap.upstream, "alignment", snap.alignment, "stats",
                 stats_to_dict(snap.stats), "backings", backings);
}

nb::dict upstream_counters_to_dict(const UpstreamCounters& c) {
  return dict_of("allocations", c.allocations, "deallocations", c.deallocations, "bytes_allocated", c.bytes_allocated,
                 "bytes_deallocated", c.bytes_deallocated, "outstanding_bytes", c.outstanding_bytes,
                 "peak_outstanding_bytes", c.peak_outstanding_bytes, "alloc_ns", c.alloc_ns, "dealloc_ns",
                 c.dealloc_ns, "failed_allocations", c.failed_allocations, "failed_deallocations",
                 c.failed_deallocations, "maps", c.maps, "unmaps", c.unmaps, "reserves", c.reserves, "unreserves",
                 c.unreserves, "aliases", c.aliases, "unaliases", c.unaliases);
}

}  // namespace poolkeeper::py
