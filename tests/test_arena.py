"""ArenaPool behaviour that the design promises (docs/design.md): upstream calls scale with the
high-water mark, deferred coalescing, best fit, oversize backings, shrink hysteresis, the thread
cache and the pointer table's bound. Each test fails if the feature is removed."""
from __future__ import annotations

import threading

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20


def sim():
    return pk.upstream.Simulated(latency_us=0)


def kv_cache_growth(pool, steps=2000, base=64 * KiB, step=16 * KiB):
    """A KV cache that grows with sequence length: each step allocates the larger cache, then
    frees the previous one (plus a transient activation), as a decoder does."""
    kv = pool.allocate(base)
    for k in range(1, steps):
        act = pool.allocate(3 * KiB + 7 * k)
        new = pool.allocate(base + k * step)
        pool.deallocate(kv)
        pool.deallocate(act)
        kv = new
    pool.deallocate(kv)
    pool.validate()
    return pool.stats()


def test_kv_cache_growth_upstream_calls_scale_with_high_water_mark():
    arena = pk.ArenaPool(sim())
    st = kv_cache_growth(arena)
    assert st["upstream_allocations"] <= 20, st
    # The size-class pool pays one upstream call per distinct class the cache passes through.
    sc = pk.SizeClassPool(sim())
    st_sc = kv_cache_growth(sc)
    classes = {pk._core.SizeClassPool.class_size(64 * KiB + k * 16 * KiB) for k in range(2000)}
    assert st_sc["upstream_allocations"] >= len(classes) > 20
    assert st_sc["upstream_allocations"] > 3 * st["upstream_allocations"]


def test_cycle_over_a_handful_of_sizes_never_coalesces():
    pool = pk.ArenaPool(sim(), thread_cache_bytes=0)  # every op goes through the index
    sizes = [3000, 70_000, 1_500_000, 333_333, 256, 9 * MiB]
    for _ in range(2):  # warm-up: the backings grow and the chunks settle
        ptrs = [pool.allocate(n) for n in sizes]
        for p in reversed(ptrs):
            pool.deallocate(p)
    before = pool.stats()
    for i in range(500):
        ptrs = [pool.allocate(n) for n in sizes]
        order = ptrs[i % 3 :] + ptrs[: i % 3]
        for p in order:
            pool.deallocate(p)
    after = pool.stats()
    assert after["coalesce_passes"] == before["coalesce_passes"]
    assert after["upstream_allocations"] == before["upstream_allocations"]
    pool.validate()


def test_coalescing_makes_free_chunks_reusable_at_a_larger_size():
    pool = pk.ArenaPool(sim(), initial_backing=1 * MiB, max_backing=1 * MiB, thread_cache_bytes=0)
    ptrs = [pool.allocate(64 * KiB) for _ in range(16)]  # fills the 1 MiB backing exactly
    assert pool.stats()["backings"] == 1
    for p in ptrs[:8]:
        pool.deallocate(p)
    passes = pool.stats()["coalesce_passes"]
    big = pool.allocate(512 * KiB)  # only servable by merging the 8 neighbours
    st = pool.stats()
    assert st["coalesce_passes"] == passes + 1 and st["backings"] == 1
    assert big == ptrs[0]
    pool.validate()


def test_best_fit_takes_the_smallest_sufficient_chunk_lowest_address_first():
    pool = pk.ArenaPool(sim(), initial_backing=4 * MiB, max_backing=4 * MiB, thread_cache_bytes=0)
    sizes = [512 * KiB, 64 * KiB, 256 * KiB, 64 * KiB, 128 * KiB]
    holes = []
    for n in sizes:
        holes.append(pool.allocate(n))
        pool.allocate(4 * KiB)  # a live separator: holes cannot merge
    for p in holes:
        pool.deallocate(p)
    assert pool.allocate(100 * KiB) == holes[4]  # the 128 KiB hole, not the 256/512 KiB ones
    assert pool.allocate(64 * KiB) == holes[1]  # two 64 KiB holes: the lower address wins
    assert pool.allocate(64 * KiB) == holes[3]
    pool.validate()


def test_fast_bins_serve_exact_small_sizes():
    pool = pk.ArenaPool(sim(), thread_cache_bytes=0)
    a = pool.allocate(4096)
    pool.allocate(256)
    pool.deallocate(a)
    assert pool.allocate(4000) == a  # rounds to 4096: the exact bin
    pool.validate()


