"""The PyTorch and CuPy integrations without a GPU (and without torch or cupy installed).

PyTorch's side is played by a stand-in module that does what torch.cuda.memory does with the
names it is given (ctypes-loads the library, resolves the symbols, hands hook addresses to the
allocator object); the allocator calls PyTorch would make are then made through those very
function pointers with PyTorch's signatures, over a simulated device. CuPy's side is a stand-in
with CuPy's allocator interface. The real frameworks are exercised in tests/gpu/.
"""
from __future__ import annotations

import ctypes
import gc
import subprocess
import sys
import types

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.integrations import _common
from poolkeeper.integrations import cupy as pk_cupy
from poolkeeper.integrations import torch as pk_torch

# PyTorch's pluggable-allocator signatures.
MALLOC_T = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
RECORD_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
RESET_T = ctypes.CFUNCTYPE(None)

EXPORTED = [
    "poolkeeper_torch_malloc",
    "poolkeeper_torch_free",
    "poolkeeper_torch_record_stream",
    "poolkeeper_empty_cache",
    "poolkeeper_malloc",
    "poolkeeper_free",
    "poolkeeper_last_error",
    "poolkeeper_torch_malloc_raising",
    "poolkeeper_torch_record_stream_hook",
    "poolkeeper_torch_empty_cache_hook",
    "poolkeeper_torch_hook_counters",
    "poolkeeper_set_call_timing",
    "poolkeeper_call_timing",
]


def address(name):
    return ctypes.cast(getattr(ctypes.CDLL(_core.__file__), name), ctypes.c_void_p).value


# -- a stand-in for torch -------------------------------------------------------------------------


class FakeNativeAllocator:
    def __init__(self, with_hooks=True):
        self.set = {}
        if with_hooks:
            self.set_record_stream_fn = lambda p: self.set.__setitem__("record_stream", p)
            self.set_reset_fn = lambda p: self.set.__setitem__("reset", p)
            self.set_begin_allocate_to_pool = lambda p: self.set.__setitem__("graph_begin", p)
            self.set_end_allocate_to_pool_fn = lambda p: self.set.__setitem__("graph_end", p)
            self.set_release_pool = lambda p: self.set.__setitem__("graph_release", p)


class FakePluggableAllocator:
    with_hooks = True

    def __init__(self, path, alloc_fn_name, free_fn_name):
        lib = ctypes.CDLL(path)  # what torch does: fails if the names are not exported
        self.alloc = ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value
        self.free = ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value
        self._native = FakeNativeAllocator(self.with_hooks)

    def allocator(self):
        self._native._pluggable_alloc = self.alloc
        return self._native

    # What PyTorch does with the pointers it was given.
    def malloc(self, size, device, stream):
        return MALLOC_T(self.alloc)(size, device, stream)

    def free_(self, ptr, size, device, stream):
        FREE_T(self.free)(ptr, size, device, stream)

    def record_stream(self, ptr, stream):
        RECORD_T(self._native.set["record_stream"])(ptr, stream)

    def empty_cache(self):
        RESET_T(self._native.set["reset"])()


class FakeMemPool:
    def __init__(self, allocator=None, use_on_oom=False):
        self.allocator = allocator


def make_fake_torch(initialized=False, swap_error=None, with_hooks=True):
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")
    torch.cuda, cuda.memory = cuda, memory
    cuda.is_initialized = lambda: initialized
    cuda.current_device = lambda: 0
    cuda.MemPool = FakeMemPool
    def unsupported(*a):
        raise RuntimeError("pluggable does not yet support this")

    torch._C = types.SimpleNamespace(_cuda_customAllocator=object(), _cuda_checkPoolLiveAllocations=unsupported, _cuda_getCheckpointState=unsupported,
                                     _cuda_setCheckpointPoolState=unsupported)
    swaps = []

    class Pluggable(FakePluggableAllocator):
        pass

    Pluggable.with_hooks = with_hooks
    memory.CUDAPluggableAllocator = Pluggable

    def change_current_allocator(a):
        if swap_error:
            raise RuntimeError(swap_error)
        swaps.append(a)

    memory.change_current_allocator = change_current_allocator
    torch.swaps = swaps
    return torch


@pytest.fixture
def fake_torch(monkeypatch):
    monkeypatch.setenv("POOLKEEPER_TORCH_OOM_SHIM", "0")  # the stand-in has no headers to build a shim against

    def use(**kw):
        t = make_fake_torch(**kw)
        monkeypatch.setitem(sys.modules, "torch", t)
        monkeypatch.setitem(sys.modules, "torch.cuda", t.cuda)
        monkeypatch.setitem(sys.modules, "torch.cuda.memory", t.cuda.memory)
        return t

    pk_torch._forget_for_tests()
    yield use
    pk_torch._forget_for_tests()


# -- the C symbols ------------------------------------------------------------------------------


def test_c_symbols_are_exported_from_the_core_module():
    lib = ctypes.CDLL(pk_torch.library_path())
    for name in EXPORTED:
        assert getattr(lib, name), name
    assert pk_torch.library_path() == _core.__file__


