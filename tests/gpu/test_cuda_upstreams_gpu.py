"""The driver layer and the CUDA upstreams on a real GPU."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.cuda import driver
from device_io import read

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def test_devices_are_described():
    devs = pk.cuda.devices()
    assert len(devs) == pk.cuda.device_count() >= 1
    d = devs[0]
    assert d.name and d.total_memory > (1 << 30) and d.multiprocessors > 0
    assert d.memory_pools_supported
    assert pk.cuda.driver_version() >= 11020


def test_cuda_device_round_trip_by_content():
    up = pk.upstream.CudaDevice(0)
    assert up.kind == "device" and up.device == 0 and up.streams_supported
    p = up.allocate(4 * MiB)
    src = (np.arange(4 * MiB) % 251).astype(np.uint8)
    driver.memcpy_htod(p, src.ctypes.data, src.nbytes)
    assert np.array_equal(read(p, 4 * MiB), src)
    driver.memset_d8(p, 0x5A, MiB)
    got = read(p, 4 * MiB)
    assert (got[:MiB] == 0x5A).all() and np.array_equal(got[MiB:], src[MiB:])
    up.deallocate(p, 4 * MiB)
    c = up.counters()
    assert c["allocations"] == 1 and c["deallocations"] == 1 and c["outstanding_bytes"] == 0


def test_out_of_memory_is_named_by_the_driver():
    up = pk.upstream.CudaDevice(0)
    with pytest.raises(pk.UpstreamError) as ei:
        up.allocate(1 << 50)  # 1 PiB
    assert ei.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert up.counters()["failed_allocations"] == 1
    # nothing latched: the next call works
    p = up.allocate(MiB)
    up.deallocate(p, MiB)


def test_bad_device_index():
    with pytest.raises(pk.InvalidArgumentError, match="does not exist"):
        pk.upstream.CudaDevice(pk.cuda.device_count())


def test_calls_leave_the_thread_without_a_context_as_it_was():
    seen = {}

    def body():
        up = pk.upstream.CudaDevice(0)
        p = up.allocate(MiB)
        up.deallocate(p, MiB)
        up.synchronize()
        seen["cur"] = _core.cuda_current_device()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["cur"] == -1


def test_cuda_async_on_a_user_stream():
    with driver.Stream() as s:
        up = pk.upstream.CudaAsync(0, s, warm=False)
        assert up.stream == s.handle
        p = up.allocate(MiB)
        driver.memset_d8(p, 7, MiB, s.handle)
        s.synchronize()
        assert (read(p, MiB) == 7).all()
        up.deallocate(p, MiB)
        s.synchronize()


def test_pinned_memory_is_host_addressable_and_copies_async():
    pinned = pk.upstream.CudaPinned()
    assert pinned.kind == "pinned"
    dev = pk.upstream.CudaDevice(0)
    h = pinned.allocate(MiB)
    ctypes.memset(h, 0x33, MiB)
    d = dev.allocate(MiB)
    with driver.Stream() as s:
        driver.memcpy_htod_async(d, h, MiB, s.handle)
        ev = driver.Event.record(s.handle)
        ev.synchronize()
        assert ev.query() is True
    assert (read(d, MiB) == 0x33).all()
    dev.deallocate(d, MiB)
    pinned.deallocate(h, MiB)


def test_event_not_ready_is_an_answer_not_an_error(gate):
    if not gate.gated:
        pytest.skip("needs the gated writer (CuPy)")
    up = pk.upstream.CudaDevice(0)
    p = up.allocate(MiB)
    with driver.Stream() as s:
        gate.fill_after_gate(p, MiB, 0x11, s.handle)
        ev = driver.Event.record(s.handle)
        e = up.record_event(s.handle)
        assert ev.query() is False and ev.query() is False
        assert up.query_event(e) is False
        # nothing latched: unrelated work on another stream succeeds meanwhile
        q = up.allocate(MiB)
        with driver.Stream() as other:
            driver.memset_d8(q, 0x22, MiB, other.handle)
            other.synchronize()
        assert (read(q, MiB) == 0x22).all()
        gate.open()
        up.wait_event(e)
        assert up.query_event(e) is True and ev.query() is True
        up.release_event(e)
        e2 = up.record_event(s.handle)
        assert up.events_created == 1, "released events are reused"
        up.wait_event(e2)
        up.release_event(e2)
    assert (read(p, MiB) == 0x11).all()
    up.deallocate(p, MiB)
    up.deallocate(q, MiB)
