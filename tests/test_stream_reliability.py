"""Issue 16, stream-order items, on the simulated device:

- 14: a destroyed stream must not wedge the pool (settled safely; one bad stream never blocks the
  others), for the arena and the size-class pool;
- 18: per-stream bookkeeping is bounded (idle lanes are retired) and a lagging stream holds one
  outstanding event, not one per settling pass.

The CUDA side of item 14 (the fake driver's cuStreamDestroy) is in test_cuda_fake_driver.py.
"""
from __future__ import annotations

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20
POOLS = {
    "size_class": lambda up: pk.SizeClassPool(up),
    "arena": lambda up: pk.ArenaPool(up, initial_backing=1 * MiB, max_backing=4 * MiB),
    "arena_nocache": lambda up: pk.ArenaPool(up, initial_backing=1 * MiB, max_backing=4 * MiB, thread_cache_bytes=0),
}


@pytest.fixture(params=sorted(POOLS))
def spool(request):
    sim = pk.upstream.Simulated(latency_us=0)
    return sim, POOLS[request.param](sim)


def _balanced(st):
    return st["reserved_bytes"] == st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]


# ------------------------------------------------------------------ item 14: dead streams


def test_simulated_destroy_stream_models_cuStreamDestroy():
    sim = pk.upstream.Simulated(latency_us=0)
    s = sim.stream()
    sim.enqueue(s, 50.0)
    sim.destroy_stream(s)
    with pytest.raises(pk.errors.UpstreamError, match="INVALID_HANDLE"):
        sim.record_event(s)
    with pytest.raises(pk.errors.UpstreamError, match="INVALID_HANDLE"):
        sim.enqueue(s, 1.0)
    with pytest.raises(pk.errors.InvalidArgumentError):
        sim.destroy_stream(s)  # twice
    with pytest.raises(pk.errors.InvalidArgumentError):
        sim.destroy_stream(0)  # the default stream
    assert sim.stream() != s  # a dead id is never handed out again
    sim.synchronize()
    assert sim.now >= 50.0  # its work still ran to the end


def test_destroyed_stream_does_not_wedge_the_pool(spool):
    """Allocate on a temporary stream, destroy it, free on its handle (CuPy does exactly this when an
    array outlives its `with cupy.cuda.Stream():` block). Before the fix every settling pass tried to
    record an event on the dead handle: process_pending, synchronize, allocations that had to
    settle and close() all raised UpstreamError INVALID_HANDLE for good."""
    sim, pool = spool
    tmp = sim.stream()
    p = pool.allocate(256 * KiB, tmp)
    sim.enqueue(tmp, 40.0)  # work still running when the stream is destroyed
    sim.destroy_stream(tmp)
    pool.deallocate(p, tmp)
    pool.process_pending()  # raised UpstreamError before the fix
    st = pool.stats()
    assert st["pending_bytes"] == 0 and _balanced(st)
    assert st["dead_stream_settles"] >= 1
    assert sim.now >= 40.0  # settled only after the device ran the dead stream's work
    pool.synchronize()
    q = pool.allocate(256 * KiB)
    pool.deallocate(q)
    pool.validate()
    pool.close()


def test_one_dead_stream_never_blocks_a_healthy_streams_pending_bytes(spool):
    sim, pool = spool
    good, dead = sim.stream(), sim.stream()
    a = pool.allocate(128 * KiB, good)
    b = pool.allocate(128 * KiB, dead)
    pool.deallocate(a, good)
    sim.destroy_stream(dead)
    pool.deallocate(b, dead)
    pool.process_pending()
    st = pool.stats()
    assert st["pending_bytes"] == 0 and _balanced(st)
    pool.validate()


def test_dead_stream_release_across_streams_is_settled(spool):
    """A block allocated on one stream and freed on another records its events at release; when the
    allocating stream is gone by then, the release must still succeed (and later settle)."""
    sim, pool = spool
    alloc_s, free_s = sim.stream(), sim.stream()
    p = pool.allocate(64 * KiB, alloc_s)
    sim.destroy_stream(alloc_s)
    pool.deallocate(p, free_s)  # raised UpstreamError before the fix (the record at release failed)
    pool.synchronize()
    assert pool.stats()["pending_bytes"] == 0
    pool.validate()
    pool.close()


