// _core.BufferCore: the owning part of poolkeeper.buffers.PoolBuffer, native.
//
// Why native: pool.buffer(n) plus drop cost microseconds as a Python class with __init__ and a
// finalizer, while the pool pair underneath costs ~100 ns. Here construction is one call that
// allocates, and the drop is the C++ destructor returning the block (no Python finalizer). The
// protocols (CUDA array interface, DLPack, buffer protocol) stay in the Python subclass.
//
// State (all read and written with the GIL held; the only GIL release is inside the final
// deallocate, after the state says "freed", so no other thread can free twice):
// - owned: release() not called yet; exports: live views holding a claim;
// - freed: the block went back to the pool (once owned == false and exports == 0, or on drop).
#include <vector>

#include "bindings.hpp"

namespace poolkeeper::py {

namespace {

struct BufferCore {
  nb::object pool_obj;  // keeps the Python pool alive as long as the buffer
  Pool* pool = nullptr;
  std::uintptr_t ptr = 0;
  std::size_t nbytes = 0;
  Stream stream = kNoStream;
  int device = -1;
  MemoryKind kind = MemoryKind::Host;
  bool owned = true, freed = false;
  std::size_t exports = 0;
  std::vector<Stream> consumers;  // other streams that used the memory (record_stream was called)

  // Return the block, ordered on the buffer's stream, or on the first consumer's stream when the
  // buffer has none (the other consumer streams were recorded on the block).
  void free_block() {
    if (freed) return;
    freed = true;
    Stream s = stream;
    if (s == kNoStream && !consumers.empty()) s = consumers.front();
    void* p = reinterpret_cast<void*>(ptr);
    if (!pool->try_deallocate_nowait(p, s)) {
      ReleaseGil nogil;
      pool->deallocate(p, s);
    }
  }

  // A view let go: the last one frees a released buffer's block (free_block may throw).
  void unclaim() {
    if (exports) --exports;
    if (exports == 0 && !owned) free_block();
  }

  ~BufferCore() {
    // Views hold a reference to the buffer, so destruction means nobody uses the memory.
    try {
      free_block();
    } catch (...) {
      // The pool was closed (its memory is gone already) or the interpreter is going away.
    }
  }
};

// poolkeeper.buffers.PoolBuffer, registered by that module at import; a strong reference kept for
// the life of the process on purpose (a static nb::object would be released after the interpreter).
PyObject* g_buffer_type = nullptr;

// The owning state of a fresh buffer: allocates first, so a failure leaves nothing to destroy.
void construct(BufferCore* self, nb::handle pool, Pool* p, nb::handle nbytes, nb::handle stream) {
  const std::size_t n = parse_size(nbytes);
  const Stream s = parse_stream(stream);
  void* r = p->try_allocate_nowait(n, s);
  if (!r) {
    ReleaseGil nogil;
    r = p->allocate(n, s);
  }
  BufferCore* b = new (self) BufferCore();
  b->pool_obj = nb::borrow(pool);
  b->pool = p;
  b->ptr = reinterpret_cast<std::uintptr_t>(r);
  b->nbytes = n;
  b->stream = s;
  b->kind = p->upstream()->kind();
  b->device = p->upstream()->device();
}

// The buffer protocol on every Python (3.10/3.11 have no __buffer__), with the claim taken and
// dropped here rather than in Python methods: Python handles a signal only where bytecode runs, so
// with none between the claim and the view, a Ctrl-C cannot leak a claim. It did when these slots
// called Python's _export_buffer_/_release_buffer_: an interrupt at the entry of the release left
// the claim (8 of 40 SIGINTs), and a released buffer's block was then never freed.
int core_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  view->obj = nullptr;
  if (!nb::inst_ready(self)) {
    PyErr_SetString(PyExc_BufferError, "this buffer was never constructed");
    return -1;
  }
  BufferCore* b = nb::inst_ptr<BufferCore>(self);
  if (b->kind == MemoryKind::Device || !b->owned) {
    // The typed refusals live in Python (poolkeeper.buffers); nothing is claimed yet.
    PyObject* r = PyObject_CallMethod(self, "_refuse_export_", nullptr);
    Py_XDECREF(r);
    if (r) PyErr_SetString(PyExc_BufferError, "_refuse_export_ did not refuse");
    return -1;
  }
  // Fails (BufferError) for a writable request on read-only memory; host and pinned are writable.
  if (PyBuffer_FillInfo(view, self, reinterpret_cast<void*>(b->ptr), static_cast<Py_ssize_t>(b->nbytes), 0,
                        flags) != 0)
    return -1;
  ++b->exports;
  return 0;
}

void core_releasebuffer(PyObject* self, Py_buffer*) {
  try {
    nb::inst_ptr<BufferCore>(self)->unclaim();
  } catch (...) {
    // The pool was closed under a live view (its memory went with it). A release cannot raise.
    KeepPendingError keep;
    set_python_error(std::current_exception());
    PyErr_WriteUnraisable(self);
  }
}

}  // namespace

