// _core.CupyAllocator: poolkeeper as CuPy's allocator through CuPy's C function-pointer interface
// (cupy.cuda.memory.CFunctionAllocator), so that no Python runs for an allocation on the default
// stream: CuPy calls malloc(param, size, device) and, from the destructor of its memory object,
// free(param, ptr, device).
//
// Why: as a Python callable returning MemoryPointer(UnownedMemory(ptr, size, owner, device)),
// cupy.empty plus drop cost more than with CuPy's own pool (H200: 4.3-4.7 us against 3.7-3.9 us;
// benchmarks/results/framework_overhead_h200.txt), although the pool pair under it costs ~0.2 us:
// the Python frame, the device and stream lookups through Python, and three Python objects per
// allocation ate the difference.
//
// Fast path (no Python object made, no Python frame): the current CuPy stream is the legacy
// default stream (handle 0), the device's pool is known here, and no graph-capture scope is open
// on that device. The block is allocated and freed on stream 0, as CuPy's own pool orders it.
// The current stream comes from CuPy's C getter (a capsule of cupy_backends.cuda.stream) when
// the Python side found one, else from a Python callable.
//
// Slow path (everything else: another stream, per-thread default streams, graph capture, a device
// whose pool is not made yet): the Python side's slow(size, device) allocates and returns
// (ptr, owner); the owner (a native BufferCore ordered on the allocating stream, holding that
// stream alive, or a graph block) is kept here until CuPy frees the pointer, and dropping it
// frees the block. So a block freed on stream s is never reused by another stream before s's
// work is done, exactly as before this fast path existed.
//
// Threads: CuPy calls both functions with the GIL held, and every member of State is read and
// written with the GIL held. The GIL is released only around a blocking pool call, with nothing
// of State held across it (a pool pointer is copied out first; pools are never unregistered).
//
// Lifetime: CuPy's memory objects keep only the raw param, not the allocator object, so State
// outlives the Python object while CuPy holds blocks from it (live > 0), and goes with the last
// free after the object is gone. It keeps its pools alive (strong references) until then.
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "bindings.hpp"
#include "poolkeeper/pools/graph_pools.hpp"

namespace poolkeeper::py {

namespace {

using StreamGetter = std::intptr_t (*)();

struct State {
  struct Device {
    Pool* pool = nullptr;
    PyObject* pool_obj = nullptr;  // strong
    GraphPools* graphs = nullptr;
    PyObject* graphs_obj = nullptr;  // strong
  };
  std::vector<Device> devices;           // index: CuPy device id
  StreamGetter stream_fn = nullptr;      // CuPy's C getter of the current stream, or
  PyObject* stream_py = nullptr;         // a callable returning the current stream handle
  PyObject* slow = nullptr;              // slow(size, device) -> (ptr, owner)
  PyObject* on_error = nullptr;          // on_error(exc, size): raises what CuPy users catch
  std::unordered_map<std::uintptr_t, PyObject*> owners;  // slow-path blocks -> their owner (strong)
  std::size_t live = 0;                  // blocks handed to CuPy and not freed yet (both paths)
  bool orphaned = false;                 // the Python object is gone: go with the last block
  std::uint64_t fast_allocs = 0, slow_allocs = 0, fast_frees = 0, slow_frees = 0, free_errors = 0;

  ~State() {
    for (auto& d : devices) {
      Py_XDECREF(d.pool_obj);
      Py_XDECREF(d.graphs_obj);
    }
    for (auto& [p, o] : owners) Py_DECREF(o);
    Py_XDECREF(stream_py);
    Py_XDECREF(slow);
    Py_XDECREF(on_error);
  }