def test_dead_stream_pool_recovers_under_allocation_pressure():
    """Before the fix, an allocation that had to settle to be served raised INVALID_HANDLE."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=1 * MiB, max_backing=1 * MiB, limit=1 * MiB, thread_cache_bytes=0)
    tmp = sim.stream()
    p = pool.allocate(1 * MiB, tmp)
    sim.destroy_stream(tmp)
    pool.deallocate(p, tmp)
    q = pool.allocate(1 * MiB)  # only the settled block can serve this (limit reached)
    pool.deallocate(q)
    pool.validate()


# ------------------------------------------------------------------ item 18: bounded lanes


def test_lanes_of_idle_streams_are_retired(spool):
    """Before the fix every stream ever seen kept a lane for the pool's lifetime (40,000 streams:
    ~51 MiB, and alloc+free 2.2 -> 112 us from the linear lane scans)."""
    sim, pool = spool
    for _ in range(3000):
        s = sim.stream()
        p = pool.allocate(4 * KiB, s)
        pool.deallocate(p, s)
    pool.process_pending()
    pool.process_pending()
    st = pool.stats()
    assert st["pending_bytes"] == 0
    assert st["stream_lanes"] <= 8, st["stream_lanes"]  # was 3000
    assert st["stream_lanes_retired"] >= 2990
    pool.validate()


def test_lanes_stay_bounded_without_settling_passes(spool):
    """Streams whose blocks come straight back on the same stream never need a settling pass; the
    lanes they leave behind are swept when the lane count doubles."""
    sim, pool = spool
    for _ in range(5000):
        s = sim.stream()
        p = pool.allocate(4 * KiB, s)
        pool.deallocate(p, s)
        q = pool.allocate(4 * KiB, s)  # same-stream reuse empties the lane again
        pool.deallocate(q)
    assert pool.stats()["stream_lanes"] <= 128
    pool.validate()


def test_lagging_stream_holds_one_event_not_one_per_pass(spool):
    """Before the fix a lagging stream got a new event at every settling pass (20,000 live events,
    each a cuEventCreate on a GPU)."""
    sim, pool = spool
    s = sim.stream()
    sim.enqueue(s, 1e9)  # lags for the whole test
    recorded0 = sim.events_recorded
    for _ in range(200):
        p = pool.allocate(4 * KiB, s)
        pool.deallocate(p, s)
        pool.process_pending()
    st = pool.stats()
    assert st["fences_outstanding"] <= 1
    assert st["fences_recorded"] <= 1, st["fences_recorded"]  # was 200
    assert sim.live_events <= 1
    assert sim.events_recorded - recorded0 <= 1  # the device saw one event record, not 200
    sim.advance(2e9)
    pool.process_pending()
    st = pool.stats()
    assert st["pending_bytes"] == 0 and st["fences_outstanding"] == 0 and sim.live_events == 0
    pool.validate()


def test_releases_after_a_fence_are_settled_once_it_completes(spool):
    """One fence at a time must not strand the releases made while it was outstanding: when it
    completes, the same pass fences (and, on an idle stream, settles) the later ones."""
    sim, pool = spool
    s, other = sim.stream(), sim.stream()
    sim.enqueue(s, 100.0)
    a = pool.allocate(64 * KiB, s)
    pool.deallocate(a, s)
    pool.process_pending()  # fence 1, outstanding
    b = pool.allocate(32 * KiB, other)
    pool.deallocate(b, s)  # after fence 1 (cross-stream: waits on its own events)
    c = pool.allocate(16 * KiB, s)
    pool.deallocate(c, s)  # after fence 1, on the lane
    assert pool.stats()["fences_outstanding"] == 1
    sim.advance(100.0)
    pool.process_pending()
    assert pool.stats()["pending_bytes"] == 0
    pool.validate()


def test_wait_settles_everything_with_one_fence_per_lane(spool):
    sim, pool = spool
    streams = [sim.stream() for _ in range(5)]
    for s in streams:
        sim.enqueue(s, 10.0)
        for _ in range(3):
            p = pool.allocate(8 * KiB, s)
            pool.deallocate(p, s)
    pool.synchronize()
    st = pool.stats()
    assert st["pending_bytes"] == 0 and st["fences_outstanding"] == 0
    pool.validate()