def test_growth_ramp_then_cap_then_oversize():
    pool = pk.ArenaPool(sim(), initial_backing=64 * KiB, max_backing=256 * KiB, growth_factor=2.0, thread_cache_bytes=0)
    for _ in range(40):
        pool.allocate(60 * KiB)
    sizes = [b.size for b in pool.snapshot().backings]
    assert sizes[:3] == [64 * KiB, 128 * KiB, 256 * KiB]
    assert all(s == 256 * KiB for s in sizes[3:])
    assert sum(b.resident for b in pool.snapshot().backings) == 1
    before = pool.stats()
    big = pool.allocate(300 * KiB + 1)  # above the cap: its own backing, exactly its size
    st = pool.stats()
    assert st["oversize_backings"] == 1 and st["backings"] == before["backings"] + 1
    over = [b for b in pool.snapshot().backings if b.oversize]
    assert len(over) == 1 and over[0].size == 300 * KiB + 256 and over[0].address == big
    pool.deallocate(big)
    assert pool.trim() >= 300 * KiB
    assert pool.stats()["oversize_backings"] == 0
    pool.validate()


def test_shrink_returns_wholly_free_backings_after_two_scans_never_the_resident_one():
    up = sim()
    pool = pk.ArenaPool(up, initial_backing=64 * KiB, max_backing=64 * KiB, thread_cache_bytes=0, shrink_interval=0)
    ptrs = [pool.allocate(64 * KiB) for _ in range(4)]  # 4 backings, the first resident
    assert pool.stats()["backings"] == 4
    for p in ptrs:
        pool.deallocate(p)
    assert pool.shrink_scan() == 0  # first scan: seen free once, kept
    assert pool.stats()["backings"] == 4 and up.counters()["deallocations"] == 0
    assert pool.shrink_scan() == 3 * 64 * KiB  # second consecutive scan: released
    st = pool.stats()
    assert st["backings"] == 1 and up.counters()["deallocations"] == 3
    assert pool.snapshot().backings[0].resident
    for _ in range(5):
        pool.shrink_scan()
    assert pool.stats()["backings"] == 1  # the resident backing stays
    pool.validate()


def test_shrink_hysteresis_resets_when_a_backing_is_used_between_scans():
    pool = pk.ArenaPool(sim(), initial_backing=64 * KiB, max_backing=64 * KiB, thread_cache_bytes=0, shrink_interval=0)
    a, b = pool.allocate(64 * KiB), pool.allocate(64 * KiB)
    pool.deallocate(b)
    pool.shrink_scan()  # b's backing free once
    b = pool.allocate(64 * KiB)  # used again
    pool.deallocate(b)
    assert pool.shrink_scan() == 0  # the count restarted
    assert pool.shrink_scan() == 64 * KiB
    pool.deallocate(a)
    pool.validate()


def test_a_cache_refill_restarts_the_hysteresis_of_the_backing_it_takes_from():
    """A refill hands chunks to a thread cache without going through the locked hand-out, which
    alone restarted a backing's count: a backing a cache had used since the last scan was given
    back at the next one (review)."""
    import threading

    pool = pk.ArenaPool(sim(), initial_backing=MiB, max_backing=MiB, shrink_interval=0, shrink_hysteresis=2)
    made, done = threading.Event(), threading.Event()

    def other():  # a second thread cache, kept alive (its exit would fold it away)
        pool.deallocate(pool.allocate(4 * KiB))
        made.set()
        done.wait()

    t = threading.Thread(target=other)
    t.start()
    made.wait()
    try:
        r = pool.allocate(512 * KiB)
        keep = pool.allocate(256 * KiB)  # the resident backing is full
        x1, x2 = pool.allocate(512 * KiB), pool.allocate(512 * KiB)  # backing X
        pool.deallocate(x1)
        pool.deallocate(x2)
        pool.flush_thread_cache()
        pool.deallocate(r)
        pool.flush_thread_cache()
        assert pool.shrink_scan() == 0  # X free once
        assert pool.allocate(512 * KiB) == r  # locked: refills this thread's cache from X
        c = pool.allocate(512 * KiB)  # a cache hit: X's memory, used since the scan
        assert c in (x1, x2)
        pool.deallocate(c)
        pool.flush_thread_cache()
        assert pool.shrink_scan() == 0  # the refill restarted X's count
    finally:
        done.set()
        t.join()
    pool.deallocate(keep)
    pool.validate()


