"""ctypes view of the C ABI exported by the built module (poolkeeper/_core*.so).

ctypes releases the GIL around each call, so threads driving these functions run the core's
paths truly in parallel (the Python methods hold the GIL on their lock-free fast paths).
"""
from __future__ import annotations

import ctypes

from poolkeeper import _core

NO_STREAM = 2**64 - 1  # POOLKEEPER_NO_STREAM
SYMBOLS = (
    "poolkeeper_torch_malloc",
    "poolkeeper_torch_free",
    "poolkeeper_malloc",
    "poolkeeper_free",
    "poolkeeper_last_error",
    "poolkeeper_torch_record_stream",
    "poolkeeper_empty_cache",
    "poolkeeper_graph_begin",
    "poolkeeper_graph_end",
    "poolkeeper_graph_release",
)
# Return codes of the general entry points (cpp/capi/capi.cpp).
OK, INVALID_ARGUMENT, INVALID_POINTER, OUT_OF_MEMORY, UPSTREAM, CLOSED = 0, 1, 2, 3, 4, 5


def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(_core.__file__)
    c = ctypes
    lib.poolkeeper_malloc.restype = c.c_void_p
    lib.poolkeeper_malloc.argtypes = [c.c_size_t, c.c_int, c.c_uint64]
    lib.poolkeeper_free.restype = c.c_int
    lib.poolkeeper_free.argtypes = [c.c_void_p, c.c_int, c.c_uint64]
    lib.poolkeeper_torch_malloc.restype = c.c_void_p
    lib.poolkeeper_torch_malloc.argtypes = [c.c_size_t, c.c_int, c.c_void_p]
    lib.poolkeeper_torch_free.restype = None
    lib.poolkeeper_torch_free.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_void_p]
    lib.poolkeeper_torch_record_stream.restype = c.c_int
    lib.poolkeeper_torch_record_stream.argtypes = [c.c_void_p, c.c_int, c.c_void_p]
    lib.poolkeeper_empty_cache.restype = c.c_int64
    lib.poolkeeper_empty_cache.argtypes = []
    lib.poolkeeper_graph_begin.restype = c.c_int
    lib.poolkeeper_graph_begin.argtypes = [c.c_int, c.c_uint64, c.c_uint64, c.c_uint64]
    lib.poolkeeper_graph_end.restype = c.c_int
    lib.poolkeeper_graph_end.argtypes = [c.c_int, c.c_uint64, c.c_uint64]
    lib.poolkeeper_graph_release.restype = c.c_int
    lib.poolkeeper_graph_release.argtypes = [c.c_int, c.c_uint64, c.c_uint64]
    lib.poolkeeper_last_error.restype = c.c_char_p
    lib.poolkeeper_last_error.argtypes = []
    return lib


def last_error(lib) -> str:
    return lib.poolkeeper_last_error().decode()
