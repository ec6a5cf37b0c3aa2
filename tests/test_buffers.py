"""pool.buffer(): owning buffers over pool memory, consumed through numpy, the buffer protocol,
DLPack and the CUDA array interface, freed (stream-ordered) on release or collection."""
from __future__ import annotations

import ctypes
import gc
import sys

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper import _dlpack
from poolkeeper.buffers import BufferExportError, BufferReleasedError, PoolBuffer


@pytest.fixture
def host_pool():
    return pk.ArenaPool(pk.upstream.Host(), initial_backing=1 << 20)


@pytest.fixture
def sim():
    return pk.upstream.Simulated(latency_us=0)


@pytest.fixture
def dev_pool(sim):
    return pk.ArenaPool(sim, initial_backing=1 << 20)


def plain_stream(sim):
    """A simulated stream whose number is not one DLPack/CAI reserve (1: legacy, 2: per-thread)."""
    s = sim.stream()
    while s <= 2:
        s = sim.stream()
    return s


def live(pool):
    return pool.stats()["live_bytes"]


def capsule_name_is(cap, name: bytes) -> bool:
    f = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_IsValid", ctypes.pythonapi))
    return bool(f(cap, name))


# -- host memory: numpy and the buffer protocol -------------------------------------------------


def test_numpy_round_trip_shares_memory(host_pool):
    b = host_pool.buffer(4096)
    assert isinstance(b, PoolBuffer) and b.kind == "host" and len(b) == 4096
    a = np.asarray(b)
    assert a.dtype == np.uint8 and a.shape == (4096,)
    assert a.ctypes.data == b.ptr  # no copy
    a[:] = np.arange(4096) % 251
    raw = (ctypes.c_ubyte * 4096).from_address(b.ptr)
    assert bytes(raw) == a.tobytes()
    mv = b.memoryview()
    assert mv.format == "B" and mv.nbytes == 4096 and mv[10] == 10
    mv[0] = 99
    assert a[0] == 99


def test_memoryview_of_buffer_directly(host_pool):
    b = host_pool.buffer(64)
    m = memoryview(b)
    m[:] = bytes(range(64))
    assert np.asarray(b)[63] == 63


def test_numpy_from_dlpack_host(host_pool):
    b = host_pool.buffer(1000)
    np.asarray(b)[:] = 5
    assert b.__dlpack_device__() == (_dlpack.KDL_CPU, 0)
    x = np.from_dlpack(b)
    assert x.shape == (1000,) and x.dtype == np.uint8 and x.ctypes.data == b.ptr
    assert (x == 5).all()
    x[3] = 42
    assert np.asarray(b)[3] == 42


def test_asarray_copy_and_dtype_requests(host_pool):
    b = host_pool.buffer(16)
    np.asarray(b)[:] = 1
    c = np.array(b, copy=True)
    assert c.ctypes.data != b.ptr
    f = np.asarray(b, dtype=np.float32)
    assert f.dtype == np.float32 and (f == 1.0).all()


# -- lifetime ------------------------------------------------------------------------------------


def test_release_returns_memory_and_twice_is_a_no_op(host_pool):
    b = host_pool.buffer(8192)
    assert live(host_pool) == 8192
    b.release()
    assert b.released and live(host_pool) == 0
    b.release()
    assert live(host_pool) == 0
    host_pool.validate()


def test_context_manager_releases(host_pool):
    with host_pool.buffer(512) as b:
        assert live(host_pool) == 512
    assert b.released and live(host_pool) == 0


def test_garbage_collection_frees(host_pool):
    b = host_pool.buffer(3000)
    assert live(host_pool) == 3000
    del b
    gc.collect()
    assert live(host_pool) == 0
    assert host_pool.stats()["live_blocks"] == 0


def test_view_keeps_memory_after_release_until_it_goes(host_pool):
    b = host_pool.buffer(2048)
    a = np.asarray(b)
    b.release()
    assert live(host_pool) == 2048  # the numpy array still uses it
    a[:] = 3  # still valid memory
    del a
    gc.collect()
    assert live(host_pool) == 0


