// poolkeeper._core.HostBufferExporter: the buffer protocol (bf_getbuffer / bf_releasebuffer) as a
// base class for Python types over host memory (StagingBuffer; PoolBuffer has native slots of its own,
// buffer_core.cpp).
//
// Python classes only get buffer slots from a `__buffer__` method on 3.12+ (PEP 688); a native
// base gives memoryview(obj), numpy and every C consumer the same protocol on 3.10 and 3.11.
// Contract with the subclass (both called with the GIL held, from the slots):
//   _export_buffer_(writable: bool, token: int) -> (address: int, nbytes: int, readonly: bool)
//       takes a claim on the memory named `token` (unique among the object's live views), or
//       raises (device memory, released/retired buffer) -- the exception propagates to the
//       consumer unchanged;
//   _release_buffer_(token: int) -> None
//       drops the claim `token`, and does nothing for a token it does not hold (idempotent).
// Why tokens: a Ctrl-C is raised wherever Python bytecode runs, so it can cut either method short
// on either side of taking or dropping the claim. The slots make that safe by repeating: a failed
// export is followed by a release of its token (which undoes a claim already taken), and a release
// cut short by KeyboardInterrupt is called again until it completes, after which the interrupt is
// raised anew (PyErr_SetInterrupt) instead of being lost. Before, 24 of 120 interruption points
// of a staging buffer's export and release left a view counted forever.
// The base is a plain C type (PyType_FromSpec, the same slots nanobind's nb::type_slots would
// pass), not a nanobind class: subclasses keep object.__new__, __slots__ and __weakref__, and no
// nanobind instance (or registry entry) is made per buffer.
#include "bindings.hpp"

namespace poolkeeper::py {

namespace {

PyObject* g_export_name = nullptr;
PyObject* g_release_name = nullptr;

// A view's token travels in Py_buffer.internal, the field consumers keep for the exporter (also
// when they copy the struct). Tokens are never reused within a process (GIL-guarded counter).
std::uintptr_t g_last_token = 0;

// Drops the claim `token` names. Called again while it ends in KeyboardInterrupt (a bounded
// number of times: each try can only be cut short by a new signal); a KeyboardInterrupt seen is
// raised anew once the claim is dropped. Any other failure is reported as unraisable. Returns with
// no error set.
void call_release(PyObject* self, PyObject* token) {
  bool interrupted = false;
  for (int attempt = 0; attempt < 16; ++attempt) {
    PyObject* r = PyObject_CallMethodObjArgs(self, g_release_name, token, nullptr);
    if (r) {
      Py_DECREF(r);
      break;
    }
    if (!PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
      PyErr_WriteUnraisable(self);
      break;
    }
    PyErr_Clear();
    interrupted = true;
  }
  if (interrupted) PyErr_SetInterrupt();
}

}  // namespace

int exporter_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  view->obj = nullptr;
  const std::uintptr_t id = ++g_last_token;
  PyObject* token = PyLong_FromSize_t(id);
  if (!token) return -1;
  PyObject* writable = (flags & PyBUF_WRITABLE) ? Py_True : Py_False;
  PyObject* r = PyObject_CallMethodObjArgs(self, g_export_name, writable, token, nullptr);
  unsigned long long address = 0;
  Py_ssize_t nbytes = 0;
  int readonly = 0;
  bool ok = r && PyTuple_Check(r) && PyArg_ParseTuple(r, "Knp", &address, &nbytes, &readonly);
  Py_XDECREF(r);
  if (r && !ok && !PyErr_Occurred())
    PyErr_SetString(PyExc_TypeError, "_export_buffer_ must return (address, nbytes, readonly)");
  // Fills a 1-D, C-contiguous 'B' view; fails (BufferError) for a writable request on read-only
  // memory.
  if (ok && PyBuffer_FillInfo(view, self, reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), nbytes,
                              readonly, flags) != 0)
    ok = false;
  if (!ok) {
    // The export may have taken its claim before it failed (or was interrupted): drop it.
    {
      KeepPendingError keep;
      call_release(self, token);
    }
    view->obj = nullptr;
  } else {
    view->internal = reinterpret_cast<void*>(id);
  }
  Py_DECREF(token);
  return ok ? 0 : -1;
}

void exporter_releasebuffer(PyObject* self, Py_buffer* view) {
  KeepPendingError keep;  // may run while an exception is being raised (a view dropped unwinding)
  PyObject* token = PyLong_FromSize_t(reinterpret_cast<std::uintptr_t>(view->internal));
  if (!token) {
    PyErr_WriteUnraisable(self);
    return;
  }
  call_release(self, token);
  Py_DECREF(token);
}

namespace {

PyType_Slot exporter_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(exporter_getbuffer)},
    {Py_bf_releasebuffer, reinterpret_cast<void*>(exporter_releasebuffer)},
    {Py_tp_doc, const_cast<char*>("Base of poolkeeper's host-memory buffers: the buffer protocol on every Python "
                                  "(subclasses implement _export_buffer_ and _release_buffer_).")},
    {0, nullptr},
};

PyType_Spec exporter_spec = {
    "poolkeeper._core.HostBufferExporter",
    0,  // basicsize: that of object; subclasses add their own slots
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    exporter_slots,
};

}  // namespace

void bind_buffer_protocol(nb::module_& m) {
  g_export_name = PyUnicode_InternFromString("_export_buffer_");
  g_release_name = PyUnicode_InternFromString("_release_buffer_");
  PyObject* type = PyType_FromSpec(&exporter_spec);
  if (!type || !g_export_name || !g_release_name) throw nb::python_error();
  m.attr("HostBufferExporter") = nb::steal(type);
}

}  // namespace poolkeeper::py

void bind_buffer_protocol(nanobind::module_& m) { poolkeeper::py::bind_buffer_protocol(m); }
