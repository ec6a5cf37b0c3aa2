// Shared helpers of the nanobind module poolkeeper._core.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>

#include "poolkeeper/core/pool.hpp"

namespace poolkeeper::py {
namespace nb = nanobind;
using namespace nb::literals;

// Python argument conversion with typed poolkeeper errors (never a bare TypeError/OverflowError).
std::size_t parse_size(nb::handle h, const char* what = "nbytes");
// After a Python call made while converting an argument failed: clears the error when it is bad
// input (an Exception other than MemoryError), which the caller then reports as its own error; a
// KeyboardInterrupt, SystemExit or MemoryError raised in the user's __index__, __float__, __iter__
// or __repr__ is theirs (or the interpreter's) and is thrown on unchanged as nb::python_error.
void clear_bad_input_error();
std::uintptr_t parse_ptr(nb::handle h);
// An argument as an error message shows it: its repr, at most 120 bytes (cut between UTF-8
// characters); an int too long to print as "an int of N bits" (str() of an int over 4,300 digits
// raises ValueError, and a message must never raise); "a <type> object" where repr raises. Never throws a Python error
// other than KeyboardInterrupt/SystemExit/MemoryError (see clear_bad_input_error).
std::string shown(nb::handle h);
// An integer in [0, 2^64) (an event id, a capture mode): InvalidArgument naming `what` otherwise.
std::uint64_t parse_u64(nb::handle h, const char* what);
// A device index of the C ABI's registry, -1 (the host) to MAX_DEVICES - 1: InvalidArgument otherwise.
int parse_device(nb::handle h);
// A duration in microseconds: an int or float, finite and >= 0 (InvalidArgument otherwise).
double parse_duration_us(nb::handle h, const char* what);
// None -> kNoStream; int; objects with __cuda_stream__ (CUDA stream protocol), .cuda_stream
// (torch.cuda.Stream) or .ptr (cupy.cuda.Stream).
Stream parse_stream(nb::handle h);
nb::object stream_to_py(Stream s);
nb::dict stats_to_dict(const PoolStats& st);
nb::dict snapshot_to_dict(const Snapshot& snap);
nb::dict upstream_counters_to_dict(const UpstreamCounters& c);

// A dict from alternating keys and values: dict_of("chunks", c.chunks, "bytes", c.bytes). How the
// bindings report a struct: one call naming its fields, not one assignment per field.
inline void put_items(nb::dict&) {}
template <class V, class... Rest>
void put_items(nb::dict& d, const char* key, const V& value, const Rest&... rest) {
  d[key] = value;
  put_items(d, rest...);
}
template <class... Items>
nb::dict dict_of(const Items&... items) {
  nb::dict d;
  put_items(d, items...);
  return d;
}

// Releases the GIL for a blocking core call; takes it back at scope exit -- except on a
// non-exiting thread once the interpreter is exiting, which then waits forever instead of being
// unwound through this destructor (see nogil.cpp). Use it, not nb::gil_scoped_release, and hold
// no lock of your own across its scope's end.
class ReleaseGil {
 public:
  ReleaseGil();
  ~ReleaseGil();
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_;
};
void install_exit_guard(nb::module_& m);

// DLPack exports whose deleter has not run yet (dlpack.cpp): at the very end of the exit, those a
// consumer still holds (nanobind's leak report then leaves their buffers out, nogil.cpp).
long dlpack_exports_left();

// In a forked child of a process that was exiting: Python capture filters keep their callables
// again (graph_pools.cpp).
void forget_filters_undone_in_child();

// The GIL for Python work on a thread that may not hold it (a consumer's DLPack deleter, a
// capture filter asked by a C ABI call): taken unless the interpreter is exiting on another thread
// or is gone -- asking then would end this thread by a forced unwind, std::terminate through any
// nothrow frame -- or this is a forked child whose fork did not go through os.fork() (a native
// thread's: the GIL may belong to a thread the fork left behind), and then false: the caller leaves Python alone (what it would have released
// goes with the process, and nanobind's leak report is switched off at the end). The exit waits
// for guarded work begun before it (nogil.cpp).
class GilFromAnyThread {
 public:
  GilFromAnyThread();
  ~GilFromAnyThread();
  GilFromAnyThread(const GilFromAnyThread&) = delete;
  GilFromAnyThread& operator=(const GilFromAnyThread&) = delete;
  explicit operator bool() const { return held_; }