def test_dlpack_consumer_keeps_buffer_alive(host_pool):
    b = host_pool.buffer(1024)
    x = np.from_dlpack(b)
    del b
    gc.collect()
    assert live(host_pool) == 1024
    assert (x == x).all()
    del x
    gc.collect()
    assert live(host_pool) == 0
    assert _dlpack.live_exports() == 0


def test_unconsumed_capsule_runs_its_deleter(host_pool):
    before = _dlpack.live_exports()
    b = host_pool.buffer(256)
    cap = b.__dlpack__()
    assert capsule_name_is(cap, b"dltensor")
    assert _dlpack.live_exports() == before + 1
    b.release()
    assert live(host_pool) == 256  # the capsule holds a claim
    del cap
    gc.collect()
    assert _dlpack.live_exports() == before
    assert live(host_pool) == 0


def test_versioned_capsule_when_consumer_allows_it(host_pool):
    b = host_pool.buffer(128)
    cap = b.__dlpack__(max_version=(1, 0))
    assert capsule_name_is(cap, b"dltensor_versioned")
    legacy = b.__dlpack__(max_version=(0, 8))
    assert capsule_name_is(legacy, b"dltensor")
    del cap, legacy
    gc.collect()


def test_released_buffer_refuses_new_views(host_pool):
    b = host_pool.buffer(64)
    b.release()
    with pytest.raises(BufferReleasedError):
        b.__dlpack__()
    with pytest.raises(BufferReleasedError):
        np.asarray(b)
    with pytest.raises(BufferReleasedError):
        b.memoryview()


def test_bad_request_leaks_nothing(host_pool):
    with pytest.raises(pk.InvalidArgumentError):
        host_pool.buffer(0)
    with pytest.raises(pk.InvalidStreamError):
        host_pool.buffer(64, stream="not a stream")
    gc.collect()
    assert live(host_pool) == 0 and host_pool.stats()["live_blocks"] == 0
    host_pool.validate()


# -- device memory (simulated device): interfaces reported -----------------------------------------


def test_device_buffer_reports_cuda_array_interface(dev_pool):
    b = dev_pool.buffer(4096)
    assert b.kind == "device"
    cai = b.__cuda_array_interface__
    assert cai == {
        "shape": (4096,),
        "typestr": "|u1",
        "data": (b.ptr, False),
        "version": 3,
        "strides": None,
        "stream": None,  # allocated without a stream: nothing to synchronize on
    }
    assert b.__dlpack_device__() == (_dlpack.KDL_CUDA, 0)


def test_cai_stream_numbers(dev_pool, sim):
    legacy = dev_pool.buffer(256, stream=0)
    assert legacy.__cuda_array_interface__["stream"] == 1  # CAI v3: 0 is disallowed, legacy is 1
    s = plain_stream(sim)
    other = dev_pool.buffer(256, stream=s)
    assert other.__cuda_array_interface__["stream"] == s


def test_device_buffer_has_no_host_views(dev_pool):
    b = dev_pool.buffer(64)
    with pytest.raises(BufferExportError):
        np.asarray(b)
    with pytest.raises(BufferExportError):
        b.memoryview()


def test_host_buffer_has_no_cuda_array_interface(host_pool):
    assert not hasattr(host_pool.buffer(64), "__cuda_array_interface__")


def test_device_dlpack_capsule_and_argument_checks(dev_pool):
    b = dev_pool.buffer(512)
    cap = b.__dlpack__(stream=None)
    assert capsule_name_is(cap, b"dltensor")
    with pytest.raises(BufferExportError):
        b.__dlpack__(copy=True)
    with pytest.raises(BufferExportError):
        b.__dlpack__(dl_device=(_dlpack.KDL_CPU, 0))
    with pytest.raises(BufferExportError):
        b.__dlpack__(stream="default")
    del cap
    gc.collect()


