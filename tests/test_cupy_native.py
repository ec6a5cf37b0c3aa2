"""poolkeeper as CuPy's allocator through CuPy's C function-pointer interface (issue 14), without a
GPU or cupy: a stand-in CuPy whose CFunctionAllocator calls the C functions with ctypes as CuPy
does (GIL held, the Python error indicator checked after malloc, free from the memory object's
destructor), over simulated pools."""
from __future__ import annotations

import ctypes
import gc
import sys
import types

import pytest

import poolkeeper as pk
from poolkeeper.integrations import cupy as pk_cupy

from test_integrations_cpu import fake_capture_stream, make_fake_cupy

# CuPy's contract: void* malloc(void* param, size_t size, int device_id);
# void free(void* param, void* ptr, int device_id). PYFUNCTYPE: the GIL stays held and the Python
# error indicator is checked after the call, as CuPy's Cython wrapper does.
MALLOC_FN = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
FREE_FN = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
GETTER_FN = ctypes.PYFUNCTYPE(ctypes.c_ssize_t)


def add_cfunction_allocator(cupy):
    cuda = cupy.cuda
    MemoryPointer = cuda.MemoryPointer
    made = {"memories": 0}

    class CFunctionAllocatorMemory:
        # Keeps the raw param and free function only, not the allocator object (as CuPy does).
        def __init__(self, size, param, malloc, free, device_id):
            self.size, self.device_id, self.ptr = size, device_id, 0
            self._param, self._free = param, free
            made["memories"] += 1
            if size > 0:
                self.ptr = malloc(param, size, device_id) or 0

        def __del__(self):
            if self.ptr:
                self._free(self._param, self.ptr, self.device_id)

    class CFunctionAllocator:
        def __init__(self, param, malloc_func, free_func, owner):
            self._param, self._owner = param, owner
            self._malloc, self._free = MALLOC_FN(malloc_func), FREE_FN(free_func)

        def malloc(self, size):
            mem = CFunctionAllocatorMemory(size, self._param, self._malloc, self._free, cuda.runtime.getDevice())
            return MemoryPointer(mem, 0)

    cuda.memory.CFunctionAllocator = CFunctionAllocator
    cupy.made = made
    return cupy


def add_c_stream_getter(cupy, monkeypatch):
    """cupy_backends.cuda.stream.__pyx_capi__['get_current_stream_ptr']: a capsule of a C function
    `intptr_t (void)` (here a ctypes callback reading the stand-in's current stream)."""
    calls = {"n": 0}

    def current():
        calls["n"] += 1
        return cupy.state["stream"]

    fn = GETTER_FN(current)
    name = b"intptr_t (void)"
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    cap = new(ctypes.cast(fn, ctypes.c_void_p).value, name, None)
    mod = types.ModuleType("cupy_backends.cuda.stream")
    mod.__pyx_capi__ = {"get_current_stream_ptr": cap}
    mod._keep = (fn, name)
    for n in ("cupy_backends", "cupy_backends.cuda"):
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.stream", mod)
    return calls


@pytest.fixture
def native_cupy(monkeypatch):
    c = add_cfunction_allocator(make_fake_cupy())
    monkeypatch.setitem(sys.modules, "cupy", c)
    monkeypatch.delenv("POOLKEEPER_CUPY_NATIVE", raising=False)
    yield c
    if pk_cupy.installation() is not None:
        pk_cupy.uninstall()


def sim_pool(**kw):
    sim = pk.upstream.Simulated(latency_us=0)
    return sim, pk.ArenaPool(sim, initial_backing=1 << 20, **kw)


def test_default_stream_allocations_run_no_python_allocator(native_cupy, monkeypatch):
    getter = add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    assert inst.path == "native" and inst.native.c_stream_getter, inst.notes
    alloc = native_cupy.state["allocator"]
    assert alloc == inst.allocator.cfunction_allocator.malloc  # CuPy calls the CFunctionAllocator
    first = alloc(1024)  # the device's pool is not known natively yet: the slow path registers it
    assert pool.stats()["live_bytes"] == 1024
    mps = [alloc(4096) for _ in range(5)]
    st = inst.native.stats()
    assert st["slow_allocs"] == 1 and st["fast_allocs"] == 5, st
    assert inst.allocator.calls == 1  # the Python allocator ran once, for the first request only
    assert inst.calls == 6
    assert getter["n"] == 6  # the current stream was read through the C getter every time
    assert all(m.mem.device_id == 0 and m.mem.size == 4096 for m in mps)
    assert pool.stats()["live_bytes"] == 1024 + 5 * 4096
    del mps, first
    gc.collect()
    st = inst.native.stats()
    assert st["fast_frees"] == 5 and st["slow_frees"] == 1 and st["live_blocks"] == 0, st
    assert pool.stats()["live_bytes"] == 0
    pool.validate()


