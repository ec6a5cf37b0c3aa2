"""Addresses of host buffers, for copies that release the GIL.

``ctypes.memmove`` releases the GIL, so several threads can move bytes at once; it needs raw
addresses. ``memoryview`` does not expose one and ``ctypes.from_buffer`` refuses read-only objects
(``bytes``), so this takes a ``Py_buffer`` through the C API and holds it (which pins the exporter:
a ``bytearray`` cannot be resized, a numpy array keeps its data) until :meth:`BorrowedBuffer.release`.
"""
from __future__ import annotations

import ctypes
from typing import Any

from poolkeeper.errors import InvalidArgumentError

_PyBUF_SIMPLE = 0
_PyBUF_WRITABLE = 0x0001


class _PyBuffer(ctypes.Structure):
    # Layout of Py_buffer (Include/pybuffer.h), stable across CPython 3.x.
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


class BorrowedBuffer:
    """A held, C-contiguous buffer export of ``obj``: ``address`` and ``nbytes`` stay valid until
    :meth:`release` (also a context manager)."""

    __slots__ = ("_view", "address", "nbytes", "_held")

    def __init__(self, obj: Any, writable: bool = False, what: str = "buffer") -> None:
        self._view = _PyBuffer()
        self._held = False
        flags = _PyBUF_WRITABLE if writable else _PyBUF_SIMPLE
        try:
            _get_buffer(obj, ctypes.byref(self._view), flags)
        except (BufferError, TypeError, ValueError) as e:
            need = "a writable, C-contiguous" if writable else "a C-contiguous"
            raise InvalidArgumentError(f"{what} must be {need} object supporting the buffer protocol; {e}") from None
        self._held = True
        self.address = self._view.buf or 0
        self.nbytes = self._view.len

    def release(self) -> None:
        if self._held:
            self._held = False
            _release_buffer(ctypes.byref(self._view))

    def __enter__(self) -> "BorrowedBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


__all__ = ["BorrowedBuffer"]