def test_importing_poolkeeper_imports_no_framework():
    code = (
        "import sys, poolkeeper, poolkeeper.buffers, poolkeeper.integrations.torch, poolkeeper.integrations.cupy\n"
        "bad = [m for m in ('torch', 'cupy', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- install(): wiring and refusals ----------------------------------------------------------------


def test_install_without_torch_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(_common.MissingDependencyError, match=r"pip install torch\b") as e:
        pk_torch.install()
    assert isinstance(e.value, ImportError) and isinstance(e.value, pk.PoolkeeperError)
    assert not _core.registry_has_factory()


def test_install_wires_our_symbols_and_hooks(fake_torch):
    t = fake_torch()
    inst = pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20)
    (alloc,) = t.swaps
    assert alloc.alloc == address("poolkeeper_torch_malloc_raising")
    assert alloc.free == address("poolkeeper_torch_free")
    assert alloc.allocator().set == {
        "record_stream": address("poolkeeper_torch_record_stream_hook"),
        "reset": address("poolkeeper_torch_empty_cache_hook"),
        "graph_begin": address("poolkeeper_torch_begin_allocate_to_pool"),
        "graph_end": address("poolkeeper_torch_end_allocate_to_pool"),
        "graph_release": address("poolkeeper_torch_release_pool"),
    }
    assert inst.hooks == {"record_stream": True, "empty_cache": True, "graph_begin": True, "graph_end": True,
                          "graph_release": True}
    assert pk_torch.installation() is inst and _core.registry_has_factory()


def test_install_answers_check_pool_live_allocations_from_our_graph_pools(fake_torch):
    # torch.compile's CUDA-graph trees call torch._C._cuda_checkPoolLiveAllocations, which a
    # pluggable allocator cannot serve ("pluggable does not yet support ..."): install() answers it.
    t = fake_torch()
    pk_torch.install("arena", upstream="simulated")
    check = t._C._cuda_checkPoolLiveAllocations
    assert check is pk_torch.check_pool_live_allocations
    pool = _core.registry_get(0) or _core.graph_pools(0).pool
    gp = _core.graph_pools(0)
    gp.begin((4, 0), None)
    a = gp.allocate(1000)
    b = gp.allocate(5000)
    gp.end((4, 0))
    assert check(0, (4, 0), {a, b}) is True
    assert check(0, (4, 0), {a}) is False  # b is alive in the pool but not expected
    assert check(0, (5, 0), set()) is True  # a pool that holds nothing
    state = t._C._cuda_getCheckpointState(0, (4, 0))
    assert state.live_blocks == {a, b}
    with pytest.raises(_common.IntegrationError, match="cudagraph_trees = False"):
        t._C._cuda_setCheckpointPoolState(0, state, [], [])
    gp.deallocate(a)
    gp.deallocate(b)
    assert check(0, (4, 0), set()) is True
    gp.validate()
    pool.validate()


def test_hooks_missing_from_torch_are_reported_not_faked(fake_torch):
    fake_torch(with_hooks=False)
    inst = pk_torch.install("arena", upstream="simulated")
    assert inst.hooks == {"record_stream": False, "empty_cache": False, "graph_begin": False, "graph_end": False,
                          "graph_release": False}


def test_install_after_cuda_initialized_is_refused_and_explained(fake_torch):
    t = fake_torch(initialized=True)
    with pytest.raises(_common.AllocatorInitializedError, match="before CUDA is initialized") as e:
        pk_torch.install()
    assert "use_mempool" in str(e.value)
    assert t.swaps == [] and not _core.registry_has_factory() and pk_torch.installation() is None


def test_torch_refusing_the_swap_becomes_our_error(fake_torch):
    fake_torch(swap_error="Can't swap an already initialized allocator")
    with pytest.raises(_common.AllocatorInitializedError, match="PyTorch said"):
        pk_torch.install("arena", upstream="simulated")
    assert not _core.registry_has_factory() and pk_torch.installation() is None


def test_bad_option_installs_nothing(fake_torch):
    t = fake_torch()
    with pytest.raises(pk.InvalidArgumentError, match="max_bakcing"):
        pk_torch.install("arena", upstream="simulated", max_bakcing=1 << 30)
    assert t.swaps == [] and not _core.registry_has_factory()


def test_second_install_same_is_idempotent_different_is_refused(fake_torch):
    t = fake_torch()
    a = pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20)
    assert pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20) is a
    with pytest.raises(_common.IntegrationError, match="already PyTorch's allocator"):
        pk_torch.install("size_class", upstream="simulated")
    assert len(t.swaps) == 1


# -- what PyTorch's calls do once installed -------------------------------------------------------