# Hostile probing: __dlpack__ ran int(max_version[0]), tuple(dl_device) and `if copy:` on whatever
# it was given, so a malformed request leaked the builtin each raised (IndexError for (),
# ValueError for ("x", 0) or a numpy array as copy, TypeError for 5 or (None, 0)); a stream on host
# memory was ignored whatever it was, though the array API standard accepts only None there.
MALFORMED_DLPACK = [
    ({"max_version": ()}, pk.InvalidArgumentError),
    ({"max_version": ("x", 0)}, pk.InvalidArgumentError),
    ({"max_version": 5}, pk.InvalidArgumentError),
    ({"max_version": (None, 0)}, pk.InvalidArgumentError),
    ({"dl_device": 5}, pk.InvalidArgumentError),
    ({"dl_device": (1,)}, pk.InvalidArgumentError),
    ({"copy": np.zeros(3)}, pk.InvalidArgumentError),
    ({"stream": np.zeros(3)}, BufferExportError),
    ({"stream": "s"}, BufferExportError),
    ({"stream": 2**64}, BufferExportError),
]


@pytest.mark.parametrize("upstream", ["Host", "Simulated"])
@pytest.mark.parametrize("kw, error", MALFORMED_DLPACK, ids=[f"{next(iter(k))}={next(iter(k.values()))!r:.20}" for k, _ in MALFORMED_DLPACK])
def test_regression_malformed_dlpack_request_leaked_a_bare_builtin(upstream, kw, error):
    pool = pk.ArenaPool(getattr(pk.upstream, upstream)())
    b = pool.buffer(64)
    with pytest.raises(error):
        b.__dlpack__(**kw)
    # Still exportable as asked properly, and nothing claimed by the refusal. A consumer of another
    # major version gets what the standard says: 0.x the legacy capsule, 2.x our 1.x one.
    for ok, name in (({"max_version": (1, 0)}, b"dltensor_versioned"), ({"max_version": (0, 8)}, b"dltensor"),
                     ({"max_version": (2, 0)}, b"dltensor_versioned"),
                     ({"dl_device": b.__dlpack_device__(), "copy": False}, b"dltensor")):
        cap = b.__dlpack__(**ok)
        assert capsule_name_is(cap, name)
        del cap
    gc.collect()
    b.release()
    assert live(pool) == 0
    pool.validate()


def test_regression_host_dlpack_accepted_any_stream(host_pool):
    b = host_pool.buffer(64)
    for s in (-1, 1, 5):  # kDLCPU: only None (array API standard, __dlpack__'s stream)
        with pytest.raises(BufferExportError):
            b.__dlpack__(stream=s)
    cap = b.__dlpack__(stream=None)
    del cap
    b.release()
    gc.collect()
    assert live(host_pool) == 0


def test_regression_array_copy_false_with_a_dtype_raised_a_bare_value_error(host_pool):
    # numpy's protocol asks for a ValueError when a copy cannot be avoided: a typed one now.
    b = host_pool.buffer(16)
    with pytest.raises(pk.InvalidArgumentError):
        b.__array__(dtype=np.float32, copy=False)
    with pytest.raises(pk.InvalidArgumentError):
        b.__array__(copy=np.zeros(2))
    assert b.__array__(dtype=np.float32).dtype == np.float32


def test_release_is_stream_ordered_on_the_buffer_stream(dev_pool, sim):
    s = sim.stream()
    b = dev_pool.buffer(4096, stream=s)
    sim.enqueue(s, 100.0)
    del b
    gc.collect()
    st = dev_pool.stats()
    assert st["live_bytes"] == 0
    assert st["pending_bytes"] == 4096  # other streams wait for s's work
    sim.advance(1000.0)
    dev_pool.process_pending()
    assert dev_pool.stats()["pending_bytes"] == 0


def test_release_without_stream_is_free_at_once(dev_pool):
    b = dev_pool.buffer(4096)
    b.release()
    st = dev_pool.stats()
    assert st["live_bytes"] == 0 and st["pending_bytes"] == 0


def test_dlpack_consumer_stream_is_waited_for(dev_pool, sim):
    consumer = plain_stream(sim)
    b = dev_pool.buffer(4096)
    cap = b.__dlpack__(stream=consumer)
    sim.enqueue(consumer, 100.0)  # the consumer works on the memory
    del cap
    gc.collect()
    b.release()
    assert dev_pool.stats()["pending_bytes"] == 4096  # not reusable elsewhere before that work ends
    sim.advance(1000.0)
    dev_pool.process_pending()
    assert dev_pool.stats()["pending_bytes"] == 0
    dev_pool.validate()