def test_automatic_shrink_runs_every_interval():
    pool = pk.ArenaPool(sim(), initial_backing=64 * KiB, max_backing=64 * KiB, thread_cache_bytes=0, shrink_interval=8)
    ptrs = [pool.allocate(64 * KiB) for _ in range(3)]
    for p in ptrs:
        pool.deallocate(p)
    for _ in range(40):  # locked operations tick the scan counter
        pool.deallocate(pool.allocate(1 * KiB))
    st = pool.stats()
    assert st["shrink_scans"] >= 2 and st["backings"] == 1
    pool.validate()


def test_thread_cache_hit_takes_no_upstream_call_and_is_counted():
    up = sim()
    pool = pk.ArenaPool(up)
    p = pool.allocate(4096)
    pool.deallocate(p)
    calls = up.counters()["allocations"]
    for _ in range(1000):
        q = pool.allocate(4096)
        assert q == p
        pool.deallocate(q)
    st = pool.stats()
    assert st["thread_cache_hits"] >= 1000 and up.counters()["allocations"] == calls
    assert st["thread_cached_bytes"] == 4096 and st["free_bytes"] >= 4096
    pool.flush_thread_cache()
    assert pool.stats()["thread_cached_bytes"] == 0
    pool.validate()


def test_thread_cache_disabled_by_zero_bytes():
    pool = pk.ArenaPool(sim(), thread_cache_bytes=0)
    p = pool.allocate(4096)
    pool.deallocate(p)
    pool.deallocate(pool.allocate(4096))
    st = pool.stats()
    assert st["thread_cache_hits"] == 0 and st["thread_caches"] == 0


def test_thread_cache_is_bounded_per_thread():
    pool = pk.ArenaPool(sim(), thread_cache_bytes=64 * KiB, thread_cache_max_block=16 * KiB)
    ptrs = [pool.allocate(16 * KiB) for _ in range(20)]
    for p in ptrs:
        pool.deallocate(p)
    assert pool.stats()["thread_cached_bytes"] <= 64 * KiB
    big = pool.allocate(32 * KiB)
    pool.deallocate(big)  # above the per-block cap: never cached
    assert pool.stats()["thread_cached_bytes"] <= 64 * KiB
    pool.validate()


def test_exiting_thread_returns_its_cached_blocks():
    pool = pk.ArenaPool(sim())

    def work():
        for _ in range(10):
            pool.deallocate(pool.allocate(8192))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    # join() returns when the Python thread is done; the OS thread runs its thread-local
    # destructors (our exit hook) a moment later. Wait for it, without asserting any timing.
    import time

    deadline = time.monotonic() + 10
    while pool.stats()["thread_caches"] and time.monotonic() < deadline:
        time.sleep(0.001)
    st = pool.stats()
    assert st["thread_cached_bytes"] == 0 and st["thread_caches"] == 0
    assert st["live_bytes"] == 0
    pool.validate()


def test_pointer_table_survives_churn_without_growing_past_its_bound():
    pool = pk.ArenaPool(sim(), thread_cache_bytes=0)
    keep = [pool.allocate(512) for _ in range(100)]
    cap_before = pool.stats()["table_capacity"]
    for i in range(50_000):
        pool.deallocate(pool.allocate(256 + (i % 7) * 256))
    st = pool.stats()
    assert st["table_capacity"] == cap_before <= 1024
    for p in keep:
        pool.deallocate(p)
    pool.validate()


def test_chunk_nodes_are_recycled_not_leaked():
    pool = pk.ArenaPool(sim(), thread_cache_bytes=0)
    for i in range(2000):
        ps = [pool.allocate(1000 + 37 * j) for j in range(10)]
        for p in ps:
            pool.deallocate(p)
    pool.trim()
    st = pool.stats()
    assert st["chunk_nodes"] == st["backings"]  # each remaining backing merged back to one chunk
    pool.validate()


@pytest.mark.parametrize("bad", [dict(initial_backing=0), dict(max_backing=1 << 10, initial_backing=1 << 20),
                                 dict(growth_factor=0.5), dict(alignment=3), dict(shrink_hysteresis=0),
                                 dict(bogus=1)])
def test_bad_options_are_refused(bad):
    with pytest.raises(pk.InvalidArgumentError):
        pk.ArenaPool(sim(), **bad)


def test_owed_merges_run_before_splitting_a_large_chunk():
    """A merged hole that fits exactly beats carving the free tail: the pool merges first."""
    pool = pk.ArenaPool(sim(), initial_backing=1 * MiB, max_backing=1 * MiB, thread_cache_bytes=0)
    a, b = pool.allocate(64 * KiB), pool.allocate(64 * KiB)
    pool.allocate(64 * KiB)  # a live separator; the rest of the backing is one free tail
    pool.deallocate(a)
    pool.deallocate(b)
    passes = pool.stats()["coalesce_passes"]
    assert pool.allocate(128 * KiB) == a  # the merged a+b hole, not the tail
    assert pool.stats()["coalesce_passes"] == passes + 1
    pool.validate()


