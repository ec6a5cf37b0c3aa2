"""The CUDA copy path's logic on CI: a fake ``poolkeeper.cuda.driver`` whose "DMA" runs only when an
event is synchronized (or the test says so), over host memory posing as pinned and device memory.

This checks what the real driver cannot show deterministically: a witness exists only after the
copy's event completed, a buffer is never freed while its copy is enqueued, and an untrackable
copy leaks its buffer rather than freeing it under the DMA.
"""
from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper.errors import UpstreamError, WitnessError
from poolkeeper.staging import PinnedStagingPool, Uploader, _engine, copy, copy_async


class FakeDriver:
    """Copies are queued and executed in order when an event covering them is synchronized.
    Thread-safe, like the real driver (the uploader calls it from several workers)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.queue: list = []  # (dst, src, n) not yet executed
        self.executed = 0  # copies executed so far
        self.enqueued = 0
        self.log: list = []
        self.fail_record = False
        self.fail_async = False
        driver = self

        class Event:
            def __init__(self, upto: int) -> None:
                self.upto = upto

            @classmethod
            def record(cls, stream: int) -> "Event":
                with driver.lock:
                    if driver.fail_record:
                        raise UpstreamError("fake: event record failed", error_name="CUDA_ERROR_FAKE")
                    return cls(driver.enqueued)

            def query(self) -> bool:
                with driver.lock:
                    return driver.executed >= self.upto

            def synchronize(self) -> None:
                driver.run(self.upto)

        class Stream:
            def __init__(self, device: int = 0) -> None:
                self.handle = 0x5000 + device

        self.Event, self.Stream = Event, Stream

    def current_device(self) -> int:
        return 0

    def memcpy_htod(self, dst: int, src: int, n: int) -> None:
        with self.lock:
            self.run(self.enqueued)  # ordered after earlier work, like the legacy stream
            ctypes.memmove(dst, src, n)
            self.log.append(("sync", n))

    def memcpy_htod_async(self, dst: int, src: int, n: int, stream: int) -> None:
        with self.lock:
            if self.fail_async:
                raise UpstreamError("fake: async copy failed", error_name="CUDA_ERROR_FAKE")
            self.queue.append((dst, src, n))
            self.enqueued += 1
            self.log.append(("async", stream, n))

    def run(self, upto: int) -> None:
        with self.lock:
            while self.executed < upto:
                dst, src, n = self.queue.pop(0)
                ctypes.memmove(dst, src, n)
                self.executed += 1
                self.log.append(("dma", n))


class FakePinned:
    """Host memory that calls itself pinned, logging frees."""

    kind = "pinned"
    name = "FakePinned"

    def __init__(self, log: list) -> None:
        self._host = pk.upstream.Host()
        self._log = log

    def allocate(self, n: int) -> int:
        return self._host.allocate(n)

    def deallocate(self, p: int, n: int) -> None:
        self._log.append(("free", n))
        self._host.deallocate(p, n)

    def counters(self) -> dict:
        return self._host.counters()


@pytest.fixture
def drv(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(_engine, "_driver", lambda: d)
    return d


@pytest.fixture
def sink():
    # Destination of copies the fake DMA may run later: must outlive them.
    return np.zeros(1 << 16, np.uint8)


@pytest.fixture
def pool(drv):
    return PinnedStagingPool(FakePinned(drv.log))


def test_blocking_copy_uses_memcpy_htod(pool, drv):
    dev = np.zeros(64, np.uint8)
    b = pool.acquire(64)
    b.fill(bytes(range(64)))
    w = copy(dev.ctypes.data, b)
    assert drv.log == [("sync", 64)] and list(dev) == list(range(64))
    b.retire(w)


def test_witness_only_after_the_event_completes(pool, drv):
    dev = np.zeros(64, np.uint8)
    b = pool.acquire(64)
    b.fill(b"\x05" * 64)
    pending = copy_async(dev.ctypes.data, b, stream=7)
    assert drv.log == [("async", 7, 64)]
    assert not pending.done() and b.copies_in_flight == 1 and not dev.any()
    w = pending.wait()  # synchronizes the event: the DMA runs now
    assert (dev == 5).all() and pending.done()
    b.retire(w)


def test_witness_of_one_copy_cannot_retire_while_a_later_copy_is_enqueued(pool, drv, sink):
    b = pool.acquire(64)
    first = copy_async(sink.ctypes.data, b)
    second = copy_async(sink.ctypes.data + 64, b)
    w1 = first.wait()  # runs the DMA up to the first copy only
    assert not second.done()
    with pytest.raises(WitnessError, match="in flight"):
        b.retire(w1)
    assert not w1.consumed
    second.wait()
    b.retire(w1)


def test_stream_object_with_handle_is_accepted(pool, drv, sink):
    b = pool.acquire(16)
    pending = copy_async(sink.ctypes.data, b, stream=drv.Stream(3))
    assert drv.log[-1] == ("async", 0x5003, 16)
    b.retire(pending.wait())


def test_dropped_buffer_waits_for_its_dma_before_the_free(pool, drv):
    dev = np.zeros(4096, np.uint8)
    b = pool.acquire(4096)
    b.fill(b"\x09" * 4096)
    copy_async(dev.ctypes.data, b)  # handle dropped
    del b
    gc.collect()
    assert drv.log == [("async", 0, 4096), ("dma", 4096), ("free", 4096)]
    assert (dev == 9).all()
    assert pool.stats()["dropped_without_retire"] == 1


def test_close_waits_for_its_dma_before_the_free(pool, drv, sink):
    b = pool.acquire(4096)
    copy_async(sink.ctypes.data, b)
    b.close()
    assert drv.log == [("async", 0, 4096), ("dma", 4096), ("free", 4096)]


def test_untrackable_copy_leaks_instead_of_freeing(pool, drv, sink):
    b = pool.acquire(4096)
    drv.fail_record = True
    with pytest.raises(UpstreamError):
        copy_async(sink.ctypes.data, b)
    assert b.copies_in_flight == 1  # enqueued, never provably complete
    drv.fail_record = False
    with pytest.raises(WitnessError):
        b.retire(copy(sink.ctypes.data, b))
    b.close()
    s = pool.stats()
    assert s["leaked_unconfirmed"] == 1 and s["frees"] == 0
    assert ("free", 4096) not in drv.log


def test_failed_enqueue_reads_nothing_and_the_buffer_stays_usable(pool, drv, sink):
    b = pool.acquire(64)
    drv.fail_async = True
    with pytest.raises(UpstreamError):
        copy_async(sink.ctypes.data, b)
    drv.fail_async = False
    assert b.copies_in_flight == 0
    b.retire(copy(sink.ctypes.data, b))


def test_device_dst_forms(pool, drv):
    class CAI:
        def __init__(self, arr):
            self.__cuda_array_interface__ = {"data": (arr.ctypes.data, False), "shape": arr.shape, "typestr": "|u1", "version": 3}

    dev = np.zeros(32, np.uint8)
    b = pool.acquire(32)
    b.fill(b"z" * 32)
    b.retire(copy(CAI(dev), b))
    assert bytes(dev) == b"z" * 32
    c = pool.acquire(32)
    with pytest.raises(pk.errors.InvalidArgumentError):
        copy(bytearray(32), c)  # a host buffer is not a device pointer
    c.close()


def test_uploader_on_the_device_path(pool, drv):
    n = 5 * (1 << 20) + 77
    data = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    dev = np.zeros(n, np.uint8)
    with Uploader(pool, chunk_bytes=1 << 20, workers=2, depth=2, engine="python") as up:
        first = up.upload(data, dev.ctypes.data)
        again = up.upload(data[::-1].copy(), dev.ctypes.data)
    assert np.array_equal(dev, data[::-1])
    assert first.pinned_alloc_calls == 4 and again.pinned_alloc_calls == 0
    assert all(e[1] == 0x5000 for e in drv.log if e[0] == "async")  # its own stream, current device