def test_without_cupys_c_getter_the_stream_is_read_in_python(native_cupy):
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    assert inst.path == "native" and not inst.native.c_stream_getter
    a = native_cupy.state["allocator"]
    x, y = a(100), a(100)
    assert inst.native.stats()["fast_allocs"] == 1
    del x, y


def test_a_block_freed_on_a_stream_waits_for_it_before_the_default_stream_reuses_it(native_cupy, monkeypatch):
    add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    alloc = native_cupy.state["allocator"]
    warm = alloc(64)  # registers the pool for the fast path
    s = sim.stream()
    native_cupy.state["stream"] = s  # with cupy.cuda.Stream(): ...
    mp = alloc(4096)
    on_s = mp.ptr
    assert inst.native.stats()["slow_allocs"] == 2  # another stream: the slow path, ordered on s
    sim.enqueue(s, 50.0)  # work on s still uses the block
    native_cupy.state["stream"] = 0
    del mp
    gc.collect()
    assert pool.stats()["pending_bytes"] == 4096  # freed on s, not reusable elsewhere yet
    other = alloc(4096)  # the default stream, fast path: must not get s's block
    assert other.ptr != on_s
    assert inst.native.stats()["fast_allocs"] == 1
    sim.advance(100.0)
    pool.process_pending()
    assert pool.stats()["pending_bytes"] == 0
    del other, warm
    gc.collect()
    assert pool.stats()["live_bytes"] == 0
    pool.validate()


def test_default_stream_reuses_its_own_block_at_once(native_cupy, monkeypatch):
    add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool()
    pk_cupy.install(pool, pinned=False)
    alloc = native_cupy.state["allocator"]
    alloc(64)
    p = alloc(8192).ptr  # dropped at once: freed on stream 0
    gc.collect()
    assert alloc(8192).ptr == p  # same stream: stream order already covers the reuse


def test_oom_on_the_fast_path_is_cupys_error_with_our_diagnosis_counted_once(native_cupy, monkeypatch):
    add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool(limit=1 << 20)
    inst = pk_cupy.install(pool, pinned=False)
    alloc = native_cupy.state["allocator"]
    keep = alloc(64)
    with pytest.raises(MemoryError) as e:
        alloc(4 << 20)
    assert type(e.value) is native_cupy.cuda.memory.OutOfMemoryError
    assert isinstance(e.value.__cause__, pk.OutOfMemoryError)
    assert "limit" in e.value.poolkeeper_diagnosis
    assert pool.stats()["ooms"] == 1  # the request was tried once, not again through the slow path
    assert inst.native.stats()["live_blocks"] == 1
    again = alloc(4096)  # the pool keeps working
    assert pool.stats()["live_bytes"] == 64 + 4096
    del keep, again


def test_blocks_outliving_the_installation_return_to_their_pool(native_cupy, monkeypatch):
    add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    alloc = native_cupy.state["allocator"]
    a, b = alloc(64), alloc(2048)  # one slow, one fast
    pk_cupy.uninstall()
    native_cupy.state["allocator"] = None
    del inst, alloc
    gc.collect()  # the allocator objects are gone; CuPy's memory objects still hold the raw param
    assert pool.stats()["live_bytes"] == 64 + 2048
    del a
    gc.collect()
    del b
    gc.collect()
    assert pool.stats()["live_bytes"] == 0
    pool.validate()


def test_a_pool_serving_every_device_is_registered_per_device(native_cupy, monkeypatch):
    add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    alloc = native_cupy.state["allocator"]
    x = [alloc(128) for _ in range(2)]
    monkeypatch.setattr(native_cupy.cuda.runtime, "getDevice", lambda: 3)
    x += [alloc(128) for _ in range(2)]
    st = inst.native.stats()
    assert st["slow_allocs"] == 2 and st["fast_allocs"] == 2  # one slow request per device
    assert all(m.mem.device_id in (0, 3) for m in x)
    del x
    gc.collect()
    assert pool.stats()["live_bytes"] == 0


