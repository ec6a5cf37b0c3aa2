"""The buffer protocol of PoolBuffer and StagingBuffer, natively (PoolBuffer's slots in
poolkeeper._core.BufferCore, StagingBuffer's in poolkeeper._core.HostBufferExporter), so
``memoryview(buf)`` and numpy work on Python 3.10 and 3.11 too, where a Python class cannot export
buffers (PEP 688's ``__buffer__`` is 3.12+).

Lifetime rules these tests pin down:
- PoolBuffer: ``release()`` while a view is exported is deferred; the memory goes back to the pool
  when the last view is released.
- StagingBuffer: ``retire()`` while a view is exported raises ``BufferInUseError`` and changes
  nothing; ``close()`` frees once the last view is gone.
- Device memory is not CPU-addressable: the buffer protocol raises ``BufferExportError`` (a
  ``BufferError``) and takes no claim.
"""
from __future__ import annotations

import ctypes
import gc
import sys

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.buffers import BufferExportError, BufferReleasedError, PoolBuffer
from poolkeeper.staging._lease import CLOSED, CLOSING
from poolkeeper.staging import BufferInUseError, BufferStateError, PinnedStagingPool, StagingBuffer, copy


@pytest.fixture
def host_pool():
    p = pk.ArenaPool(pk.upstream.Host(), initial_backing=1 << 20)
    yield p
    gc.collect()
    p.validate()


@pytest.fixture
def staging():
    p = PinnedStagingPool(pk.upstream.Host())
    yield p
    p.close()


def live_blocks(pool) -> int:
    return pool.stats()["live_blocks"]


def raw(ptr: int, n: int) -> bytes:
    return bytes((ctypes.c_ubyte * n).from_address(ptr))


# -- the regression: a Python class had no buffer slot before 3.12 --------------------------------


@pytest.mark.parametrize("cls", [PoolBuffer, StagingBuffer])
def test_memoryview_works_without_pep688(cls):
    # The slot comes from the native base on every Python, not from a __buffer__ method (which
    # only 3.12+ turns into a slot).
    # PoolBuffer's native base is BufferCore (which owns the block) and carries the slots itself.
    base = _core.BufferCore if cls is PoolBuffer else _core.HostBufferExporter
    assert issubclass(cls, base)
    assert "__buffer__" not in cls.__dict__
    assert memoryview(bytes(0)) is not None  # sanity


def test_memoryview_of_pool_buffer(host_pool):
    b = host_pool.buffer(256)
    m = memoryview(b)
    assert (m.format, m.ndim, m.shape, m.nbytes, m.readonly, m.c_contiguous) == ("B", 1, (256,), 256, False, True)
    m[:] = bytes(range(256))
    assert raw(b.ptr, 256) == bytes(range(256))
    assert b.memoryview().tobytes() == bytes(range(256))


def test_numpy_frombuffer_and_asarray_share_memory(host_pool):
    b = host_pool.buffer(64)
    a = np.frombuffer(b, dtype=np.uint8)
    assert a.ctypes.data == b.ptr and a.flags.writeable
    a[:] = 7
    c = np.asarray(b)
    assert c.ctypes.data == b.ptr and c[63] == 7
    f = np.frombuffer(b, dtype=np.float32)
    assert f.shape == (16,)


def test_slices_write_in_place_and_keep_the_claim(host_pool):
    b = host_pool.buffer(64)
    s = memoryview(b)[16:32]  # the parent view is gone; the slice holds the export
    s[:] = b"x" * 16
    assert raw(b.ptr + 16, 16) == b"x" * 16
    b.release()
    assert b.released and live_blocks(host_pool) == 1  # deferred: the slice still reads it
    s.release()
    assert live_blocks(host_pool) == 0


def test_release_while_viewed_is_deferred_until_the_last_view(host_pool):
    b = host_pool.buffer(128)
    m1, arr = memoryview(b), np.frombuffer(b, dtype=np.uint8)
    b.release()
    assert live_blocks(host_pool) == 1
    m1.release()
    assert live_blocks(host_pool) == 1  # the array's export is still alive
    del arr
    gc.collect()
    assert live_blocks(host_pool) == 0
    with pytest.raises(BufferReleasedError):
        memoryview(b)


def test_release_after_views_frees_at_once(host_pool):
    b = host_pool.buffer(128)
    with memoryview(b) as m:
        m[0] = 1
    b.release()
    assert live_blocks(host_pool) == 0


def test_every_export_is_released_exactly_once(host_pool):
    b = host_pool.buffer(32)
    views = [memoryview(b) for _ in range(5)] + [np.asarray(b) for _ in range(5)]
    assert b._exports == 10
    del views
    gc.collect()
    assert b._exports == 0


def test_device_buffer_refuses_the_buffer_protocol_without_a_claim():
    pool = pk.ArenaPool(pk.upstream.Simulated(latency_us=0), initial_backing=1 << 20)
    b = pool.buffer(64)
    with pytest.raises(BufferExportError, match="not CPU-addressable") as e:
        memoryview(b)
    assert isinstance(e.value, BufferError)
    with pytest.raises(BufferExportError):
        np.frombuffer(b, dtype=np.uint8)
    assert b._exports == 0
    b.release()
    assert live_blocks(pool) == 0


# -- StagingBuffer -------------------------------------------------------------------------------


def test_staging_memoryview_numpy_and_slices(staging):
    buf = staging.acquire(16)
    with memoryview(buf) as m:
        m[:4] = b"abcd"
    a = np.frombuffer(buf, dtype=np.uint8)
    a[4:8] = 1
    del a
    with buf.view(8, 4) as v:
        v[:] = b"wxyz"
    dst = bytearray(16)
    buf.retire(copy(dst, buf))
    assert bytes(dst[:12]) == b"abcd\x01\x01\x01\x01wxyz"


