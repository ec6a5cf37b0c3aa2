// poolkeeper._core.HostBufferExporter: the buffer protocol (bf_getbuffer / bf_releasebuffer) as a
// base class for Python types over host memory (PoolBuffer, StagingBuffer).
//
// Python classes only get buffer slots from a `__buffer__` method on 3.12+ (PEP 688); a native
// base gives memoryview(obj), numpy and every C consumer the same protocol on 3.10 and 3.11.
// Contract with the subclass (both called with the GIL held, from the slots):
//   _export_buffer_(writable: bool) -> (address: int, nbytes: int, readonly: bool)
//       takes a claim on the memory, or raises (device memory, released/retired buffer) -- the
//       exception propagates to the consumer unchanged;
//   _release_buffer_() -> None
//       drops one claim; called exactly once per successful export (an exception here cannot
//       propagate, so it is reported as unraisable).
// The base is a plain C type (PyType_FromSpec, the same slots nanobind's nb::type_slots would
// pass), not a nanobind class: subclasses keep object.__new__, __slots__ and __weakref__, and no
// nanobind instance (or registry entry) is made per buffer.
#include "bindings.hpp"

namespace poolkeeper::py {

namespace {

PyObject* g_export_name = nullptr;
PyObject* g_release_name = nullptr;

void call_release(PyObject* self) {
  PyObject* r = PyObject_CallMethodObjArgs(self, g_release_name, nullptr);
  if (r) {
    Py_DECREF(r);
  } else {
    PyErr_WriteUnraisable(self);
  }
}

}  // namespace

int exporter_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  PyObject* writable = (flags & PyBUF_WRITABLE) ? Py_True : Py_False;
  PyObject* r = PyObject_CallMethodObjArgs(self, g_export_name, writable, nullptr);
  if (!r) {
    view->obj = nullptr;
    return -1;
  }
  unsigned long long address = 0;
  Py_ssize_t nbytes = 0;
  int readonly = 0;
  const bool parsed = PyTuple_Check(r) && PyArg_ParseTuple(r, "Knp", &address, &nbytes, &readonly);
  Py_DECREF(r);
  if (!parsed) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "_export_buffer_ must return (address, nbytes, readonly)");
    call_release(self);
    view->obj = nullptr;
    return -1;
  }
  // Fills a 1-D, C-contiguous 'B' view; fails (BufferError) for a writable request on read-only
  // memory, and then the claim taken above is dropped again.
  if (PyBuffer_FillInfo(view, self, reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), nbytes,
                        readonly, flags) != 0) {
    call_release(self);
    return -1;
  }
  return 0;
}

void exporter_releasebuffer(PyObject* self, Py_buffer*) {
  // May run while an exception is being raised (a memoryview dropped during unwinding): keep it.
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* pending = PyErr_GetRaisedException();
  call_release(self);
  PyErr_SetRaisedException(pending);
#else
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  call_release(self);
  PyErr_Restore(type, value, tb);
#endif
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
