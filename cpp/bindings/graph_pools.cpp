// poolkeeper._core.GraphPools (graph_pools.hpp) and the per-device graph registry, for Python
// callers (the CuPy integration, tests) and for reading the state PyTorch's hooks build.
#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>

#include <pthread.h>

#include <atomic>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "poolkeeper/pools/graph_registry.hpp"

namespace poolkeeper::py {

namespace {
GraphPoolId parse_id(nb::handle h) {
  try {
    auto t = nb::cast<std::pair<std::uint64_t, std::uint64_t>>(h);
    return {t.first, t.second};
  } catch (const std::exception&) {
    throw InvalidArgument("a graph pool id is a pair of non-negative ints, e.g. (1, 0)");
  }
}

// A filter's KeyboardInterrupt or SystemExit, carried out of the filter inside
// CaptureFilterAbort. Not the python_error itself: dropping that takes the GIL wherever the last
// copy goes, and the C ABI drops it on a framework's thread, with no guard, possibly after the
// exit has begun (std::terminate from CPython's forced unwind). This holds the exception object
// by a reference that is dropped under GilFromAnyThread (or left to the process's end).
struct HeldPyException : std::exception {
  std::shared_ptr<PyObject> value;
  explicit HeldPyException(const nb::python_error& e)  // under the GIL
      : value(nb::borrow(e.value()).release().ptr(), [](PyObject* v) noexcept {
          if (GilFromAnyThread gil; gil) Py_DECREF(v);  // else: the interpreter is exiting or gone
        }) {}
  const char* what() const noexcept override { return "a capture filter raised KeyboardInterrupt or SystemExit"; }
  // Makes it Python's current exception again, traceback included (under the GIL).
  void restore() const {
    PyObject* v = value.get();
    Py_INCREF(Py_TYPE(v));
    Py_INCREF(v);
    PyErr_Restore(reinterpret_cast<PyObject*>(Py_TYPE(v)), v, PyException_GetTraceback(v));
  }
};

// A Python callable as a capture filter. GraphPools asks and destroys filters with its lock let
// go, possibly on a thread without the GIL (graph_pools.hpp), so the reference is taken and
// dropped under the GIL here. KeyboardInterrupt and SystemExit raised in the filter stop the
// allocation (CaptureFilterAbort) instead of being counted as a filter that could not answer.
//
// The graph registry's GraphPools outlive the interpreter (a scope open over a pool the factory
// made in C++), and with them their filters: a callable they kept would keep what it reaches --
// its module's globals -- from ever being cleared (nanobind's leak report for every object
// there). So every live filter is listed, and the exit hook drops their callables
// (forget_python_filters); a filter without one answers "not mine".
struct PyCaptureFilter;
// Immortal (filters may be destroyed during exit()); pointers, so that a forked child whose fork
// caught the lock held by a thread that did not survive it can start afresh (after_fork_in_child).
std::mutex* g_filters_mu = new std::mutex;
std::set<const PyCaptureFilter*>* g_filters = new std::set<const PyCaptureFilter*>;  // guarded by *g_filters_mu
// Set by the exit hook (under *g_filters_mu): a filter made later keeps no callable, and no filter
// asks for the GIL any more (after finalization that would touch nanobind's freed internals).
std::atomic<bool> g_filters_forgotten{false};

struct PyCaptureFilter {
  mutable PyObject* fn = nullptr;  // written under *g_filters_mu (and the GIL, but for the destructor)
  explicit PyCaptureFilter(nb::handle h) {  // under the GIL
    std::lock_guard<std::mutex> g(*g_filters_mu);
    if (g_filters_forgotten.load(std::memory_order_relaxed)) return;  // answers "not mine"
    fn = h.inc_ref().ptr();
    g_filters->insert(this);
  }
  PyCaptureFilter(const PyCaptureFilter&) = delete;
  PyCaptureFilter& operator=(const PyCaptureFilter&) = delete;
  ~PyCaptureFilter() {
    PyObject* mine;
    {
      std::lock_guard<std::mutex> g(*g_filters_mu);  // never with the GIL asked for under it
      g_filters->erase(this);
      mine = std::exchange(fn, nullptr);
    }
    if (!mine) return;
    if (GilFromAnyThread gil; gil) Py_DECREF(mine);  // else: the interpreter is exiting or gone
  }
  bool operator()(Stream s) const {
    if (g_filters_forgotten.load(std::memory_order_acquire)) return false;
    GilFromAnyThread gil;
    if (!gil || !fn) return false;  // the interpreter is exiting: the device pool serves (the process is ending)
    try {
      const nb::object f = nb::borrow(fn);  // ours while it runs, whatever the exit hook drops
      return nb::cast<bool>(f(stream_to_py(s)));
    } catch (nb::python_error& e) {
      // Not the python_error itself: destroying it takes the GIL, and it would be destroyed
      // after this guard let the thread go (at exit, a forced unwind: std::terminate).
      if (e.matches(PyExc_Exception)) throw InvalidArgument(std::string("capture filter raised: ") + e.what());
      const bool interrupt = e.matches(PyExc_KeyboardInterrupt);
      throw CaptureFilterAbort(std::make_exception_ptr(HeldPyException(e)),
                               interrupt ? +[] { PyErr_SetInterrupt(); } : nullptr);
    }
  }
};

// The exit hook (under the GIL): every filter's callable dropped, and filters made from now on
// keep none. Returns how many were dropped.
std::size_t forget_python_filters() {
  std::vector<PyObject*> drop;
  {
    std::lock_guard<std::mutex> g(*g_filters_mu);
    g_filters_forgotten.store(true, std::memory_order_release);
    for (const PyCaptureFilter* f : *g_filters)
      if (f->fn) drop.push_back(std::exchange(f->fn, nullptr));
    g_filters->clear();
  }
  for (PyObject* o : drop) Py_DECREF(o);  // may run Python (and make or end filters): not under the mutex
  return drop.size();
}

}  // namespace

void forget_filters_undone_in_child() { g_filters_forgotten.store(false, std::memory_order_seq_cst); }

namespace {
void filters_after_fork_in_child() {
  if (g_filters_mu->try_lock()) {
    g_filters_mu->unlock();
    return;
  }
  // Held by a thread the fork left behind, maybe half-way through changing the set: both are
  // left as they are (never touched again) and the child starts afresh; the filters listed there
  // are not forgotten at the child's exit (at worst a leak report).
  g_filters_mu = new std::mutex;
  g_filters = new std::set<const PyCaptureFilter*>;
}

// A stream handle (int, stream object) or a callable taking the int handle and returning bool.
CaptureFilter parse_filter(nb::handle h) {
  if (PyCallable_Check(h.ptr()) && !nb::hasattr(h, "cuda_stream") && !nb::hasattr(h, "ptr") &&
      !nb::hasattr(h, "__cuda_stream__")) {
    auto f = std::make_shared<const PyCaptureFilter>(h);
    return [f](Stream s) { return (*f)(s); };
  }
  const Stream want = parse_stream(h);
  return [want](Stream s) { return s == want; };
}

// Runs a GraphPools call with the GIL let go: its lock may be held by a thread running a Python
// filter, which needs the GIL. A filter's KeyboardInterrupt/SystemExit comes back out as itself.
template <class F>
auto without_gil(F&& f) {
  try {
    ReleaseGil nogil;
    return f();
  } catch (const CaptureFilterAbort& a) {  // the GIL is held again here
    try {
      std::rethrow_exception(a.original);
    } catch (const HeldPyException& held) {
      held.restore();
      throw nb::python_error();
    }
  }
}

nb::dict info_to_dict(const GraphPoolInfo& i) {
  return dict_of("id", nb::make_tuple(i.id.first, i.id.second), "uses", i.uses, "open_scopes", i.open_scopes,
                 "released", i.released, "live_blocks", i.live_blocks, "stats", stats_to_dict(i.stats));
}
}  // namespace

void bind_graph_pools(nb::module_& m) {
  nb::class_<GraphPools>(m, "GraphPools",
                         "CUDA-graph private pools over one device pool (docs/integrations.md, 'CUDA graphs').")
      .def("__init__",
           [](GraphPools* self, nb::handle pool) {
             std::shared_ptr<Pool> p;
             if (!nb::try_cast<std::shared_ptr<Pool>>(pool, p) || !p)
               throw InvalidArgument("GraphPools: pool must be a poolkeeper pool; got " + shown(pool));
             new (self) GraphPools(exit_safe(std::move(p)));
           },
           "pool"_a.none())
      .def("begin",
           [](GraphPools& g, nb::handle id, nb::handle filter) {
             const GraphPoolId gid = parse_id(id);
             CaptureFilter f = parse_filter(filter);
             without_gil([&] { g.begin(gid, std::move(f)); });
           },
           "id"_a.none(), "filter"_a.none(),
           "Open an allocate-to-private-pool scope: allocations whose stream is `filter` (a stream) or "
           "for which filter(stream) is true come from private pool `id` until end(id).")
      .def("end",
           [](GraphPools& g, nb::handle id) {
             const GraphPoolId gid = parse_id(id);
             without_gil([&] { g.end(gid); });
           },
           "id"_a.none())
      .def("release",
           [](GraphPools& g, nb::handle id) {
             const GraphPoolId gid = parse_id(id);
             without_gil([&] { g.release(gid); });
           },
           "id"_a.none())
      .def("allocate",
           [](GraphPools& g, nb::handle n, nb::handle stream) {
             const std::size_t nbytes = parse_size(n);
             const Stream s = parse_stream(stream);
             void* r = without_gil([&] { return g.allocate(nbytes, s); });
             return keep_unless_interrupted(r, [&](void* q) { g.deallocate(q, s); });
           },
           "nbytes"_a.none(), "stream"_a.none() = nb::none())
      .def("deallocate",
           [](GraphPools& g, nb::handle p, nb::handle stream) {
             void* ptr = reinterpret_cast<void*>(parse_ptr(p));
             const Stream s = parse_stream(stream);
             without_gil([&] { g.deallocate(ptr, s); });
           },
           "ptr"_a.none(), "stream"_a.none() = nb::none())
      .def("record_stream",
           [](GraphPools& g, nb::handle p, nb::handle stream) {
             void* ptr = reinterpret_cast<void*>(parse_ptr(p));
             const Stream s = parse_stream(stream);
             if (s == kNoStream) throw InvalidArgument("record_stream needs a stream, not None", true);
             without_gil([&] { g.record_stream(ptr, s); });
           },
           "ptr"_a.none(), "stream"_a.none())
      .def("owns_private", [](GraphPools& g, nb::handle p) { return g.owns_private(parse_ptr(p)); }, "ptr"_a.none())
      .def_prop_ro("routing", &GraphPools::routing)
      .def_prop_ro("holds_private_blocks", &GraphPools::holds_private_blocks)
      .def_prop_ro("pool", [](GraphPools& g) { return g.main(); })
      .def("private_pool", [](GraphPools& g, nb::handle id) { return g.private_pool(parse_id(id)); }, "id"_a.none())
      .def("live_blocks",
           [](GraphPools& g, nb::handle id) {
             nb::list l;
             for (auto p : g.live_blocks(parse_id(id))) l.append(p);
             return l;
           },
           "id"_a.none(), "Addresses of the live blocks of private pool id.")
      .def("live_block_info",
           [](GraphPools& g, nb::handle id) {
             nb::list l;
             for (auto& b : g.live_block_info(parse_id(id))) l.append(nb::make_tuple(b.addr, b.nbytes, b.stream));
             return l;
           },
           "id"_a.none(), "(address, size asked, stream) of each live block of private pool id, by address.")
      .def("reclaim_next",
           [](GraphPools& g, nb::handle id, nb::handle p, nb::handle n) {
             const GraphPoolId gid = parse_id(id);
             const std::uintptr_t a = parse_ptr(p);
             const std::size_t nbytes = parse_size(n);
             g.reclaim_next(gid, a, nbytes);
           },
           "id"_a.none(), "ptr"_a.none(), "nbytes"_a.none(),
           "The next allocation of exactly nbytes on this thread (through any route: the C ABI, a "
           "framework's allocator) is [ptr, ptr + nbytes) of private pool id (checkpoint restore).")
      .def("reclaim_cancel", &GraphPools::reclaim_cancel, "Forget this thread's reclaim_next().")
      .def("info",
           [](GraphPools& g) {
             nb::list l;
             for (auto& i : g.info()) l.append(info_to_dict(i));
             return l;
           })
      .def("counters",
           [](GraphPools& g) {
             const auto c = g.counters();
             return dict_of("private_allocations", c.private_allocations, "private_deallocations",
                            c.private_deallocations, "pools_created", c.pools_created, "pools_closed", c.pools_closed,
                            "filter_errors", c.filter_errors);
           })
      .def("validate", &GraphPools::validate);
  m.def("graph_pools", [](nb::handle device) { return graph_registry::get(parse_device(device)); }, "device"_a.none(),
        "The GraphPools of device's registry pool (made on first use).");
  m.def("graph_pools_find", [](nb::handle device) -> nb::object {
        std::shared_ptr<GraphPools> gp = graph_registry::current(parse_device(device));
        return gp ? nb::cast(gp) : nb::none();
      }, "device"_a.none());
  m.def("graph_registry_clear", &graph_registry::clear);
  m.def("graph_registry_drop_at_exit", []() {
        // With the GIL held (the exit hook): a pool with a Python object was made in Python.
        return graph_registry::drop_at_exit([](const Pool& p) { return nb::find(&p).is_valid(); });
      },
      "The exit hook: retire every GraphPools over a pool made in Python, which that pool's live "
      "blocks then do not keep. Returns how many stay (a capture scope open, a graph not yet released, or a C ABI call inside one).");
  pthread_atfork(nullptr, nullptr, filters_after_fork_in_child);
  m.def("_forget_python_filters", &forget_python_filters,
        "The exit hook: drop every Python capture filter's callable (a filter without one answers "
        "'not mine'), so that a GraphPools outliving the interpreter keeps no Python object. Returns how many.");
  m.def("registry_left_at_fork", []() { return registry::left_at_fork() || graph_registry::left_at_fork(); },
        "True in a forked child that left the parent's registry entries or GraphPools behind (never "
        "destroyed: their locks may have been held at the fork).");
}

}  // namespace poolkeeper::py
