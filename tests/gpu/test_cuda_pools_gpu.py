"""The pools over CudaDevice on a real GPU: a conformance run checked by content, and real
cross-stream reuse: a block still being written on stream A (a kernel held back by the host) is
never handed to stream B before that kernel has finished."""
from __future__ import annotations

import random

import pytest

import poolkeeper as pk
from poolkeeper.cuda import driver
from device_io import read

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def make_pool(kind: str, up, **kw):
    return pk.make_pool(kind, up, **kw)


def upstream_for(kind: str):
    """The CUDA upstream a per-device pool of ``kind`` draws from by default (CudaVirtual for the
    expandable arena, CudaDevice for the others)."""
    return pk.upstream.make_upstream(pk.pools.KINDS[kind].cuda_upstream, 0)


@pytest.mark.parametrize("kind", sorted(pk.pools.KINDS))
def test_conformance_by_content(kind):
    """Seeded random allocate/free over None and two streams. Every live block is filled with its
    own byte on its stream and checked in full before it is freed: two live blocks that overlap,
    or a block reused while another stream still writes it, show up as wrong bytes."""
    rng = random.Random(1234)
    up = upstream_for(kind)
    pool = make_pool(kind, up)
    streams = [None, driver.Stream(), driver.Stream()]
    live = {}  # ptr -> (size, byte, stream)
    tag = 0
    sizes = [256, 1000, 4096, 65536, 300_000, MiB, 3 * MiB + 5]
    for step in range(400):
        if live and (len(live) >= 48 or rng.random() < 0.45):
            ptr = rng.choice(list(live))
            size, byte, s = live.pop(ptr)
            if s is not None:
                s.synchronize()
            got = read(ptr, size)
            assert (got == byte).all(), f"step {step}: block {ptr:#x} of {size} B was overwritten"
            pool.deallocate(ptr, stream=s)
        else:
            size = rng.choice(sizes)
            s = rng.choice(streams)
            ptr = pool.allocate(size, stream=s)
            assert ptr % pool.alignment == 0
            tag = tag % 250 + 1
            driver.memset_d8(ptr, tag, size, None if s is None else s.handle)
            live[ptr] = (size, tag, s)
        if step % 50 == 0:
            st = pool.stats()
            assert st["reserved_bytes"] == (
                st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]
            )
            pool.validate()
    for ptr, (size, byte, s) in list(live.items()):
        if s is not None:
            s.synchronize()
        assert (read(ptr, size) == byte).all()
        pool.deallocate(ptr, stream=s)
    pool.synchronize()
    st = pool.stats()
    assert st["live_bytes"] == 0 and st["pending_bytes"] == 0
    pool.validate()
    pool.close()
    c = up.counters()
    assert c["allocations"] == c["deallocations"] and c["outstanding_bytes"] == 0
    for s in streams[1:]:
        s.close()


@pytest.mark.parametrize("kind", ["size_class", "arena"])
def test_block_still_written_on_stream_a_is_not_handed_to_stream_b(kind, gate):
    n = MiB
    up = pk.upstream.CudaDevice(0)
    pool = make_pool(kind, up)
    a, b = driver.Stream(), driver.Stream()
    p = pool.allocate(n, stream=a)
    gate.fill_after_gate(p, n, 0xAA, a.handle)  # still writing p on A until the gate opens
    pool.deallocate(p, stream=a)
    assert pool.stats()["pending_bytes"] > 0

    q = pool.allocate(n, stream=b)
    driver.memset_d8(q, 0xBB, n, b.handle)
    b.synchronize()
    if gate.gated:
        assert driver.Event.record(a.handle).query() is False, "A's writer must still be running here"
        assert q != p
    gate.open()
    a.synchronize()
    assert (read(q, n) == 0xBB).all(), "stream B's block was overwritten by stream A's late writer"
    assert (read(p, n) == 0xAA).all()

    pool.process_pending()
    assert pool.stats()["pending_bytes"] == 0, "A's event has completed: nothing may stay pending"
    pool.deallocate(q, stream=b)
    pool.synchronize()
    pool.validate()
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0
    a.close()
    b.close()


def test_pressure_on_stream_b_reports_pending_instead_of_reusing(gate):
    if not gate.gated:
        pytest.skip("needs the gated writer (CuPy)")
    n = MiB
    up = pk.upstream.CudaDevice(0)
    pool = make_pool("size_class", up, limit=n)
    a, b = driver.Stream(), driver.Stream()
    p = pool.allocate(n, stream=a)
    gate.fill_after_gate(p, n, 0xAA, a.handle)
    pool.deallocate(p, stream=a)
    with pytest.raises(pk.OutOfMemoryError) as ei:
        pool.allocate(n, stream=b)
    assert ei.value.cause == "pending"
    gate.open()
    a.synchronize()
    q = pool.allocate(n, stream=b)  # A's event completed: the pressure pass hands p over now
    assert q == p
    assert up.counters()["allocations"] == 1
    pool.deallocate(q, stream=b)
    pool.synchronize()
    pool.close()
    a.close()
    b.close()