  Device* device(int d) { return d >= 0 && static_cast<std::size_t>(d) < devices.size() ? &devices[d] : nullptr; }
  Device& grow(int d) {
    if (static_cast<std::size_t>(d) >= devices.size()) devices.resize(static_cast<std::size_t>(d) + 1);
    return devices[d];
  }
  void block_gone() {
    if (live) --live;
    if (orphaned && live == 0) delete this;
  }
};

// False with a Python error set when the getter failed.
bool current_stream(State* st, Stream& s) {
  if (st->stream_fn) {
    const std::intptr_t v = st->stream_fn();
    if (v == -1 && PyErr_Occurred()) return false;
    s = static_cast<Stream>(static_cast<std::uintptr_t>(v));
    return true;
  }
  PyObject* r = PyObject_CallNoArgs(st->stream_py);
  if (!r) return false;
  const unsigned long long v = PyLong_AsUnsignedLongLong(r);
  Py_DECREF(r);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
  s = static_cast<Stream>(v);
  return true;
}

// What malloc returns on failure, with the Python error set: (void*)-1, not NULL. CuPy's wrapper
// around malloc is declared `except *`, which Cython 3 compiles as "the result is -1 and an error
// is set" (older Cython: "an error is set"); NULL with an error set would pass unnoticed there and
// become a memory object at address 0 (checked against Cython 3.3's output). -1 is never a block.
void* const kFailed = reinterpret_cast<void*>(static_cast<std::intptr_t>(-1));

// The current exception (a poolkeeper error) goes through on_error, which raises the error CuPy
// users catch (cupy.cuda.memory.OutOfMemoryError chained from ours). Returns kFailed, error set.
void* raise_through_hook(State* st, std::size_t size) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (value && tb) PyException_SetTraceback(value, tb);
  if (!value) {
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyErr_SetString(PyExc_RuntimeError, "poolkeeper: allocation failed without an error");
    return kFailed;
  }
  PyObject* r = PyObject_CallFunction(st->on_error, "On", value, static_cast<Py_ssize_t>(size));
  if (r) {  // the hook must raise; returning means it did not convert
    Py_DECREF(r);
    PyErr_Restore(type, value, tb);
    return kFailed;
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return kFailed;
}

void* slow_malloc(State* st, std::size_t size, int device) {
  PyObject* r = PyObject_CallFunction(st->slow, "ni", static_cast<Py_ssize_t>(size), device);
  if (!r) return kFailed;
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
    Py_DECREF(r);
    PyErr_SetString(PyExc_TypeError, "poolkeeper CuPy slow path must return (ptr, owner)");
    return kFailed;
  }
  const unsigned long long p = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(r, 0));
  if (PyErr_Occurred()) {
    Py_DECREF(r);
    return kFailed;
  }
  PyObject* owner = PyTuple_GET_ITEM(r, 1);
  Py_INCREF(owner);
  Py_DECREF(r);
  auto [it, fresh] = st->owners.emplace(static_cast<std::uintptr_t>(p), owner);
  if (!fresh) {  // cannot happen for a live block; keep the newest owner and drop the stale one
    PyObject* old = it->second;
    it->second = owner;
    Py_DECREF(old);
  }
  ++st->live;
  ++st->slow_allocs;
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

}  // namespace

extern "C" {

// void* malloc(void* param, size_t size, int device_id): CuPy's CFunctionAllocator contract.
// kFailed ((void*)-1) with a Python error set on failure; never throws.
static void* pk_cupy_malloc(void* param, std::size_t size, int device) noexcept {
  auto* st = static_cast<State*>(param);
  Stream s = kNoStream;
  if (!current_stream(st, s)) return kFailed;
  State::Device* d = st->device(device);
  if (s == 0 && d && d->pool && !(d->graphs && d->graphs->routing())) {
    Pool* pool = d->pool;
    try {
      void* r = pool->try_allocate_nowait(size, 0);
      if (!r) {
        ReleaseGil nogil;
        r = pool->allocate(size, 0);
      }
      ++st->live;
      ++st->fast_allocs;
      return r;
    } catch (...) {
      set_python_error(std::current_exception());
      return raise_through_hook(st, size);
    }
  }
  return slow_malloc(st, size, device);
}

// void free(void* param, void* ptr, int device_id). Never raises (CuPy calls it from a destructor).
static void pk_cupy_free(void* param, void* ptr, int device) noexcept {
  auto* st = static_cast<State*>(param);
  const auto key = reinterpret_cast<std::uintptr_t>(ptr);
  if (!st->owners.empty()) {
    auto it = st->owners.find(key);
    if (it != st->owners.end()) {
      PyObject* owner = it->second;
      st->owners.erase(it);
      ++st->slow_frees;
      st->block_gone();  // may delete st: nothing of it is touched below
      Py_DECREF(owner);  // the owner returns the block, ordered on its stream
      return;
    }
  }
  State::Device* d = st->device(device);
  Pool* pool = d ? d->pool : nullptr;
  if (!pool) {
    ++st->free_errors;  // not ours: a fast block comes only from a registered pool
    return;
  }
  try {
    if (!pool->try_deallocate_nowait(ptr, 0)) {
      ReleaseGil nogil;
      pool->deallocate(ptr, 0);
    }
    ++st->fast_frees;
  } catch (...) {
    ++st->free_errors;  // the pool was closed under CuPy: its memory is gone already
  }
  st->block_gone();
}

}  // extern "C"

