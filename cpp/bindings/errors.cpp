// C++ errors -> poolkeeper.errors classes, with their figures as keyword attributes.
#include <nanobind/stl/vector.h>

#include "bindings.hpp"

namespace poolkeeper::py {

namespace {
nb::object errors_module() {
  // Leaked on purpose: a static nb::object would be released by C++ exit handlers after the
  // interpreter is gone.
  static PyObject* mod = nullptr;
  if (!mod) mod = nb::module_::import_("poolkeeper.errors").release().ptr();
  return nb::borrow(mod);
}

void raise(const char* cls, const char* msg, nb::dict figures) {
  nb::object type = errors_module().attr(cls);
  nb::object exc = type(nb::str(msg), **figures);
  PyErr_SetObject(type.ptr(), exc.ptr());
}

nb::list ptr_list(const std::vector<std::uintptr_t>& v) {
  nb::list l;
  for (auto p : v) l.append(nb::int_(p));
  return l;
}

void set_python_error_unguarded(const std::exception_ptr& p) {
    try {
      std::rethrow_exception(p);
    } catch (const OutOfMemory& e) {
      const auto& f = e.figures;
      nb::dict d, by_stream;
      for (auto& [s, b] : f.pending_by_stream) by_stream[stream_to_py(s)] = nb::int_(b);
      d["requested"] = f.requested;
      d["reserved"] = f.reserved;
      d["live"] = f.live;
      d["free"] = f.free;
      d["largest_free"] = f.largest_free;
      d["free_chunks"] = f.free_chunks;
      d["pending"] = f.pending;
      d["pending_by_stream"] = by_stream;
      d["thread_cached"] = f.thread_cached;
      d["limit"] = f.limit ? nb::object(nb::int_(f.limit)) : nb::none();
      d["cause"] = oom_cause_name(f.cause);
      d["pool"] = f.pool;
      d["upstream"] = f.upstream;
      d["upstream_error"] = f.upstream_error;
      raise("OutOfMemoryError", e.what(), d);
    } catch (const InvalidPointer& e) {
      nb::dict d;
      d["ptr"] = nb::int_(e.ptr);
      d["reason"] = e.reason;
      raise("InvalidPointerError", e.what(), d);
    } catch (const InvalidArgument& e) {
      raise(e.type_error ? "InvalidStreamError" : "InvalidArgumentError", e.what(), nb::dict());
    } catch (const LiveBlocksAtClose& e) {
      nb::dict d;
      d["blocks"] = e.blocks;
      d["bytes"] = e.bytes;
      d["sample"] = ptr_list(e.sample);
      raise("LiveBlocksError", e.what(), d);
    } catch (const PoolClosed& e) {
      raise("PoolClosedError", e.what(), nb::dict());
    } catch (const UpstreamOutOfMemory& e) {
      // Out of memory is OutOfMemoryError everywhere (a raw upstream call included), so callers
      // catching MemoryError run their recovery; it stays an UpstreamError for existing handlers.
      nb::dict d;
      d["upstream"] = e.upstream;
      d["error_name"] = e.error_name;
      d["code"] = e.code;
      d["cause"] = "upstream";
      d["upstream_error"] = e.what();
      raise("UpstreamOutOfMemoryError", e.what(), d);
    } catch (const UpstreamFailure& e) {
      nb::dict d;
      d["upstream"] = e.upstream;
      d["error_name"] = e.error_name;
      d["code"] = e.code;
      raise("UpstreamError", e.what(), d);
    } catch (const CudaUnavailable& e) {
      raise("CudaUnavailableError", e.what(), nb::dict());
    } catch (const InvariantViolation& e) {
      raise("InvariantError", e.what(), nb::dict());
    } catch (const Error& e) {
      raise("PoolkeeperError", e.what(), nb::dict());
    } catch (const nb::python_error& e) {
      nb::python_error copy = e;
      copy.restore();
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
}
}  // namespace

void set_python_error(const std::exception_ptr& p) {
  // Building the error runs Python (the class's __init__, the figures' dict), and a signal handler
  // runs there too: Ctrl-C at that moment raised KeyboardInterrupt inside __init__, and the
  // nb::python_error it became left a C function called by CPython (the raw fast methods, CuPy's
  // malloc) or nanobind's translator: std::terminate. That Python exception is the one the caller
  // gets instead.
  try {
    set_python_error_unguarded(p);
  } catch (nb::python_error& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "poolkeeper: an error occurred and could not be converted");
  }
}

void bind_errors(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error&) {
      set_python_error(p);
    }
  });
}

}  // namespace poolkeeper::py