def test_pytorch_calls_reach_lazily_made_per_device_pools(fake_torch):
    t = fake_torch()
    pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20)
    (alloc,) = t.swaps
    assert pk_torch.pools() == {}
    with pytest.raises(_common.IntegrationError, match="nothing has been allocated"):
        pk_torch.stats()
    p = alloc.malloc(1 << 16, 1, None)
    assert p and set(pk_torch.pools()) == {1}
    assert pk_torch.stats(1)["live_bytes"] == 1 << 16
    assert pk_torch.stats()["live_bytes"] == 1 << 16  # the only device is the default
    q = alloc.malloc(4096, 3, None)
    assert set(pk_torch.pools()) == {1, 3}
    assert alloc.malloc(0, 1, None) is None  # PyTorch's convention for empty tensors
    alloc.free_(p, 1 << 16, 1, None)
    alloc.free_(q, 4096, 3, None)
    assert pk_torch.stats(1)["live_bytes"] == 0 and pk_torch.stats(3)["live_bytes"] == 0
    snap = pk_torch.snapshot(1)
    assert snap.to_dict()["backings"]
    for pool in pk_torch.pools().values():
        pool.validate()


def test_record_stream_hook_delays_reuse_until_that_stream_is_done(fake_torch):
    t = fake_torch()
    pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20)
    (alloc,) = t.swaps
    before = pk_torch.hook_counters()
    alloc_stream, side = 5, 9
    p = alloc.malloc(8192, 0, alloc_stream)
    sim = pk_torch.pools()[0].upstream
    alloc.record_stream(p, side)  # tensor.record_stream(side_stream)
    sim.enqueue(side, 100.0)  # the side stream still works on the tensor
    alloc.free_(p, 8192, 0, alloc_stream)
    assert pk_torch.stats(0)["pending_bytes"] == 8192
    sim.advance(1000.0)
    pk_torch.pools()[0].process_pending()
    assert pk_torch.stats(0)["pending_bytes"] == 0
    alloc.record_stream(0xDEAD0000, side)  # not ours: ignored and counted
    after = pk_torch.hook_counters()
    assert after["record_stream"] == before["record_stream"] + 1
    assert after["record_stream_unowned"] == before["record_stream_unowned"] + 1


def test_call_timing_counts_the_calls_torch_makes_only_while_on(fake_torch):
    t = fake_torch()
    pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20)
    (alloc,) = t.swaps
    assert pk_torch.call_timing()["enabled"] is False  # off by default
    before = pk_torch.call_timing()
    alloc.free_(alloc.malloc(4096, 0, None), 4096, 0, None)
    assert {k: v for k, v in pk_torch.call_timing().items()} == before  # off: nothing counted
    try:
        assert pk_torch.call_timing(True)["enabled"] is True
        ptrs = [alloc.malloc(n, 0, None) for n in (256, 4096, 3 << 20)]
        alloc.free_(ptrs[0], 256, 0, None)
        on = pk_torch.call_timing()
        assert on["enabled"] is True
        assert on["malloc_calls"] == before["malloc_calls"] + 3 and on["free_calls"] == before["free_calls"] + 1
        assert on["malloc_ns"] > before["malloc_ns"] and on["free_ns"] > before["free_ns"]
    finally:
        assert pk_torch.call_timing(False)["enabled"] is False
    for p, n in zip(ptrs[1:], (4096, 3 << 20)):
        alloc.free_(p, n, 0, None)
    after = pk_torch.call_timing()
    assert after["free_calls"] == on["free_calls"] and after["malloc_calls"] == on["malloc_calls"]


@pytest.mark.parametrize("bad", ["no", "False", 1, -1, 0.0, float("nan")])
def test_call_timing_takes_only_a_bool_or_none(bad):
    # Found in review: "no" and -1 were read as True and turned timing on.
    from poolkeeper.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        pk_torch.call_timing(bad)
    assert pk_torch.call_timing()["enabled"] is False


def test_empty_cache_hook_returns_free_backings(fake_torch):
    t = fake_torch()
    pk_torch.install("arena", upstream="simulated", initial_backing=1 << 20, max_backing=1 << 22)
    (alloc,) = t.swaps
    before = pk_torch.hook_counters()["empty_cache"]
    keep = alloc.malloc(4096, 0, None)
    big = alloc.malloc(64 << 20, 0, None)  # oversize: its own backing
    alloc.free_(big, 64 << 20, 0, None)
    reserved = pk_torch.stats(0)["reserved_bytes"]
    assert reserved >= 64 << 20
    alloc.empty_cache()  # torch.cuda.empty_cache()
    assert pk_torch.stats(0)["reserved_bytes"] <= reserved - (64 << 20)
    assert pk_torch.hook_counters()["empty_cache"] == before + 1
    alloc.free_(keep, 4096, 0, None)


def test_install_with_an_existing_pool_serves_its_device(fake_torch, monkeypatch):
    t = fake_torch()
    pool = pk.SizeClassPool(pk.upstream.Simulated(latency_us=0))
    # install() refuses a simulated pool (test_reliability_py); no CUDA device here, so the check
    # is told this one stands for device 0's pool.
    monkeypatch.setattr(pk_torch, "_check_device_pool", lambda p: 0)
    inst = pk_torch.install(pool)
    (alloc,) = t.swaps
    assert _core.registry_get(0) is pool
    assert not _core.registry_has_factory()
    assert pk_torch.install(pool) is inst and len(t.swaps) == 1  # the same pool: the same installation


