"""poolkeeper as CuPy's allocator, on a real GPU, each case in a fresh process. Includes our ports
of CuPy's allocator tests (tests/cupy_tests/cuda_tests/test_memory.py: TestAllocator,
TestAllocatorDisabled, TestPythonFunctionAllocator, TestUnownedMemory, TestMemoryPool's zero-size
case): same facts, our allocator."""
from __future__ import annotations

import importlib.util

import pytest

from isolated import run_isolated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy"),
]

PRELUDE = """
import gc, threading
import cupy
import poolkeeper as pk
from poolkeeper.integrations import cupy as pkc
"""


def test_port_of_cupy_allocator_tests():
    run_isolated(
        PRELUDE
        + """
inst = pkc.install("arena")
pool = lambda: inst.pools()[0]
# TestAllocator.test_set_allocator: an int64 arange(128) is 1024 bytes from the installed allocator
with cupy.cuda.Device(0):
    arr = cupy.arange(128, dtype=cupy.int64)
    assert arr.data.mem.size == 1024
    assert pool().stats()["live_bytes"] == 1024
    assert int(arr.sum()) == 127 * 128 // 2
# TestAllocator.test_reuse_between_thread: allocation works from another thread
err = []
def job():
    try:
        cupy.arange(16)
    except Exception as e:
        err.append(e)
t = threading.Thread(target=job); t.start(); t.join()
assert not err, err
# TestPythonFunctionAllocator: malloc and free both reached on cupy.zeros(10)
calls = inst.calls
live = pool().stats()["live_bytes"]
cupy.zeros(10)
gc.collect()
assert inst.calls == calls + 1
assert pool().stats()["live_bytes"] == live  # freed on collection
# TestUnownedMemory: memory handed out through UnownedMemory is usable
arr2 = cupy.ndarray((2, 3), cupy.float32, arr.data)
arr2[:] = 2
assert bool((arr2 == 2).all())
# TestMemoryPool.test_zero_size_alloc: size 0 gives a plain Memory, nothing from the pool
blocks = pool().stats()["live_blocks"]
z = cupy.cuda.alloc(0)
assert z.mem.size == 0 and pool().stats()["live_blocks"] == blocks
del arr, arr2
gc.collect()
assert pool().stats()["live_bytes"] == 0
pool().validate()
print("ok")
"""
    )


def test_uninstall_restores_cupys_pool():
    # TestAllocatorDisabled's check, turned around: after uninstall CuPy's default pool serves
    # allocations again and ours sees none.
    run_isolated(
        PRELUDE
        + """
default = cupy.get_default_memory_pool()
inst = pkc.install("arena", pinned=False)
ours = inst.allocator
used = default.used_bytes()
a = cupy.arange(128, dtype=cupy.int64)
assert default.used_bytes() == used  # not CuPy's pool
pkc.uninstall()
assert cupy.cuda.get_allocator() == default.malloc
calls = inst.calls
b = cupy.arange(128, dtype=cupy.int64)
assert default.used_bytes() - used == 1024
assert inst.calls == calls
held = inst.pools()[0]
assert held.stats()["live_bytes"] == 1024  # `a` still ours, returns to our pool when collected
del a
gc.collect()
assert held.stats()["live_bytes"] == 0
print("ok")
"""
    )


def test_frees_are_ordered_on_the_allocating_stream():
    run_isolated(
        PRELUDE
        + """
inst = pkc.install("arena", pinned=False, thread_cache_bytes=0)
s = cupy.cuda.Stream(non_blocking=True)
with s:
    x = cupy.ones(1 << 20, dtype=cupy.float32)
    ptr = x.data.ptr
    y = x * 2
    del x
    gc.collect()
# The block went back on the stream CuPy allocated it on: pending for everyone else until that
# stream's work is known to be done.
snap = inst.pools()[0].snapshot().to_dict()
mine = [c for b in snap["backings"] for c in b["chunks"] if b["address"] + c["offset"] == ptr]
assert mine and mine[0]["state"] == "pending", mine
assert mine[0]["last_stream"] == s.ptr, (mine, hex(s.ptr))
inst.pools()[0].synchronize()  # waits for the stream's work, then nothing is pending
assert inst.pools()[0].stats()["pending_bytes"] == 0
assert float(y.sum()) == 2.0 * (1 << 20)
print("ok")
"""
    )


