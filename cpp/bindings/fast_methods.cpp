// allocate/deallocate as raw METH_FASTCALL method descriptors on the Pool type.
//
// Why not ordinary nanobind methods: a method with a keyword default (stream=None) goes through
// nanobind's general dispatcher, which costs more than the whole pool hit it wraps. A raw
// descriptor takes the vector call straight from the interpreter: the Python-level
// allocate+deallocate pair then costs little more than two empty calls. CPython's descriptor
// checks that self is a Pool before we see it.
#include "bindings.hpp"

namespace poolkeeper::py {

namespace {

// Positional-or-keyword parsing of (first, second=None) without building a dict.
bool parse_args(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, const char* n0, const char* n1,
                PyObject*& a0, PyObject*& a1, bool second_required) {
  a0 = nargs > 0 ? args[0] : nullptr;
  a1 = nargs > 1 ? args[1] : nullptr;
  if (nargs > 2) {
    PyErr_Format(PyExc_TypeError, "takes at most 2 arguments (%zd given)", nargs);
    return false;
  }
  if (kwnames) {
    const Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nk; ++i) {
      PyObject* k = PyTuple_GET_ITEM(kwnames, i);
      PyObject* v = args[nargs + i];
      if (PyUnicode_CompareWithASCIIString(k, n0) == 0) {
        if (a0) return PyErr_Format(PyExc_TypeError, "got multiple values for argument '%s'", n0), false;
        a0 = v;
      } else if (PyUnicode_CompareWithASCIIString(k, n1) == 0) {
        if (a1) return PyErr_Format(PyExc_TypeError, "got multiple values for argument '%s'", n1), false;
        a1 = v;
      } else {
        PyErr_Format(PyExc_TypeError, "got an unexpected keyword argument '%U'", k);
        return false;
      }
    }
  }
  if (!a0) return PyErr_Format(PyExc_TypeError, "missing required argument '%s'", n0), false;
  if (!a1) {
    if (second_required) return PyErr_Format(PyExc_TypeError, "missing required argument '%s'", n1), false;
    a1 = Py_None;
  }
  return true;
}

// A raw descriptor skips nanobind's argument conversion, and with it the check that self was
// constructed: a subclass whose __init__ never called the pool's, or Pool.__new__(P) alone, has no
// C++ object behind it.
bool check_ready(PyObject* self) {
  if (nb::inst_ready(self)) return true;
  PyErr_Format(PyExc_TypeError,
               "%s object is not initialized: its __init__ must call the pool's __init__ (super().__init__(...))",
               Py_TYPE(self)->tp_name);
  return false;
}

// A raw method (first, stream=None) on a ready Pool: body(pool, first, stream), errors mapped.
template <class Body>
PyObject* pool_method(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, const char* first,
                      Body body) {
  PyObject *a0, *a1;
  if (!check_ready(self) || !parse_args(args, nargs, kwnames, first, "stream", a0, a1, false)) return nullptr;
  try {
    return body(*nb::inst_ptr<Pool>(self), a0, a1);
  } catch (...) {
    set_python_error(std::current_exception());
    return nullptr;
  }
}

PyObject* fast_allocate(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return pool_method(self, args, nargs, kwnames, "nbytes",
                     [](Pool& p, PyObject* n, PyObject* s) { return PyLong_FromSize_t(py_allocate(p, n, s)); });
}

PyObject* fast_deallocate(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return pool_method(self, args, nargs, kwnames, "ptr", [](Pool& p, PyObject* a, PyObject* s) {
    py_deallocate(p, a, s);
    Py_RETURN_NONE;
  });
}

PyMethodDef g_allocate_def = {
    "allocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_allocate)), METH_FASTCALL | METH_KEYWORDS,
    "allocate(nbytes, stream=None) -> int\n\nAn address of nbytes bytes, aligned to the pool's alignment, usable on "
    "stream (None: anywhere once the caller orders it). Raises InvalidArgumentError, InvalidStreamError, "
    "OutOfMemoryError (with a diagnosis), PoolClosedError."};
PyMethodDef g_deallocate_def = {
    "deallocate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_deallocate)),
    METH_FASTCALL | METH_KEYWORDS,
    "deallocate(ptr, stream=None)\n\nRelease a live block. stream=None: the caller guarantees all device work on it "
    "has completed; a stream: reusable at once on that stream, by others once its event completes. Raises "
    "InvalidPointerError (.reason: null, unknown, double_free, interior, other_pool), PoolClosedError."};
}  // namespace

void install_fast_methods(nb::handle pool_type) {
  for (PyMethodDef* def : {&g_allocate_def, &g_deallocate_def}) {
    PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(pool_type.ptr()), def);
    if (!descr || PyObject_SetAttrString(pool_type.ptr(), def->ml_name, descr) != 0) {
      Py_XDECREF(descr);
      throw nb::python_error();
    }
    Py_DECREF(descr);
  }
}

}  // namespace poolkeeper::py