# -- mempool() ------------------------------------------------------------------------------------


def test_mempool_gets_a_pluggable_allocator_over_our_symbols(fake_torch):
    fake_torch()
    mp = pk_torch.mempool("arena", upstream="simulated")
    assert isinstance(mp, FakeMemPool)
    # MemPool segments come through PyTorch's native allocator, which checks for NULL itself
    assert mp.allocator._pluggable_alloc == address("poolkeeper_torch_malloc")
    assert _core.registry_has_factory()
    mp2 = pk_torch.mempool("arena", upstream="simulated")
    assert mp2.allocator is mp.allocator  # one allocator per process
    with pytest.raises(_common.IntegrationError, match="already"):
        pk_torch.mempool("size_class", upstream="simulated")
    with pytest.raises(_common.IntegrationError, match="mempool"):
        pk_torch.install("arena", upstream="simulated")


def test_mempool_after_install_is_refused(fake_torch):
    fake_torch()
    pk_torch.install("arena", upstream="simulated")
    with pytest.raises(_common.IntegrationError, match="native allocator"):
        pk_torch.mempool()


# -- a stand-in for cupy --------------------------------------------------------------------------


def make_fake_cupy(device=0):
    cupy = types.ModuleType("cupy")
    cuda = types.SimpleNamespace()
    cupy.cuda = cuda
    state = {"allocator": "cupy-default", "pinned": "cupy-default-pinned", "stream": 0}

    class Memory:
        def __init__(self, size):
            self.ptr, self.size = 0, size

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=None):
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class PinnedMemory(Memory):
        pass

    class PinnedMemoryPointer(MemoryPointer):
        pass

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__(f"Out of memory allocating {size} bytes (allocated so far: {total} bytes)")

    cuda.memory = types.SimpleNamespace(Memory=Memory, OutOfMemoryError=OutOfMemoryError)
    cuda.MemoryPointer, cuda.UnownedMemory = MemoryPointer, UnownedMemory
    cuda.PinnedMemory, cuda.PinnedMemoryPointer = PinnedMemory, PinnedMemoryPointer
    cuda.runtime = types.SimpleNamespace(getDevice=lambda: device)
    cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=state["stream"])
    cuda.get_allocator = lambda: state["allocator"]
    cuda.set_allocator = lambda a=None: state.__setitem__("allocator", a)
    cuda.set_pinned_memory_allocator = lambda a=None: state.__setitem__("pinned", a)
    cupy.get_default_pinned_memory_pool = lambda: types.SimpleNamespace(malloc="cupy-default-pinned")
    cupy.state = state
    return cupy


def fake_capture_stream(cupy, sim, s):
    """A stand-in cupy.cuda.Stream over simulated stream ``s``: a context manager making it
    current, and CUDA-graph capture calls."""

    class FakeStream:
        ptr = s

        def __enter__(self):
            cupy.state["stream"] = s
            return self

        def __exit__(self, *exc):
            cupy.state["stream"] = 0

        def begin_capture(self):
            sim.begin_capture(s)

        def end_capture(self):
            assert sim.end_capture(s), sim.last_capture_violation
            return "graph"

    return FakeStream()


@pytest.fixture
def fake_cupy(monkeypatch):
    c = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", c)
    yield c
    if pk_cupy.installation() is not None:
        pk_cupy.uninstall()


def test_cupy_install_without_cupy_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(_common.MissingDependencyError, match=r"pip install cupy-cuda12x"):
        pk_cupy.install(pk.ArenaPool(pk.upstream.Simulated(latency_us=0)), pinned=False)


def test_cupy_allocations_come_from_our_pool_and_free_on_collection(fake_cupy):
    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0), initial_backing=1 << 20)
    pinned = pk.ArenaPool(pk.upstream.Host(), initial_backing=1 << 20)
    inst = pk_cupy.install(pool, pinned=pinned)
    alloc, palloc = fake_cupy.state["allocator"], fake_cupy.state["pinned"]
    assert alloc is inst.allocator and palloc is inst.pinned_allocator
    mp = alloc(1024)
    assert mp.ptr == mp.mem.ptr and mp.mem.size == 1024 and mp.mem.device_id == 0
    assert pool.stats()["live_bytes"] == 1024
    del mp
    gc.collect()
    assert pool.stats()["live_bytes"] == 0
    z = alloc(0)
    assert z.mem.size == 0 and pool.stats()["live_blocks"] == 0
    pp = palloc(3000)
    assert pinned.stats()["live_bytes"] == 3000 and int(pp.mem) == pp.ptr
    del pp
    gc.collect()
    assert pinned.stats()["live_bytes"] == 0


def test_cupy_free_is_ordered_on_the_allocating_stream(fake_cupy):
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=1 << 20)
    pk_cupy.install(pool, pinned=False)
    s = sim.stream()
    fake_cupy.state["stream"] = s  # with cupy.cuda.Stream(): ...
    mp = fake_cupy.state["allocator"](4096)
    sim.enqueue(s, 50.0)
    fake_cupy.state["stream"] = 0
    del mp
    gc.collect()
    assert pool.stats()["pending_bytes"] == 4096
    sim.advance(100.0)
    pool.process_pending()
    assert pool.stats()["pending_bytes"] == 0