def test_pinned_allocator_and_copies():
    run_isolated(
        PRELUDE
        + """
import numpy as np
import cupyx
inst = pkc.install("arena")
pp = inst.pinned_pool
h = cupyx.empty_pinned((1000,), dtype=np.float64)
assert pp.stats()["live_bytes"] == 8000, pp.stats()["live_bytes"]
h[:] = np.arange(1000)
d = cupy.asarray(h)
assert float(d.sum()) == 999 * 1000 / 2
cupy.cuda.Device(0).synchronize()
del h
gc.collect()
# CuPy may hold a pinned buffer until its copies' events complete; its next pinned allocation
# lets go of finished ones, so after it only that new byte is live.
tmp = cupyx.empty_pinned((1,), dtype=np.uint8)
assert pp.stats()["live_bytes"] == 1, pp.stats()["live_bytes"]
s = cupy.cuda.Stream(non_blocking=True)
out = d.get(stream=s)  # may stage through pinned memory
s.synchronize()
assert out.sum() == 999 * 1000 / 2
print("ok")
"""
    )


def test_pool_buffer_through_cuda_array_interface():
    run_isolated(
        PRELUDE
        + """
pool = pk.ArenaPool(pk.upstream.CudaDevice(0))
b = pool.buffer(4096)
a = cupy.asarray(b)  # __cuda_array_interface__
assert a.dtype == cupy.uint8 and a.size == 4096 and a.data.ptr == b.ptr
a[:] = 5
c = cupy.from_dlpack(b)
assert int(c.sum()) == 5 * 4096
del a, c
gc.collect()
cupy.cuda.Device(0).synchronize()
b.release()
assert pool.stats()["live_bytes"] == 0
print("ok")
"""
    )


def test_native_path_serves_the_default_stream_without_python_and_other_streams_in_order():
    out = run_isolated(
        PRELUDE
        + """
inst = pkc.install("arena", pinned=False, thread_cache_bytes=0)
print("path:", inst.path, "|", inst.notes["path"])
assert inst.path == "native", inst.notes
assert inst.native.c_stream_getter, inst.notes  # CuPy's exported C getter was found and accepted
xs = [cupy.empty(4096, dtype=cupy.uint8) for _ in range(100)]
st = inst.native.stats()
assert st["fast_allocs"] >= 99 and st["slow_allocs"] <= 1, st
assert type(xs[0].data.mem).__name__ == "CFunctionAllocatorMemory"
del xs
gc.collect()
assert inst.pools()[0].stats()["live_bytes"] == 0
# Another stream takes the slow path (test_frees_are_ordered_on_the_allocating_stream checks the
# pending state it leaves); the default stream's fast path must not be handed s's pending block.
s = cupy.cuda.Stream(non_blocking=True)
slow = inst.native.stats()["slow_allocs"]
with s:
    big = cupy.ones(1 << 20, dtype=cupy.float32)
    ptr, y = big.data.ptr, big * 2
    del big
    gc.collect()
assert inst.native.stats()["slow_allocs"] >= slow + 2
z = cupy.empty(4 << 20, dtype=cupy.uint8)  # the default stream: s's block only once s is done
assert z.data.ptr != ptr or s.done
assert float(y.sum()) == 2.0 * (1 << 20)
del y, z
gc.collect()
inst.pools()[0].synchronize()
assert inst.pools()[0].stats()["live_bytes"] == 0
inst.pools()[0].validate()
print("ok")
"""
    )
    assert "path: native" in out


def test_native_path_out_of_memory_is_cupys_error_and_the_pool_keeps_working():
    run_isolated(
        PRELUDE
        + """
inst = pkc.install("arena", pinned=False, limit=64 << 20)
assert inst.path == "native", inst.notes
keep = cupy.ones(1 << 20, dtype=cupy.uint8)
try:
    cupy.empty(128 << 20, dtype=cupy.uint8)
except cupy.cuda.memory.OutOfMemoryError as e:
    assert "limit" in e.poolkeeper_diagnosis, e.poolkeeper_diagnosis
    assert isinstance(e.__cause__, pk.OutOfMemoryError)
else:
    raise AssertionError("no error")
again = cupy.ones(1 << 20, dtype=cupy.uint8)
assert int(keep.sum()) + int(again.sum()) == 2 << 20
assert inst.pools()[0].stats()["ooms"] == 1
print("ok")
"""
    )
