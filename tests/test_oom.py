"""Out-of-memory: recovery first (drain completed pending, flush, trim, retry once), then an
OutOfMemoryError whose one-line diagnosis names the constrained allocator, with the figures."""
from __future__ import annotations

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20


def sim(**kw):
    return pk.upstream.Simulated(latency_us=0, **kw)


def test_fragmentation_is_diagnosed_with_both_figures():
    pool = pk.ArenaPool(sim(), initial_backing=1 * MiB, max_backing=1 * MiB, limit=1 * MiB)
    ptrs = [pool.allocate(64 * KiB) for _ in range(16)]
    for p in ptrs[::2]:
        pool.deallocate(p)  # 512 KiB free in 8 holes of 64 KiB between live blocks
    with pytest.raises(pk.OutOfMemoryError) as ei:
        pool.allocate(128 * KiB)
    e = ei.value
    assert e.cause == "fragmentation"
    assert e.free == 512 * KiB and e.largest_free == 64 * KiB and e.free_chunks == 8
    assert e.requested == 128 * KiB and e.limit == 1 * MiB
    msg = str(e)
    assert "512.00 KiB free in 8 chunks but the largest is 64.00 KiB: fragmentation in ArenaPool backings" in msg
    assert isinstance(e, MemoryError)
    pool.validate()
    assert pool.allocate(64 * KiB) in ptrs[::2]  # still serving


def test_pending_on_a_busy_stream_is_diagnosed_with_the_stream():
    up = sim()
    for pool in (pk.ArenaPool(up, initial_backing=1 * MiB, max_backing=1 * MiB, limit=1 * MiB),
                 pk.SizeClassPool(up, limit=1 * MiB)):
        a, b = up.stream(), up.stream()
        up.enqueue(a, 1000.0)
        p = pool.allocate(768 * KiB, a)
        pool.deallocate(p, a)
        with pytest.raises(pk.OutOfMemoryError) as ei:
            pool.allocate(768 * KiB, b)
        e = ei.value
        assert e.cause == "pending", str(e)
        assert e.pending >= 768 * KiB and e.pending_by_stream.get(a, 0) >= 768 * KiB
        assert f"pending on stream {a:#x}" in str(e) and "until its event completes" in str(e)
        pool.validate()
        up.advance(1000.0)  # A's work completes: the same request now succeeds (drained on pressure)
        q = pool.allocate(768 * KiB, b)
        assert q == p
        pool.deallocate(q)
        pool.validate()


def test_limit_is_diagnosed():
    for pool in (pk.ArenaPool(sim(), limit=1 * MiB), pk.SizeClassPool(sim(), limit=1 * MiB), pk.Direct(sim(), limit=1 * MiB)):
        with pytest.raises(pk.OutOfMemoryError) as ei:
            pool.allocate(2 * MiB)
        assert ei.value.cause == "limit"
        # The request alone exceeds the limit: the message says so rather than "limit reached"
        # of a pool holding nothing (found by hostile probing).
        assert "the request alone is larger than the limit of 1.00 MiB" in str(ei.value)
        pool.validate()
        held = pool.allocate(768 * KiB)
        with pytest.raises(pk.OutOfMemoryError) as ei:
            pool.allocate(512 * KiB)  # fits the limit, not what is left of it
        assert ei.value.cause == "limit" and "limit of 1.00 MiB reached" in str(ei.value)
        pool.deallocate(held)
        pool.deallocate(pool.allocate(1000))


def test_upstream_exhaustion_is_diagnosed():
    for pool in (pk.ArenaPool(sim(capacity=4 * MiB)), pk.SizeClassPool(sim(capacity=4 * MiB)), pk.Direct(sim(capacity=4 * MiB))):
        with pytest.raises(pk.OutOfMemoryError) as ei:
            pool.allocate(8 * MiB)
        e = ei.value
        assert e.cause == "upstream" and "upstream Simulated exhausted" in str(e)
        assert "CUDA_ERROR_OUT_OF_MEMORY" not in str(e) or e.upstream_error
        pool.validate()


def test_arena_recovers_by_returning_idle_backings_before_failing():
    up = sim(capacity=3 * MiB)
    pool = pk.ArenaPool(up, initial_backing=1 * MiB, max_backing=1 * MiB, shrink_interval=0, thread_cache_bytes=0)
    ptrs = [pool.allocate(1 * MiB) for _ in range(3)]  # the device is full
    pool.deallocate(ptrs[1])
    pool.deallocate(ptrs[2])  # two idle non-resident backings
    big = pool.allocate(2 * MiB)  # needs them back: recovery trims and retries
    st = pool.stats()
    assert st["oom_retries"] == 1 and st["backings_released"] == 2
    pool.deallocate(big)
    pool.deallocate(ptrs[0])
    pool.validate()


def test_size_class_pool_releases_cached_blocks_before_failing():
    up = sim(capacity=2 * MiB)
    pool = pk.SizeClassPool(up)
    ptrs = [pool.allocate(512 * KiB) for _ in range(4)]
    for p in ptrs:
        pool.deallocate(p)  # 2 MiB cached in the 512 KiB class
    big = pool.allocate(1536 * KiB)  # another class: the cache must go back upstream first
    assert pool.stats()["oom_retries"] == 1
    pool.deallocate(big)
    pool.validate()


def test_oom_error_pickles_with_its_figures():
    import pickle

    pool = pk.ArenaPool(sim(), limit=1 * MiB)
    with pytest.raises(pk.OutOfMemoryError) as ei:
        pool.allocate(4 * MiB)
    e2 = pickle.loads(pickle.dumps(ei.value))
    assert type(e2) is pk.OutOfMemoryError and e2.cause == "limit" and e2.requested == 4 * MiB and str(e2) == str(ei.value)