def test_cupy_oom_is_cupys_error_with_our_diagnosis(fake_cupy):
    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0), initial_backing=1 << 20, limit=1 << 20)
    pk_cupy.install(pool, pinned=False)
    with pytest.raises(MemoryError) as e:
        fake_cupy.state["allocator"](4 << 20)
    assert type(e.value) is fake_cupy.cuda.memory.OutOfMemoryError
    assert isinstance(e.value.__cause__, pk.OutOfMemoryError)
    assert "limit" in e.value.poolkeeper_diagnosis


def test_cupy_uninstall_restores_previous_allocators(fake_cupy):
    pk_cupy.install(pk.ArenaPool(pk.upstream.Simulated(latency_us=0)), pinned=pk.ArenaPool(pk.upstream.Host()))
    with pytest.raises(_common.IntegrationError, match="uninstall"):
        pk_cupy.install(pk.ArenaPool(pk.upstream.Simulated(latency_us=0)))
    pk_cupy.uninstall()
    assert fake_cupy.state["allocator"] == "cupy-default"
    assert fake_cupy.state["pinned"] == "cupy-default-pinned"
    assert pk_cupy.installation() is None
    pk_cupy.uninstall()  # not installed: nothing happens


def test_cupy_block_outliving_uninstall_still_returns_to_its_pool(fake_cupy):
    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0))
    pk_cupy.install(pool, pinned=False)
    mp = fake_cupy.state["allocator"](2048)
    pk_cupy.uninstall()
    assert pool.stats()["live_bytes"] == 2048
    del mp
    gc.collect()
    assert pool.stats()["live_bytes"] == 0


def test_cupy_pool_for_one_device_refuses_another(fake_cupy, monkeypatch):
    class DevicePool:  # a pool whose upstream is device 0
        upstream = types.SimpleNamespace(device=0)

    monkeypatch.setattr(fake_cupy.cuda.runtime, "getDevice", lambda: 1)
    pk_cupy.install(DevicePool(), pinned=False)
    with pytest.raises(_common.IntegrationError, match="device 0, not device 1"):
        fake_cupy.state["allocator"](64)


def test_cupy_graph_capture_allocates_from_a_private_pool_released_with_the_graph(fake_cupy):
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=1 << 20)
    pk_cupy.install(pool, pinned=False)
    alloc = fake_cupy.state["allocator"]
    s = sim.stream()
    outside = alloc(4096)
    with pk_cupy.graph_capture(fake_capture_stream(fake_cupy, sim, s)) as g:
        tmp = alloc(100_000)  # freed inside the capture
        tmp_ptr = tmp.ptr
        del tmp
        gc.collect()
        out = alloc(100_000)
    assert g.graph == "graph" and sim.capture_violations == 0
    gp = pk_cupy.installation().allocator.graphs[0]
    assert gp.owns_private(out.ptr) and not gp.owns_private(outside.ptr)
    assert out.ptr == tmp_ptr  # reused inside the capture, on the capturing stream
    after = alloc(100_000)  # outside the capture: never a graph address
    assert not gp.owns_private(after.ptr)
    gp.validate()
    del g
    gc.collect()  # the graph is gone: its pool is released, and closes with its last block
    assert [i["released"] for i in gp.info()] == [True]
    del out, after, outside
    gc.collect()
    assert gp.info() == []
    gp.validate()
    pool.validate()
    assert pool.stats()["live_bytes"] == 0