def test_staging_retire_with_a_live_memoryview_raises_and_changes_nothing(staging):
    buf = staging.acquire(8)
    m = memoryview(buf)
    dst = bytearray(8)
    w = copy(dst, buf)
    with pytest.raises(BufferInUseError):
        buf.retire(w)
    assert buf.state == "live"
    m.release()
    buf.retire(w)  # the same witness, unused by the refused retire
    assert buf.state == "retired"
    with pytest.raises(BufferStateError):
        memoryview(buf)


def test_staging_slice_keeps_the_buffer_in_use(staging):
    buf = staging.acquire(8)
    s = memoryview(buf)[2:4]
    w = copy(bytearray(8), buf)
    with pytest.raises(BufferInUseError):
        buf.retire(w)
    del s
    buf.retire(w)


def test_staging_close_with_a_live_view_frees_after_it(staging):
    buf = staging.acquire(8)
    m = memoryview(buf)
    buf.close()
    assert staging.stats()["closed_without_retire"] == 0  # not under the view
    m[0] = 1  # still valid memory
    m.release()
    del m, buf
    gc.collect()
    assert staging.stats()["closed_without_retire"] == 1



# A memoryview kept only by a reference cycle is released by the garbage collector at whatever
# allocation triggers a collection: here, inside the buffer's own lock. With a non-re-entrant lock
# the release path waited on its own thread forever, so these run in a subprocess with a timeout.
_GC_UNDER_LOCK = """
import gc
import poolkeeper as pk
from poolkeeper.staging import PinnedStagingPool, copy

class Holder:
    pass

def cyclic_view_collected_under_lock(buf):
    h = Holder()
    h.self, h.view = h, memoryview(buf)
    del h
    # StagingBuffer guards its claims with a Python lock; PoolBuffer's claims are native (no lock).
    lock = getattr(buf, "_lock", None)
    if lock is None:
        gc.collect()
        return
    with lock:
        gc.collect()

pool = pk.ArenaPool(pk.upstream.Host())
b = pool.buffer(64)
cyclic_view_collected_under_lock(b)
assert b._exports == 0
b.release()
assert pool.stats()["live_blocks"] == 0

staging = PinnedStagingPool(pk.upstream.Host())
buf = staging.acquire(8)
cyclic_view_collected_under_lock(buf)
buf.retire(copy(bytearray(8), buf))
print("ok")
"""


def test_export_released_by_gc_while_the_buffer_lock_is_held_does_not_deadlock():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ)
    site = str(Path(pk.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "-c", _GC_UNDER_LOCK], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


class _InterruptAt:
    """A trace function that raises KeyboardInterrupt at the n-th Python event (call, line,
    return): a Ctrl-C landing at that point of whatever Python code runs."""

    def __init__(self, n: int) -> None:
        self.left = n

    def __call__(self, frame, event, arg):
        if self.left == 0:
            self.left = -1
            raise KeyboardInterrupt
        self.left -= 1
        return self


def _export_and_release_under_ctrl_c(buf, n: int) -> None:
    views = []
    sys.settrace(_InterruptAt(n))
    try:
        views.append(memoryview(buf))
        views.append(np.frombuffer(buf, dtype=np.uint8))
        views.clear()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    views.clear()
    gc.collect()


@pytest.mark.parametrize("n", range(0, 40, 3))
def test_ctrl_c_at_any_point_of_an_export_or_release_leaks_no_claim(host_pool, n):
    """The slots called Python's _export_buffer_/_release_buffer_: a Ctrl-C at the entry of the
    release ("Exception ignored in ...") left the claim, and the released buffer's block was never
    freed (8 of 40 real SIGINTs into a loop of views). PoolBuffer's claims are native now."""
    buf = host_pool.buffer(4096)
    _export_and_release_under_ctrl_c(buf, n)
    assert buf._exports == 0
    buf.release()
    assert host_pool.stats()["live_blocks"] == 0


@pytest.mark.parametrize("n", range(0, 80, 2))
def test_ctrl_c_at_any_point_of_a_staging_export_or_release_leaks_no_view(staging, n):
    """Same for StagingBuffer, whose lease counts views in Python: 24 of 120 interruption points
    left a view counted forever (retire refused, close never freed). Releases now name their view
    and are repeated by the slot until they complete."""
    buf = staging.acquire(4096)
    _export_and_release_under_ctrl_c(buf, n)
    assert buf._exports == 0
    buf.close()
    assert buf.state == "closed"
    staging.validate()


@pytest.mark.parametrize("n", range(0, 40, 2))
def test_ctrl_c_in_the_last_release_of_a_closed_staging_buffer_does_not_leave_it_closing(n):
    """A view alive across close(): the lease is CLOSING until that view goes. A Ctrl-C after the
    view was uncounted but before the close finished left the lease CLOSING with no views forever
    (its memory never freed); the release is repeated now and a repeat finishes the close. (A
    Ctrl-C inside the free itself can still lose the free: docs/hardening.md, row 17.)"""
    pool = PinnedStagingPool(pk.upstream.Host())
    buf = pool.acquire(4096)
    mv = memoryview(buf)
    buf.close()
    assert buf._lease._state == CLOSING
    sys.settrace(_InterruptAt(n))
    try:
        mv.release()
        sum(range(10))  # where an interrupt raised again by the slot lands
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    try:
        sum(range(10))
    except KeyboardInterrupt:
        pass
    assert buf._exports == 0 and buf._lease._state == CLOSED
    pool.close()