def test_oversize_threshold_gives_large_requests_their_own_backing():
    pool = pk.ArenaPool(sim(), initial_backing=1 * MiB, max_backing=8 * MiB, oversize_threshold=2 * MiB)
    pool.allocate(1 * MiB)
    big = pool.allocate(3 * MiB)  # under the cap but above the threshold
    over = [b for b in pool.snapshot().backings if b.oversize]
    assert len(over) == 1 and over[0].address == big and over[0].size == 3 * MiB
    pool.validate()


def test_the_ramp_does_not_restart_after_a_shrink():
    pool = pk.ArenaPool(sim(), initial_backing=64 * KiB, max_backing=1 * MiB, growth_factor=2.0,
                        thread_cache_bytes=0, shrink_interval=0)
    ptrs = [pool.allocate(60 * KiB) for _ in range(40)]  # ramps 64K, 128K, ... up to 1 MiB
    for p in ptrs:
        pool.deallocate(p)
    pool.trim()
    pool.allocate(60 * KiB)  # the resident backing
    pool.allocate(100 * KiB)
    grown = [b.size for b in pool.snapshot().backings if not b.resident]
    assert grown and all(s == 1 * MiB for s in grown)  # straight back to full-size backings
    pool.validate()


# ---- the non-blocking locked path (the bindings keep the GIL through it) ----

def test_locked_reuse_is_served_without_blocking_but_growth_is_not():
    up = sim()
    pool = pk.ArenaPool(up, shrink_interval=0)
    p = pool.allocate(4 * MiB)  # above the thread cache's block limit: the locked path
    st = pool.stats()
    assert st["nowait_allocations"] == 0 and up.counters()["allocations"] == 1  # growth blocks
    pool.deallocate(p)
    q = pool.allocate(4 * MiB - 512)
    pool.deallocate(q)
    st = pool.stats()
    assert st["nowait_allocations"] == 1 and st["nowait_deallocations"] == 2
    assert st["slow_allocations"] == 2 and st["slow_deallocations"] == 2  # each counted once
    assert up.counters()["allocations"] == 1
    pool.validate()


def test_a_release_that_would_scan_takes_the_blocking_path():
    pool = pk.ArenaPool(sim(), shrink_interval=4, thread_cache_bytes=0)
    for _ in range(8):
        pool.deallocate(pool.allocate(2 * MiB))
    st = pool.stats()
    assert st["shrink_scans"] == 2
    assert st["nowait_deallocations"] == 6 and st["slow_deallocations"] == 8
    pool.validate()


def test_the_non_blocking_path_leaves_bad_pointers_to_the_blocking_path():
    pool = pk.ArenaPool(sim())
    p = pool.allocate(4 * MiB)
    pool.deallocate(p)
    with pytest.raises(pk.errors.InvalidPointerError, match="double free|already freed"):
        pool.deallocate(p)
    with pytest.raises(pk.errors.InvalidPointerError):
        pool.deallocate(p + 256)
    assert pool.stats()["nowait_deallocations"] == 1
    pool.validate()


def test_same_stream_reuse_through_the_non_blocking_path():
    up = sim()
    s = up.stream()
    pool = pk.ArenaPool(up, shrink_interval=0)
    p = pool.allocate(4 * MiB, stream=s)
    up.enqueue(s, 1000)  # device work still running on s
    pool.deallocate(p, stream=s)
    assert pool.stats()["pending_bytes"] >= 4 * MiB
    q = pool.allocate(4 * MiB, stream=s)  # same stream: reusable at once, no wait
    assert q == p
    st = pool.stats()
    assert st["nowait_allocations"] == 1 and st["same_stream_reuses"] >= 1
    pool.deallocate(q, stream=s)
    up.synchronize()
    pool.synchronize()
    pool.validate()


def test_a_cross_stream_release_is_left_to_the_blocking_path():
    """Such a release records events (an upstream call on a device): never with the GIL held."""
    up = sim()
    a, b = up.stream(), up.stream()
    pool = pk.ArenaPool(up, shrink_interval=0)
    p = pool.allocate(4 * MiB, stream=a)
    pool.deallocate(p, stream=b)
    st = pool.stats()
    assert st["nowait_deallocations"] == 0 and st["slow_deallocations"] == 1
    assert st["pending_bytes"] >= 4 * MiB
    pool.synchronize()
    pool.validate()