def test_regression_cupy_allocations_from_several_threads_on_many_streams_raised_dictionary_changed_size(fake_cupy):
    # Found by hostile probing: the allocator keeps every stream it ordered a block on, and prunes
    # that table once it holds 32; the prune walked the table while other threads' allocations
    # added to it, and CuPy's allocation failed with a bare RuntimeError ("dictionary changed size
    # during iteration"; 1 run in 6 of 8 threads on 40 streams each). Here the thread switch is
    # made to happen during the walk: a stream handle whose comparison lets another thread
    # allocate on a new stream.
    import threading

    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim)
    current = threading.local()
    fake_cupy.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=getattr(current, "stream", 0))
    alloc = pk_cupy.install(pool, pinned=False).cupy_allocator
    switched = []

    def allocate_on_a_new_stream():
        current.stream = sim.stream()
        switched.append(alloc(256))

    class Handle(int):
        __hash__ = int.__hash__

        def __ne__(self, other):
            if not switched:
                t = threading.Thread(target=allocate_on_a_new_stream)
                t.start()
                t.join()
            return int.__ne__(self, other)

    kept = []
    for _ in range(40):
        current.stream = Handle(sim.stream())
        kept.append(alloc(4096))
    assert len(kept) == 40
    errors = []

    def many_streams():
        streams = [sim.stream() for _ in range(40)]
        held = []
        try:
            for i in range(400):
                current.stream = streams[i % 40]
                held.append(alloc(256))
                if len(held) > 8:
                    held.pop(0)
        except BaseException as e:  # noqa: BLE001 - any error is the failure
            errors.append(repr(e))

    threads = [threading.Thread(target=many_streams) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert alloc.calls == 40 + len(switched) + 4 * 400
    del kept, switched
    gc.collect()
    pool.synchronize()
    pool.validate()


def test_regression_torch_graph_pools_before_any_device_pool_raised_min_of_an_empty_sequence(fake_torch):
    # Found by hostile probing: graph_pools() picks the current device among the pools made so
    # far, and with none it raised min()'s bare ValueError; a device that is not an int (or does
    # not fit 64 bits) was nanobind's TypeError.
    from poolkeeper.errors import InvalidArgumentError

    assert pk_torch.graph_pools() == []
    for bad in ("0", 10**30, [0]):
        with pytest.raises(InvalidArgumentError, match="device"):
            pk_torch.graph_pools(bad)
        with pytest.raises(InvalidArgumentError, match="device"):
            pk_torch.check_pool_live_allocations(bad, (1, 0), [])
    _core.registry_set(0, pk.ArenaPool(pk.upstream.Simulated(latency_us=0)))
    with pytest.raises(InvalidArgumentError, match="device"):
        pk_torch.stats([0])
    assert pk_torch.graph_pools() == [] and pk_torch.stats(0)["live_bytes"] == 0


@pytest.mark.parametrize("upstream", [[], {}, ["device"]])
def test_regression_an_upstream_name_that_is_a_list_raised_unhashable_type_error(upstream):
    # Found by hostile probing (WorkerPoolSpec, PoolkeeperSetup, runtime_env, install paths all
    # resolve the name here).
    from poolkeeper.errors import InvalidArgumentError
    from poolkeeper.pools import resolve_cuda_upstream, resolve_upstream

    with pytest.raises(InvalidArgumentError, match="unknown upstream"):
        resolve_upstream("arena", upstream)
    with pytest.raises(InvalidArgumentError, match="unknown upstream"):
        resolve_cuda_upstream("arena", upstream)


def test_regression_cupy_install_took_any_pool_or_pinned_value_and_left_bad_options_to_the_first_allocation(fake_cupy):
    # Found by hostile probing: install(3) raised a bare AttributeError; pinned=3 and a misspelt
    # pool option were accepted, and every CuPy allocation after them failed.
    from poolkeeper.errors import InvalidArgumentError

    for bad in (3, None, []):
        with pytest.raises(InvalidArgumentError, match="pool must be"):
            pk_cupy.install(bad, pinned=False)
    with pytest.raises(InvalidArgumentError, match="pinned must be"):
        pk_cupy.install(pk.ArenaPool(pk.upstream.Simulated(latency_us=0)), pinned=3)
    with pytest.raises(InvalidArgumentError, match="unknown option 'max_bakcing'"):
        pk_cupy.install("arena", upstream="simulated", pinned=False, max_bakcing=1 << 20)
    assert pk_cupy.installation() is None and fake_cupy.state["allocator"] == "cupy-default"


def test_regression_cupy_graph_capture_with_a_bad_pool_id_raised_again_at_collection(fake_cupy, monkeypatch):
    # Found by hostile probing: the captured graph, whose finalizer releases its pool id, was made
    # before the id was checked, so a refused id was released again when the graph was collected
    # ("Exception ignored in: <finalize object>"); pool=3 was tuple()'s bare TypeError.
    from poolkeeper.errors import InvalidArgumentError

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim)
    inst = pk_cupy.install(pool, pinned=False)
    fake_cupy.cuda.Stream = lambda non_blocking=True: fake_capture_stream(fake_cupy, sim, sim.stream())
    for bad in (3, (-1, 0), (1, 2, 3), ("a", "b"), (10**30, 0)):
        with pytest.raises(InvalidArgumentError):
            with pk_cupy.graph_capture(pool=bad):
                pass
        gc.collect()
    assert unraisable == []
    gp = inst.allocator.graph_pools(0)
    assert not gp.routing and gp.info() == []
    with pk_cupy.graph_capture(pool=(7, 0)) as g:
        fake_cupy.state["allocator"](4096)
    assert g.graph == "graph"
    g.release()
    gc.collect()
    pool.synchronize()
    pool.validate()


def test_regression_cupy_uninstall_on_another_thread_during_an_allocation_raised_attribute_error(fake_cupy, monkeypatch):
    # Found by hostile probing: the slow path checked `self.native is not None` and then called
    # `self.native.set_pool(...)`; an uninstall() on another thread in between (it sets the
    # attribute to None) made CuPy's allocation fail with a bare AttributeError. Here the
    # attribute changes between its reads, as it does when that thread runs in between.
    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0))
    alloc = pk_cupy.install(pool, pinned=False).cupy_allocator
    seen = []

    class Native:
        def set_pool(self, device, p):
            seen.append(device)

        def set_graph_pools(self, device, gp):
            seen.append(("graphs", device))

    reads = iter([Native()])

    def read_native(self):
        return next(reads, None)  # the first read sees the native state, later ones the uninstall

    monkeypatch.setattr(pk_cupy._DeviceAllocator, "native", property(read_native, lambda self, v: None), raising=False)
    mem = alloc(4096)
    assert seen == [0] and mem.ptr
    reads = iter([Native()])
    alloc.graph_pools(0)
    del mem
    gc.collect()
    pool.validate()


