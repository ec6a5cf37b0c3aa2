// DLPack capsules for poolkeeper's buffers, made in the core (poolkeeper._dlpack.make_capsule).
//
// A 1-D uint8 tensor over a raw address, as the legacy capsule ("dltensor", DLManagedTensor) or
// the DLPack 1.0 one ("dltensor_versioned", DLManagedTensorVersioned). Ownership follows the
// DLPack rule: a consumer renames the capsule to "used_*" and calls the tensor's deleter when done;
// a capsule nobody consumed calls it from its destructor. Either way the deleter runs exactly once,
// and only then is the producer's on_release called (with the GIL, from whatever thread the
// consumer frees on). Building the structs here costs well under a microsecond; the ctypes
// construction this replaces cost tens of microseconds per capsule.
#include <atomic>
#include <cstdint>

#include "bindings.hpp"

namespace poolkeeper::py {

namespace {

// The layouts of dlpack.h (v1.0), which both capsule kinds share with every consumer.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint8_t kDLUInt = 1;
constexpr const char* kLegacyName = "dltensor";
constexpr const char* kVersionedName = "dltensor_versioned";

// One export: the managed struct the consumer sees, its shape, and the producer's callback.
struct Export {
  DLManagedTensor legacy{};
  DLManagedTensorVersioned versioned{};
  int64_t shape[1] = {0};
  PyObject* on_release = nullptr;  // strong reference, dropped by the deleter
};

std::atomic<long> g_live{0};

void finish(Export* e) {
  // A consumer may call the deleter on any thread, also while the interpreter exits.
  if (GilFromAnyThread gil; gil) {
    KeepPendingError keep;  // a consumer may free while an exception is being raised (gone before the GIL)
    PyObject* r = PyObject_CallObject(e->on_release, nullptr);
    if (r) {
      Py_DECREF(r);
    } else {
      PyErr_WriteUnraisable(e->on_release);
    }
    Py_DECREF(e->on_release);
  }  // else: the interpreter is exiting or gone; the reference goes with the process
  delete e;
  g_live.fetch_sub(1, std::memory_order_relaxed);
}

void legacy_deleter(DLManagedTensor* m) { finish(static_cast<Export*>(m->manager_ctx)); }
void versioned_deleter(DLManagedTensorVersioned* m) { finish(static_cast<Export*>(m->manager_ctx)); }

void capsule_destructor(PyObject* capsule) {
  // Renamed "used_*": the consumer took ownership and calls (or called) the deleter itself.
  if (PyCapsule_IsValid(capsule, kLegacyName)) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kLegacyName));
    m->deleter(m);
  } else if (PyCapsule_IsValid(capsule, kVersionedName)) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersionedName));
    m->deleter(m);
  }
}

nb::object make_capsule(std::uintptr_t address, std::int64_t nbytes, int device_type, int device_id,
                        nb::object on_release, bool versioned) {
  if (nbytes < 0) throw nb::value_error("nbytes must be non-negative");
  if (!PyCallable_Check(on_release.ptr())) throw nb::type_error("on_release must be callable");
  auto* e = new Export();
  e->shape[0] = nbytes;
  DLTensor t{};
  t.data = reinterpret_cast<void*>(address);
  t.device = DLDevice{device_type, device_id};
  t.ndim = 1;
  t.dtype = DLDataType{kDLUInt, 8, 1};
  t.shape = e->shape;
  t.strides = nullptr;  // compact row-major
  t.byte_offset = 0;
  void* ptr;
  const char* name;
  if (versioned) {
    e->versioned.version = DLPackVersion{1, 0};
    e->versioned.manager_ctx = e;
    e->versioned.deleter = versioned_deleter;
    e->versioned.flags = 0;  // writable, not a copy
    e->versioned.dl_tensor = t;
    ptr = &e->versioned;
    name = kVersionedName;
  } else {
    e->legacy.dl_tensor = t;
    e->legacy.manager_ctx = e;
    e->legacy.deleter = legacy_deleter;
    ptr = &e->legacy;
    name = kLegacyName;
  }
  PyObject* capsule = PyCapsule_New(ptr, name, capsule_destructor);
  if (!capsule) {
    delete e;
    throw nb::python_error();
  }
  e->on_release = on_release.release().ptr();
  g_live.fetch_add(1, std::memory_order_relaxed);
  return nb::steal(capsule);
}

}  // namespace

long dlpack_exports_left() { return g_live.load(std::memory_order_seq_cst); }

void bind_dlpack(nb::module_& m) {
  m.def("dlpack_capsule", &make_capsule, "address"_a, "nbytes"_a, "device_type"_a, "device_id"_a, "on_release"_a,
        "versioned"_a,
        "A DLPack capsule for nbytes at address as a 1-D uint8 tensor; on_release() runs once, when the "
        "consumer is done (or an unconsumed capsule is collected).");
  m.def("dlpack_live_exports", [] { return g_live.load(std::memory_order_relaxed); },
        "How many DLPack capsules' deleters have not run yet.");
}

}  // namespace poolkeeper::py

void bind_dlpack(nanobind::module_& m) { poolkeeper::py::bind_dlpack(m); }