 private:
  bool held_ = false;
  PyGILState_STATE state_{};
};

// A pool made in Python, as the C ABI's registries keep it: their last copy may go on any thread
// (a C ABI free that retires a GraphPools), and dropping it takes the GIL to release the Python
// object. Once the interpreter is exiting a thread other than the exiting one leaves the object
// to the process's end instead of asking for the GIL (see nogil.cpp). A pool without a Python
// object, or none, comes back as it is. Call with the GIL held.
std::shared_ptr<Pool> exit_safe(std::shared_ptr<Pool> pool);

// f(pool) without the GIL, after refusing a pool inherited through fork(): how a binding calls a
// pool method that may wait for the pool's lock or the device. Returns f's (C++) result.
template <class P, class F>
auto pool_call_nogil(P& pool, F f) {
  pool.check_not_forked();
  ReleaseGil nogil;
  return f(pool);
}

// The address an allocation made without the GIL returns, called with the GIL taken back; `give_back(r)`
// frees r. A signal that came during the call (Ctrl-C while the allocation waited for the upstream
// or a lock) has its handler run here: the interpreter would run it as the call returns, and the
// KeyboardInterrupt would drop the address unseen -- a block no one can free, a pool that can
// never close. When a handler raises, r goes back first (without the GIL) and the error goes up;
// a refused give-back leaves r live, as it was. A signal after this check is the caller's, as with
// any Python call.
template <class GiveBack>
std::uintptr_t keep_unless_interrupted(void* r, GiveBack give_back) {
  if (PyErr_CheckSignals() == 0) return reinterpret_cast<std::uintptr_t>(r);
  nb::python_error raised;  // taken out of the thread state before the GIL goes
  try {
    ReleaseGil nogil;
    give_back(r);
  } catch (...) {
  }
  throw raised;
}

// Pool.allocate/deallocate: the non-blocking attempt under the GIL, then the blocking call
// without it (pools.cpp binds them through nanobind; fast_methods.cpp as raw descriptors).
inline std::uintptr_t py_allocate(Pool& p, nb::handle nbytes, nb::handle stream) {
  p.check_not_forked();
  const std::size_t n = parse_size(nbytes);
  const Stream s = parse_stream(stream);
  if (void* r = p.try_allocate_nowait(n, s)) return reinterpret_cast<std::uintptr_t>(r);
  void* r;
  {
    ReleaseGil nogil;
    r = p.allocate(n, s);
  }
  return keep_unless_interrupted(r, [&](void* q) { p.deallocate(q, s); });
}
inline void py_deallocate(Pool& p, nb::handle ptr, nb::handle stream) {
  p.check_not_forked();
  void* a = reinterpret_cast<void*>(parse_ptr(ptr));
  const Stream s = parse_stream(stream);
  if (p.try_deallocate_nowait(a, s)) return;
  ReleaseGil nogil;
  p.deallocate(a, s);
}

// Set the Python error for a caught C++ exception (our typed errors -> poolkeeper.errors).
void set_python_error(const std::exception_ptr& p);

// Sets aside the exception being raised, if any, and puts it back at scope exit: for release
// callbacks (a view or capsule let go while an exception unwinds), which must neither lose it nor
// raise their own. Needs the GIL for its whole life.
class KeepPendingError {
 public:
#if PY_VERSION_HEX >= 0x030C0000
  KeepPendingError() : pending_(PyErr_GetRaisedException()) {}
  ~KeepPendingError() { PyErr_SetRaisedException(pending_); }
#else
  KeepPendingError() { PyErr_Fetch(&type_, &pending_, &tb_); }
  ~KeepPendingError() { PyErr_Restore(type_, pending_, tb_); }
#endif
  KeepPendingError(const KeepPendingError&) = delete;
  KeepPendingError& operator=(const KeepPendingError&) = delete;

 private:
  PyObject* pending_ = nullptr;
#if PY_VERSION_HEX < 0x030C0000
  PyObject *type_ = nullptr, *tb_ = nullptr;
#endif
};

// The buffer protocol's slots (buffer_protocol.cpp), for any class whose Python side implements
// _export_buffer_(writable, token) -> (address, nbytes, readonly) and an idempotent
// _release_buffer_(token).
int exporter_getbuffer(PyObject* self, Py_buffer* view, int flags);
void exporter_releasebuffer(PyObject* self, Py_buffer* view);

void bind_errors(nb::module_& m);
void bind_upstreams(nb::module_& m);
void bind_pools(nb::module_& m);
// Replace Pool.allocate/deallocate with raw vectorcall descriptors (fast_methods.cpp).
void install_fast_methods(nb::handle pool_type);
void bind_cuda(nb::module_& m);
void bind_capi(nb::module_& m);
void bind_capi_threads(nb::module_& m);  // capi_threads.cpp
void bind_graph_pools(nb::module_& m);

}  // namespace poolkeeper::py