# -- torch.compile's CUDA-graph trees: checkpoint restore (set_checkpoint_pool_state) -------------
#
# PyTorch's side: raw_alloc / raw_delete through the C ABI with the allocator's record of each
# block (size, stream), as CUDAPluggableAllocator keeps it, and storages as records of a data
# pointer and a deleter, changed the way the shim's storage functions change a StorageImpl.

TREE_POOL = (3, 0)
TREE_STREAM = 7  # the stream the graphs are captured on


class FakeStorageShim:
    """poolkeeper_shim_storage_data/adopt/disown over storages kept as [data_ptr, deleter]."""

    def __init__(self):
        self.storages = {}

    def new(self, ptr, deleter):
        impl = 0x1000 + 8 * len(self.storages)
        self.storages[impl] = [ptr, deleter]
        return impl

    def poolkeeper_shim_storage_data(self, impl):
        return self.storages[impl][0] if impl in self.storages else None

    def poolkeeper_shim_adopt(self, impl, like):
        if self.storages[impl][1] is not None:
            return 1
        self.storages[impl][1] = self.storages[like][1]
        return 0

    def poolkeeper_shim_disown(self, impl, like):
        if self.storages[impl][1] != self.storages[like][1]:
            return 1
        self.storages[impl][1] = "nothing"
        return 0


@pytest.fixture
def trees(fake_torch, monkeypatch):
    import contextlib

    from capi_lib import load as load_capi

    t = fake_torch()
    pk_torch.install("arena", upstream="simulated")
    lib = load_capi()
    shim = FakeStorageShim()
    records = {}  # PyTorch's record of each block it allocated: (size, stream)

    def raw_alloc(n, stream):
        p = lib.poolkeeper_torch_malloc(n, 0, stream)
        if not p:  # what poolkeeper_torch_malloc_raising makes PyTorch raise
            raise RuntimeError(lib.poolkeeper_last_error().decode())
        records[p] = (n, stream)
        return p

    def raw_delete(p):
        n, s = records.pop(p)  # PyTorch refuses a pointer it has no record of
        lib.poolkeeper_torch_free(p, n, 0, s)

    class Storage:
        def __init__(self, n):
            self._cdata = shim.new(raw_alloc(n, None), "allocator")

        def __del__(self):  # the allocator's deleter
            if shim.storages[self._cdata][1] == "allocator":
                raw_delete(shim.storages[self._cdata][0])

    class Tensor:
        def __init__(self, n):
            self.storage = Storage(n)

        def untyped_storage(self):
            return self.storage

    t._C._cuda_cudaCachingAllocator_raw_alloc = raw_alloc
    t._C._cuda_cudaCachingAllocator_raw_delete = raw_delete
    t.cuda.device = lambda d: contextlib.nullcontext()
    t.uint8 = "uint8"
    t.empty = lambda n, dtype=None, device=None: Tensor(n)
    monkeypatch.setattr(pk_torch, "_STORAGE_SHIM", shim)
    raw_delete(raw_alloc(16, None))  # the device pool exists
    gp = _core.graph_pools(0)

    def record(*sizes):
        """A graph recording: its allocations come from the tree's pool."""
        gp.begin(TREE_POOL, TREE_STREAM)
        try:
            return [raw_alloc(n, TREE_STREAM) for n in sizes]
        finally:
            gp.end(TREE_POOL)

    def check():
        assert not gp.routing
        assert set(records) == {p for p in records if gp.owns_private(p)}  # nothing of the restore's own left
        gp.validate()
        gp.pool.validate()
        pk.accounting.check(gp.pool.snapshot())
        assert set(gp.live_blocks(TREE_POOL)) == {p for p in records if gp.owns_private(p)}

    return types.SimpleNamespace(torch=t, shim=shim, records=records, raw_alloc=raw_alloc, raw_delete=raw_delete,
                                 gp=gp, record=record, check=check, restore=t._C._cuda_setCheckpointPoolState,
                                 checkpoint=lambda: t._C._cuda_getCheckpointState(0, TREE_POOL))


def test_checkpoint_restore_frees_blocks_since_and_hands_freed_ones_back_at_their_addresses(trees):
    x, out = trees.record(100_000, 200_000)
    ck = trees.checkpoint()
    (later,) = trees.record(150_000)  # a later recording
    trees.raw_delete(out)  # the first recording's output dies
    replay = trees.shim.new(out, None)  # a replay's output over out's memory: no deleter
    stale = trees.shim.new(later, "allocator")
    trees.restore(0, ck, [stale], [replay, replay])  # aliased outputs name one storage twice
    assert trees.gp.live_block_info(TREE_POOL) == sorted(ck.blocks)
    assert trees.records[out] == (200_000, TREE_STREAM) and later not in trees.records
    assert trees.shim.storages[replay][1] == "allocator"  # its death frees the block now
    assert trees.shim.storages[stale][1] == "nothing"
    trees.check()
    trees.raw_delete(out)
    trees.raw_delete(x)
    trees.check()