def test_python_path_on_request(native_cupy, monkeypatch):
    monkeypatch.setenv("POOLKEEPER_CUPY_NATIVE", "0")
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    assert inst.path == "python" and native_cupy.state["allocator"] is inst.allocator
    mp = native_cupy.state["allocator"](512)
    assert pool.stats()["live_bytes"] == 512
    del mp


def test_graph_capture_scope_takes_the_slow_path(native_cupy, monkeypatch):
    add_c_stream_getter(native_cupy, monkeypatch)
    sim, pool = sim_pool()
    inst = pk_cupy.install(pool, pinned=False)
    alloc = native_cupy.state["allocator"]
    s = sim.stream()
    outside = alloc(4096)
    with pk_cupy.graph_capture(fake_capture_stream(native_cupy, sim, s)) as g:
        native_cupy.state["stream"] = 0
        default_inside = alloc(1000)  # the default stream while capturing: still not fast (scope open)
        native_cupy.state["stream"] = s
        out = alloc(100_000)
    gp = inst.allocator.graphs[0]
    assert gp.owns_private(out.ptr) and not gp.owns_private(outside.ptr)
    assert not gp.owns_private(default_inside.ptr)
    after = alloc(100_000)  # scope closed, default stream: fast again
    assert not gp.owns_private(after.ptr)
    st = inst.native.stats()
    assert st["slow_allocs"] == 3 and st["fast_allocs"] == 1, st
    del g, out, after, outside, default_inside
    gc.collect()
    gp.validate()
    pool.validate()
    assert pool.stats()["live_bytes"] == 0


def test_native_allocator_rejects_what_is_not_a_pool():
    from poolkeeper import _core

    a = _core.CupyAllocator(lambda size, dev: (0, None), lambda e, n: None, lambda: 0)
    with pytest.raises(pk.errors.InvalidArgumentError):
        a.set_pool(0, object())
    with pytest.raises(pk.errors.InvalidArgumentError):
        a.set_pool(-1, pk.ArenaPool(pk.upstream.Simulated(latency_us=0)))
    assert a.stats()["live_blocks"] == 0 and a.malloc_address and a.free_address and a.param


# Cython's calling convention around CuPy's malloc pointer: the pointer type is declared `except +`
# and the function calling it `except *`, which Cython 3 compiles as "result == -1 and an error is
# set". A malloc that returned NULL with an error set went unnoticed there; ours returns (void*)-1.
CYTHON_CALLER = """
# distutils: language = c++
from libc.stdint cimport intptr_t
ctypedef void*(*malloc_t)(void*, size_t, int) except +
cdef intptr_t call_malloc(intptr_t param, intptr_t fn, size_t n) except *:
    return <intptr_t>((<malloc_t>fn)(<void*>param, n, 0))
def malloc(intptr_t param, intptr_t fn, size_t n):
    cdef intptr_t p = call_malloc(param, fn, n)
    return p
"""


def test_errors_reach_python_through_cythons_except_star_caller(tmp_path, monkeypatch):
    pytest.importorskip("Cython")
    import importlib
    import shutil
    import subprocess

    if shutil.which("cythonize") is None or (shutil.which("c++") is None and shutil.which("g++") is None):
        pytest.skip("needs cythonize and a C++ compiler")
    (tmp_path / "cycaller.pyx").write_text(CYTHON_CALLER)
    r = subprocess.run(["cythonize", "-i", "-q", "cycaller.pyx"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"building the Cython caller failed: {r.stderr[-300:]}")
    monkeypatch.syspath_prepend(str(tmp_path))
    cy = importlib.import_module("cycaller")
    from poolkeeper import _core

    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0), limit=1 << 20)

    def slow(size, device):
        raise LookupError("slow path refused")

    def on_error(e, size):
        raise MemoryError(f"converted {size}") from e

    nat = _core.CupyAllocator(slow, on_error, lambda: 0)
    with pytest.raises(LookupError):  # no pool known for device 0 yet: the slow path's error
        cy.malloc(nat.param, nat.malloc_address, 100)
    nat.set_pool(0, pool)
    p = cy.malloc(nat.param, nat.malloc_address, 1000)
    assert p and pool.stats()["live_bytes"] == 1000
    with pytest.raises(MemoryError, match="converted 4194304") as e:
        cy.malloc(nat.param, nat.malloc_address, 4 << 20)
    assert isinstance(e.value.__cause__, pk.OutOfMemoryError)
    FREE_FN(nat.free_address)(nat.param, p, 0)  # as CuPy's memory object does when it goes
    assert pool.stats()["live_bytes"] == 0 and nat.stats()["live_blocks"] == 0