void bind_buffer_core_impl(nb::module_& m) {
  static PyType_Slot buffer_slots[] = {
      {Py_bf_getbuffer, reinterpret_cast<void*>(core_getbuffer)},
      {Py_bf_releasebuffer, reinterpret_cast<void*>(core_releasebuffer)},
      {0, nullptr},
  };
  nb::class_<BufferCore>(m, "BufferCore", nb::is_weak_referenceable(), nb::type_slots(buffer_slots),
                         "The owning part of poolkeeper.buffers.PoolBuffer (allocation, release, claims).")
      .def(
          "__init__",
          [](BufferCore* self, nb::handle pool, nb::handle nbytes, nb::handle stream) {
            Pool* p = nullptr;
            if (!nb::try_cast<Pool*>(pool, p) || !p)
              throw InvalidArgument("pool must be a poolkeeper pool; got " +
                                    nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(pool.ptr()))).attr("__name__"))));
            // Constructed only once the block exists: a failed __init__ leaves nothing to destroy.
            construct(self, pool, p, nbytes, stream);
          },
          "pool"_a.none(), "nbytes"_a.none(), "stream"_a.none() = nb::none())
      .def_prop_ro("pool", [](BufferCore& b) { return b.pool_obj; })
      .def_prop_ro("_exports", [](BufferCore& b) { return b.exports; }, "Views holding a claim now.")
      .def_prop_ro("ptr", [](BufferCore& b) { return nb::int_(b.ptr); })
      .def_prop_ro("nbytes", [](BufferCore& b) { return b.nbytes; })
      .def_prop_ro("stream", [](BufferCore& b) { return stream_to_py(b.stream); })
      .def_prop_ro("device", [](BufferCore& b) { return b.device; })
      .def_prop_ro("kind", [](BufferCore& b) { return std::string(memory_kind_name(b.kind)); })
      .def_prop_ro("released", [](BufferCore& b) { return !b.owned; },
                   "True once release() was called (the memory may still be held by live views).")
      .def(
          "release",
          [](BufferCore& b) {
            if (!b.owned) return;
            b.owned = false;
            if (b.exports == 0) b.free_block();
          },
          "Give the memory back to the pool (stream-ordered on the buffer's stream). Views still alive "
          "from DLPack or the buffer protocol keep it until they go. Calling it again does nothing.")
      .def(
          "_try_claim",
          [](BufferCore& b) {
            if (!b.owned) return false;
            ++b.exports;
            return true;
          },
          "A view takes a claim on the memory; False when the buffer was released.")
      .def("_unclaim", [](BufferCore& b) { b.unclaim(); })
      .def_prop_ro("_consumer_streams",
                   [](BufferCore& b) {
                     nb::list l;
                     for (Stream s : b.consumers) l.append(stream_to_py(s));
                     return l;
                   })
      .def("_add_consumer_stream", [](BufferCore& b, nb::handle s) {
        const Stream st = parse_stream(s);
        for (Stream c : b.consumers)
          if (c == st) return;
        b.consumers.push_back(st);
      });

  m.def(
      "_set_buffer_class",
      [](nb::handle cls) {
        if (!PyType_Check(cls.ptr()) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls.ptr()),
                                                          reinterpret_cast<PyTypeObject*>(nb::type<BufferCore>().ptr())))
          throw InvalidArgument("the buffer class must subclass BufferCore", true);
        Py_INCREF(cls.ptr());
        Py_XDECREF(g_buffer_type);
        g_buffer_type = cls.ptr();
      },
      "cls"_a, "The class pool.buffer() makes (poolkeeper.buffers.PoolBuffer registers itself).");

  // pool.buffer(nbytes, stream=None) on every pool, native: the buffer object is allocated and
  // filled in one call, without the Python frame and the type call (__new__, __init__, argument
  // matching) that constructing PoolBuffer from Python costs.
  nb::handle pool_type = nb::type<Pool>();
  pool_type.attr("buffer") = nb::cpp_function(
      [](nb::handle self, nb::handle nbytes, nb::handle stream) -> nb::object {
        if (!g_buffer_type) nb::module_::import_("poolkeeper.buffers");  // registers PoolBuffer
        if (!g_buffer_type) throw InvalidArgument("poolkeeper.buffers did not register its buffer class");
        Pool* p = nb::cast<Pool*>(self);
        nb::object inst = nb::inst_alloc(nb::handle(g_buffer_type));
        construct(nb::inst_ptr<BufferCore>(inst), self, p, nbytes, stream);
        nb::inst_mark_ready(inst);
        return inst;
      },
      nb::is_method(), nb::scope(pool_type), nb::name("buffer"), "nbytes"_a.none(), "stream"_a.none() = nb::none(),
      "An owning buffer of ``nbytes`` from this pool, ordered on ``stream`` (see poolkeeper.buffers).");
}

}  // namespace poolkeeper::py

// Called from NB_MODULE through a block-scope declaration (global namespace), as the other late
// additions are, so module.cpp needs no header change.
void bind_buffer_core(nanobind::module_& m) { poolkeeper::py::bind_buffer_core_impl(m); }