def test_checkpoint_restore_gives_a_deleter_to_a_storage_over_a_block_live_both_times(trees):
    # PyTorch's own restore frees and hands out again every block of the checkpoint, so a storage
    # the trees made without a deleter over a block that stayed live gets the allocator's deleter
    # too (else its death never frees the block, and the trees' asserts find a storage without
    # the standard deleter). One that already owns its block keeps it, with no error.
    x, y = trees.record(100_000, 200_000)
    ck = trees.checkpoint()
    replay_x = trees.shim.new(x, None)  # a replay's output over x: no deleter
    owner_y = trees.shim.new(y, "allocator")
    trees.restore(0, ck, [], [replay_x, owner_y])
    assert trees.gp.live_block_info(TREE_POOL) == sorted(ck.blocks)
    assert trees.shim.storages[replay_x][1] == "allocator"
    assert trees.shim.storages[owner_y][1] == "allocator"
    trees.check()
    trees.raw_delete(x)
    trees.raw_delete(y)
    trees.check()


def test_checkpoint_restore_gives_a_reused_address_back_at_the_checkpoints_size(trees):
    (out,) = trees.record(300_000)
    ck = trees.checkpoint()
    trees.raw_delete(out)
    (smaller,) = trees.record(100_000)
    assert smaller == out  # same address, another block
    trees.restore(0, ck, [trees.shim.new(smaller, "allocator")], [])
    assert trees.gp.live_block_info(TREE_POOL) == sorted(ck.blocks)
    trees.check()
    trees.raw_delete(out)
    trees.check()


def test_regression_checkpoint_restore_with_a_stale_storage_named_twice_raised_after_disowning_it(trees):
    # Aliased stale tensors name one storage twice (PyTorch's restore takes each once): the second
    # disown found the deleter gone and raised, after the first had changed the storage and before
    # its block was freed (a block no one would ever free).
    (x,) = trees.record(100_000)
    ck = trees.checkpoint()
    (y,) = trees.record(300_000)
    ys = trees.shim.new(y, "allocator")
    trees.restore(0, ck, [ys, ys], [])
    assert set(trees.gp.live_blocks(TREE_POOL)) == {x} and y not in trees.records
    trees.check()


def test_regression_checkpoint_restore_failing_midway_left_the_blocks_handed_back_live_for_good(trees):
    # The second block cannot be handed back (its release on another stream is still pending and
    # another graph is being captured, so nothing may wait): the first, handed back already, had
    # no owner yet and stayed live in the graph's pool for good.
    x, y = trees.record(100_000, 100_000)
    ck = trees.checkpoint()
    trees.raw_delete(x)
    trees.records[y] = (100_000, 8)  # PyTorch frees y on stream 8, which is busy
    trees.gp.pool.upstream.enqueue(8, 1_000.0)
    trees.raw_delete(y)
    trees.gp.begin((9, 0), 99)
    try:
        with pytest.raises(_common.IntegrationError, match="could not be handed out again"):
            trees.restore(0, ck, [], [trees.shim.new(x, None), trees.shim.new(y, None)])
    finally:
        trees.gp.end((9, 0))
    assert trees.gp.live_blocks(TREE_POOL) == [] and not trees.records.keys() & {x, y}
    trees.check()


def test_regression_checkpoint_restore_freed_a_block_whose_live_storage_was_not_named_stale(trees):
    # PyTorch's restore refuses this: the storage keeps the allocator's deleter, so its death
    # would free the block a second time, by then perhaps another tensor's.
    (x,) = trees.record(100_000)
    ck = trees.checkpoint()
    (y,) = trees.record(300_000)
    trees.shim.new(y, "allocator")  # alive, not named stale
    with pytest.raises(_common.IntegrationError, match="stale"):
        trees.restore(0, ck, [], [])
    assert set(trees.gp.live_blocks(TREE_POOL)) == {x, y} and y in trees.records
    trees.check()


@pytest.mark.parametrize("bad", [["x"], [1.5], [None], 7])
def test_regression_checkpoint_restore_with_storages_that_are_not_pointers_raised_bare_errors(trees, bad):
    # int() of each: ValueError or TypeError escaped, and a float was taken as a pointer.
    from poolkeeper.errors import InvalidArgumentError

    trees.record(100_000)
    ck = trees.checkpoint()
    trees.record(300_000)
    before = trees.gp.live_block_info(TREE_POOL)
    for stale, adopters in ((bad, []), ([], bad)):
        with pytest.raises(InvalidArgumentError):
            trees.restore(0, ck, stale, adopters)
        assert trees.gp.live_block_info(TREE_POOL) == before
    trees.check()
