"""Issue 16 item 6: memory stranded in an idle thread's cache.

An ArenaPool thread cache used to be emptied only by its owner (on its next locked operation), so a
thread that freed blocks and then waited kept them: another thread's request failed with a wrong
"fragmentation" diagnosis, and synchronize() left the idle thread's stream-tagged blocks pending.
Now other threads' caches are reclaimed at once before an out-of-memory error, in synchronize()
and in trim(). Each scenario keeps the freeing thread alive and idle (blocked on an event) while
the main thread acts, and runs under a timeout so a reclaim that waited for the idle owner would
fail instead of hanging.
"""
from __future__ import annotations

import threading

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20


def _idle_thread_frees(pool, n, size, stream=None):
    """Start a thread that allocates n blocks, frees them (into its cache) and then blocks until
    told to exit. Returns (thread, release_event)."""
    freed, leave = threading.Event(), threading.Event()

    def body():
        ptrs = [pool.allocate(size, stream) for _ in range(n)]
        for p in ptrs:
            pool.deallocate(p, stream)
        freed.set()
        leave.wait(30)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    assert freed.wait(30)
    return t, leave


def _pool(sim, **kw):
    return pk.ArenaPool(sim, initial_backing=2 * MiB, max_backing=2 * MiB, limit=2 * MiB, **kw)


def test_idle_threads_cache_is_reclaimed_before_an_oom():
    """The issue's numbers: limit 2 MiB, an idle thread holds 30 x 64 KiB in its cache, another
    thread asks for 1.9 MiB. Before the fix: OutOfMemoryError(cause="fragmentation")."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = _pool(sim)
    t, leave = _idle_thread_frees(pool, 30, 64 * KiB)
    try:
        assert pool.stats()["thread_cached_bytes"] >= 30 * 64 * KiB  # stranded in the idle cache
        p = pool.allocate(int(1.9 * MiB))
        assert pool.stats()["caches_reclaimed"] >= 1
        pool.deallocate(p)
        pool.validate()
    finally:
        leave.set()
        t.join(30)


def test_idle_threads_stream_tagged_cache_is_not_pending_after_synchronize():
    """With the frees on a stream the blocks are pending for other streams; before the fix
    pool.synchronize() still left 1.9 MiB pending (docs/stream_order.md: nothing stays pending)."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = _pool(sim)
    s = sim.stream()
    sim.enqueue(s, 25.0)
    t, leave = _idle_thread_frees(pool, 30, 64 * KiB, stream=s)
    try:
        assert pool.stats()["pending_bytes"] >= 30 * 64 * KiB
        pool.synchronize()
        st = pool.stats()
        assert st["pending_bytes"] == 0, st["pending_bytes"]
        assert st["thread_cached_pending_bytes"] == 0
        p = pool.allocate(int(1.9 * MiB), sim.stream())  # another stream gets the memory
        pool.deallocate(p)
        pool.validate()
    finally:
        leave.set()
        t.join(30)


def test_idle_threads_cache_does_not_keep_backings_from_trim():
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=1 * MiB, max_backing=1 * MiB)
    keep = pool.allocate(1 * MiB)  # fills the resident backing (trim never releases that one)
    t, leave = _idle_thread_frees(pool, 8, 64 * KiB)  # a second backing, all of it in the idle cache
    try:
        assert pool.stats()["thread_cached_bytes"] > 0
        released = pool.trim()  # before the fix: 0, the cached blocks kept the backing
        st = pool.stats()
        assert released == 1 * MiB and st["reserved_bytes"] == 1 * MiB, (released, st["reserved_bytes"])
        pool.deallocate(keep)
        pool.validate()
    finally:
        leave.set()
        t.join(30)


def test_oom_diagnosis_is_not_fragmentation_when_caches_hold_the_bytes():
    """When the request really cannot be served, the message must not blame fragmentation for bytes
    that sat in thread caches (the reclaim returns them first)."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = _pool(sim)
    keep = pool.allocate(1 * MiB)
    t, leave = _idle_thread_frees(pool, 14, 64 * KiB)
    try:
        with pytest.raises(pk.errors.OutOfMemoryError) as ei:
            pool.allocate(int(1.5 * MiB))
        e = ei.value
        assert e.cause != "fragmentation" or e.figures["thread_cached"] == 0
        assert pool.stats()["thread_cached_bytes"] == 0  # reclaimed before the verdict
        pool.deallocate(keep)
        pool.validate()
    finally:
        leave.set()
        t.join(30)


def test_reclaim_during_traffic_keeps_the_books():
    """Reclaims (synchronize, trim, OOM recovery) from one thread while four threads run the cache's
    lock-free paths: every block is handed out once, the accounting identity holds throughout."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=1 * MiB, max_backing=4 * MiB)
    stop = threading.Event()
    errors = []

    def worker(seed):
        import random
        rnd = random.Random(seed)
        live = []
        try:
            while not stop.is_set():
                if live and rnd.random() < 0.5:
                    pool.deallocate(live.pop(rnd.randrange(len(live))))
                else:
                    live.append(pool.allocate(rnd.choice([256, 4 * KiB, 16 * KiB])))
            for p in live:
                pool.deallocate(p)
        except Exception as ex:  # noqa: BLE001 -- reported below
            errors.append(ex)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    try:
        for i in range(300):
            (pool.synchronize if i % 2 else pool.trim)()
            st = pool.stats()
            assert st["reserved_bytes"] == st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]
    finally:
        stop.set()
        for t in ts:
            t.join(60)
    assert not errors, errors
    pool.validate()
    assert pool.stats()["live_bytes"] == 0
