"""DLPack capsules built with ctypes (no compiled code, no third-party import).

Implements the producer side of DLPack for a 1-D ``uint8`` tensor over a raw address:

- the legacy capsule (``"dltensor"``, ``DLManagedTensor``) and the versioned one
  (``"dltensor_versioned"``, ``DLManagedTensorVersioned``, DLPack 1.0), chosen by the consumer's
  ``max_version``;
- the ownership rule: a consumer renames the capsule (``"used_dltensor"``…) and calls the
  tensor's ``deleter`` when it is done; a capsule nobody consumed calls it from its destructor.
  Either way the deleter runs exactly once, and only then is the producer's ``on_release`` called.

The struct memory stays alive in ``_LIVE`` (keyed by its address) until the deleter has run.
Deleters may run on any thread; ctypes callbacks take the GIL themselves.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Dict, Tuple

# DLDeviceType values (dlpack.h).
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
_KDL_UINT = 1  # DLDataTypeCode kDLUInt

DLPACK_VERSION = (1, 0)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER_T)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _DELETER_T),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


class _Export:
    __slots__ = ("struct", "shape", "on_release")

    def __init__(self, struct, shape, on_release: Callable[[], None]) -> None:
        self.struct = struct
        self.shape = shape
        self.on_release = on_release


# address of the managed-tensor struct -> its export record (keeps the struct memory alive)
_LIVE: Dict[int, _Export] = {}


def _run_deleter(address: int) -> None:
    exp = _LIVE.pop(address, None)
    if exp is not None:
        exp.on_release()


@_DELETER_T
def _deleter(address):  # called by the consumer (or by our capsule destructor), exactly once
    try:
        _run_deleter(address)
    except Exception:  # a deleter must not raise into C; at worst the buffer frees at GC
        pass


_NAME_LEGACY = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

_DESTRUCTOR_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Private prototypes: the function objects of ctypes.pythonapi are shared process-wide, and
# someone else setting their argtypes must not change how we call them.
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _DESTRUCTOR_T)(
    ("PyCapsule_New", ctypes.pythonapi)
)
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


@_DESTRUCTOR_T
def _capsule_destructor(capsule):
    # The capsule is being destroyed (refcount 0): take it as a raw pointer, never as an object.
    # A consumed capsule was renamed "used_*" and its consumer owns the deleter call.
    try:
        for name in (_NAME_LEGACY, _NAME_VERSIONED):
            if _PyCapsule_IsValid(capsule, name):
                _run_deleter(_PyCapsule_GetPointer(capsule, name))
                return
    except Exception:
        pass


def make_capsule(
    address: int, nbytes: int, device: Tuple[int, int], on_release: Callable[[], None], versioned: bool
):
    """A DLPack capsule for ``nbytes`` bytes at ``address`` as a 1-D uint8 tensor on ``device``
    (``(device_type, device_id)``). ``on_release`` runs once, when the consumer is done (or when an
    unconsumed capsule is collected)."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    struct = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
    t = struct.dl_tensor
    t.data = address
    t.device = _DLDevice(*device)
    t.ndim = 1
    t.dtype = _DLDataType(_KDL_UINT, 8, 1)
    t.shape = shape
    t.strides = None  # compact row-major
    t.byte_offset = 0
    struct.manager_ctx = None
    struct.deleter = _deleter
    if versioned:
        struct.version = _DLPackVersion(*DLPACK_VERSION)
        struct.flags = 0  # writable, not a copy
    addr = ctypes.addressof(struct)
    _LIVE[addr] = _Export(struct, shape, on_release)
    try:
        return _PyCapsule_New(addr, _NAME_VERSIONED if versioned else _NAME_LEGACY, _capsule_destructor)
    except BaseException:
        _LIVE.pop(addr, None)
        raise


def live_exports() -> int:
    """How many capsules' deleters have not run yet (for tests)."""
    return len(_LIVE)


__all__ = ["KDL_CPU", "KDL_CUDA", "KDL_CUDA_HOST", "DLPACK_VERSION", "make_capsule", "live_exports"]