namespace {

struct CupyAllocator {
  State* st;

  CupyAllocator(nb::handle slow, nb::handle on_error, nb::handle stream_getter) : st(new State()) {
    st->slow = nb::borrow(slow).release().ptr();
    st->on_error = nb::borrow(on_error).release().ptr();
    if (PyCapsule_CheckExact(stream_getter.ptr())) {
      const char* name = PyCapsule_GetName(stream_getter.ptr());
      void* f = PyCapsule_GetPointer(stream_getter.ptr(), name);
      if (!f) throw nb::python_error();
      st->stream_fn = reinterpret_cast<StreamGetter>(f);
    } else {
      st->stream_py = nb::borrow(stream_getter).release().ptr();
    }
  }
  ~CupyAllocator() {
    st->orphaned = true;
    if (st->live == 0) delete st;
  }
  CupyAllocator(const CupyAllocator&) = delete;
  CupyAllocator& operator=(const CupyAllocator&) = delete;
};

}  // namespace

void bind_cupy_allocator_impl(nb::module_& m) {
  nb::class_<CupyAllocator>(
      m, "CupyAllocator",
      "poolkeeper as CuPy's allocator through cupy.cuda.memory.CFunctionAllocator(param, malloc_address, "
      "free_address, self): see poolkeeper.integrations.cupy.")
      .def(nb::init<nb::handle, nb::handle, nb::handle>(), "slow"_a, "on_error"_a, "stream_getter"_a,
           "slow(size, device) -> (ptr, owner) serves what the fast path does not; on_error(exc, size) raises the "
           "error CuPy users catch; stream_getter: a capsule of a C function `intptr_t (void)` returning the "
           "current CuPy stream, or a callable returning it.")
      .def(
          "set_pool",
          [](CupyAllocator& a, int device, nb::handle pool) {
            Pool* p = nullptr;
            if (device < 0) throw InvalidArgument("device must be >= 0");
            if (!nb::try_cast<Pool*>(pool, p) || !p) throw InvalidArgument("pool must be a poolkeeper pool", true);
            State::Device& d = a.st->grow(device);
            // The first pool stays: blocks the fast path handed out must go back to their pool.
            if (d.pool) return d.pool_obj == pool.ptr();
            d.pool_obj = nb::borrow(pool).release().ptr();
            d.pool = p;
            return true;
          },
          "device"_a, "pool"_a,
          "Serve `device` from `pool` on the fast path. The first pool given for a device stays (False when "
          "another one was given before).")
      .def(
          "set_graph_pools",
          [](CupyAllocator& a, int device, nb::handle graphs) {
            GraphPools* g = nullptr;
            if (device < 0) throw InvalidArgument("device must be >= 0");
            if (!nb::try_cast<GraphPools*>(graphs, g) || !g) throw InvalidArgument("graphs must be a GraphPools", true);
            State::Device& d = a.st->grow(device);
            Py_XDECREF(d.graphs_obj);
            d.graphs_obj = nb::borrow(graphs).release().ptr();
            d.graphs = g;
          },
          "device"_a, "graphs"_a, "While `graphs` routes (a capture scope is open), `device` takes the slow path.")
      .def_prop_ro("param", [](CupyAllocator& a) { return reinterpret_cast<std::uintptr_t>(a.st); })
      .def_prop_ro_static("malloc_address",
                          [](nb::handle) { return reinterpret_cast<std::uintptr_t>(&pk_cupy_malloc); })
      .def_prop_ro_static("free_address", [](nb::handle) { return reinterpret_cast<std::uintptr_t>(&pk_cupy_free); })
      .def_prop_ro("c_stream_getter", [](CupyAllocator& a) { return a.st->stream_fn != nullptr; },
                   "True when the current stream is read through CuPy's C getter (no Python per allocation).")
      .def(
          "stats",
          [](CupyAllocator& a) {
            nb::dict d;
            const State& s = *a.st;
            d["fast_allocs"] = s.fast_allocs;
            d["slow_allocs"] = s.slow_allocs;
            d["fast_frees"] = s.fast_frees;
            d["slow_frees"] = s.slow_frees;
            d["free_errors"] = s.free_errors;
            d["live_blocks"] = s.live;
            d["slow_live_blocks"] = s.owners.size();
            return d;
          },
          "Counters: allocations and frees per path, blocks CuPy holds now, frees that found no pool.");
}

}  // namespace poolkeeper::py

void bind_cupy_allocator(nanobind::module_& m) { poolkeeper::py::bind_cupy_allocator_impl(m); }