# -- capsules made in the core ---------------------------------------------------------------------


def test_capsule_consumed_by_a_c_consumer_on_another_thread_releases_once(host_pool):
    import threading

    b = host_pool.buffer(64)
    cap = b.__dlpack__()
    b.release()
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_GetPointer", ctypes.pythonapi))
    rename = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(("PyCapsule_SetName", ctypes.pythonapi))
    managed = get(cap, b"dltensor")
    used = ctypes.c_char_p(b"used_dltensor")  # the name must outlive the capsule
    assert rename(cap, used) == 0  # what a consumer does: it owns the deleter call now
    del cap
    gc.collect()
    assert live(host_pool) == 64  # renamed: the destructor left it to the consumer
    # DLManagedTensor: DLTensor (48 bytes), manager_ctx, deleter.
    deleter_addr = ctypes.c_void_p.from_address(managed + 56).value
    deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter_addr)
    t = threading.Thread(target=deleter, args=(managed,))
    t.start()
    t.join(10)
    assert live(host_pool) == 0 and _dlpack.live_exports() == 0


def test_capsule_whose_release_callback_raises_reports_it_and_goes_on(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))

    def boom():
        raise RuntimeError("from on_release")

    cap = _dlpack.make_capsule(0x1000, 8, (_dlpack.KDL_CPU, 0), boom, True)
    del cap
    gc.collect()
    assert seen == [RuntimeError] and _dlpack.live_exports() == 0


# -- pool.buffer() is native: no Python runs per buffer --------------------------------------------


@pytest.mark.parametrize("kind", ["arena", "size_class", "direct"])
def test_pool_buffer_runs_no_python_and_keeps_its_contract(kind):
    pool = pk.make_pool(kind, pk.upstream.Simulated(latency_us=0))
    pool.buffer(64)  # warm: the buffer class is registered, the pool has memory
    gc.collect()
    events = []

    def prof(frame, event, arg):
        if event == "call":  # a Python function ran
            events.append(frame.f_code.co_name)

    sys.setprofile(prof)
    try:
        for _ in range(10):
            pool.buffer(4096)  # made and dropped
        b = pool.buffer(1000, stream=7)
    finally:
        sys.setprofile(None)
    assert events == []
    assert type(b) is PoolBuffer and b.nbytes == 1000 and b.stream == 7 and b.pool is pool
    assert pool.stats()["live_bytes"] == 1000 and b.kind == "device" and b.device == -1
    b.release()
    assert pool.stats()["live_bytes"] == 0
    with pytest.raises(pk.errors.InvalidArgumentError):
        pool.buffer(-1)
    with pytest.raises(pk.errors.InvalidStreamError):
        pool.buffer(16, stream="not a stream")
    assert pool.stats()["live_blocks"] == 0
    pool.validate()


def test_regression_a_release_during_a_dlpack_export_put_the_consumers_stream_on_the_next_owners_block():
    # Found by hostile probing: __dlpack__ recorded the consumer's stream on the block before it
    # claimed the buffer, so a release in between (another thread; here the max_version's
    # __index__) freed the block first, and the stream went onto whichever allocation got the
    # address next, delaying its reuse for work that was never its own.
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim)
    own, consumer = sim.stream(), sim.stream()
    buf = pool.buffer(4096, stream=own)
    taken = []

    class ReleasingIndex:
        def __index__(self):
            buf.release()
            taken.append(pool.allocate(4096, stream=own))
            return 1

    with pytest.raises(BufferReleasedError):
        buf.__dlpack__(stream=consumer, max_version=(ReleasingIndex(), 0))
    assert taken == [buf.ptr]  # the next owner has the address
    sim.enqueue(consumer, 10**6)
    pool.deallocate(taken[0], stream=own)
    waits = [c.waits_on for b in pool.snapshot().backings for c in b.chunks if c.state == "pending"]
    assert waits == [[own]]
    pool.synchronize()
    pool.validate()
