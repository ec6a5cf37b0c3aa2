"""ArenaPool calls the upstream for a new backing with its lock let go (issue 20).

A cuMemAlloc costs 90-900 us; while one thread grew the pool, every other thread that needed the
same lock waited for the driver (the locked paths' p99 tail under many threads). Growth now claims
its bytes in the pool's budget, unlocks, calls the upstream, and locks again to adopt the backing.
These tests use a simulated device whose every call busy-waits a second, so "the other thread did
not wait" is an order of events, not a timing: the other thread's pair completes while the growth
is still inside the upstream call. A thread that misses meanwhile waits for the growth when its
step could serve that thread too, and then shares it; oversize requests grow side by side. The expandable arena maps under its lock (its range is its
books) and is not covered here.
"""
from __future__ import annotations

import threading
import time

import pytest

import poolkeeper as pk

MiB = 1 << 20


def _slow_pool(**options):
    up = pk.upstream.Simulated(latency_us=1_000_000)  # every upstream call busy-waits one second
    pool = pk.ArenaPool(up, shards=1, thread_cache_bytes=0, initial_backing=4 * MiB, **options)
    pool.deallocate(pool.allocate(1024))  # the first backing, paid before the test starts
    return up, pool


def _grow_in_thread(pool, nbytes, out):
    entered, done = threading.Event(), threading.Event()

    def grow():
        entered.set()
        try:
            out.append(pool.allocate(nbytes))
        except Exception as e:  # reported to the test
            out.append(e)
        done.set()

    t = threading.Thread(target=grow)
    t.start()
    entered.wait(10)
    time.sleep(0.1)  # inside the upstream call by now: it lasts a second
    return t, done


def test_another_threads_pair_does_not_wait_for_a_growth_in_the_upstream():
    up, pool = _slow_pool()
    out: list = []
    t, done = _grow_in_thread(pool, 64 * MiB, out)  # an oversize backing: one upstream call
    p = pool.allocate(1024)  # served from the first backing's free memory
    pool.deallocate(p)
    grew_first = done.is_set()
    t.join(30)
    assert not grew_first, "the pair waited for the other thread's upstream call (the pool lock was held)"
    assert isinstance(out[0], int)
    pool.deallocate(out[0])
    st = pool.stats()
    assert st["upstream_allocations"] == 2 and st["reserved_bytes"] == 4 * MiB + 64 * MiB
    pool.validate()
    pool.close()


def test_concurrent_growths_do_not_pass_the_limit_together():
    # A growth claims its bytes before it lets the lock go, and a second thread that misses waits
    # for it: with room for one 40 MiB backing under the limit, of two threads that need one at
    # once, one gets it and the other a limit error, and the device never holds more.
    up, pool = _slow_pool(limit=48 * MiB)
    out_a: list = []
    out_b: list = []
    ta, _ = _grow_in_thread(pool, 40 * MiB, out_a)
    tb, _ = _grow_in_thread(pool, 40 * MiB, out_b)
    ta.join(30)
    tb.join(30)
    got = [x for x in out_a + out_b if isinstance(x, int)]
    errs = [x for x in out_a + out_b if not isinstance(x, int)]
    assert len(got) == 1 and len(errs) == 1, (out_a, out_b)
    assert isinstance(errs[0], pk.OutOfMemoryError) and errs[0].cause == "limit"
    assert up.counters()["outstanding_bytes"] <= 48 * MiB
    pool.deallocate(got[0])
    pool.validate()
    pool.close()


def test_a_pool_closed_while_its_growth_is_in_the_upstream_gives_the_memory_back():
    # close() needs a quiet pool; a growth already in the upstream when it runs must still not
    # leak: it frees what it got and raises PoolClosedError.
    up, pool = _slow_pool()
    out: list = []
    t, _ = _grow_in_thread(pool, 64 * MiB, out)
    pool.close()
    t.join(30)
    assert isinstance(out[0], pk.PoolClosedError), out
    assert up.counters()["outstanding_bytes"] == 0


def test_a_refused_growth_with_the_lock_let_go_leaves_the_books_whole():
    # The upstream refuses the ramp's step and then the request itself: both claims are dropped.
    up = pk.upstream.Simulated(latency="none", capacity=8 * MiB)
    pool = pk.ArenaPool(up, shards=1, thread_cache_bytes=0, initial_backing=4 * MiB)
    keep = pool.allocate(3 * MiB)
    with pytest.raises(pk.OutOfMemoryError):
        pool.allocate(6 * MiB)
    pool.validate()
    assert pool.stats()["reserved_bytes"] == up.counters()["outstanding_bytes"]
    pool.deallocate(keep)
    pool.close()


def test_a_miss_during_a_growth_in_flight_waits_for_it_instead_of_failing_the_limit():
    # Found by hostile probing: the growth's bytes are claimed while it is in the upstream; a
    # second thread that missed meanwhile found the limit "reached" and raised, though the first
    # thread's new backing was about to hold 7 MiB free. It now waits for that growth to land.
    up = pk.upstream.Simulated(latency_us=1_000_000)
    pool = pk.ArenaPool(up, shards=1, thread_cache_bytes=0, initial_backing=4 * MiB, growth_factor=2.0,
                        limit=12 * MiB)
    first = pool.allocate(4 * MiB)  # the first backing, full
    out: list = []
    t, _ = _grow_in_thread(pool, 1 * MiB, out)  # an 8 MiB ramp step: held 12 MiB while in flight
    second = pool.allocate(1 * MiB)  # served from that step once it lands
    t.join(30)
    assert isinstance(out[0], int), out
    st = pool.stats()
    assert st["upstream_allocations"] == 2 and st["reserved_bytes"] == 12 * MiB, st
    for p in (first, second, out[0]):
        pool.deallocate(p)
    pool.validate()
    pool.close()


def test_threads_that_miss_together_share_one_growth():
    # Found by hostile probing: 8 threads that missed at once each grew a backing of their own
    # (68 MiB reserved for 6 MiB live) and ran the ramp up to max_backing; the lock held through
    # the growth had made them share one. Waiting for the growth in flight does so again.
    up = pk.upstream.Simulated(latency_us=300_000)
    pool = pk.ArenaPool(up, shards=1, thread_cache_bytes=0, initial_backing=4 * MiB, growth_factor=2.0)
    first = pool.allocate(4 * MiB)
    barrier = threading.Barrier(8)
    got: list = []

    def worker():
        barrier.wait(30)
        got.append(pool.allocate(256 * 1024))

    ts = [threading.Thread(target=worker) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    st = pool.stats()
    assert len(got) == 8
    assert st["upstream_allocations"] == 2 and st["reserved_bytes"] == 12 * MiB, st  # one 8 MiB step
    for p in got + [first]:
        pool.deallocate(p)
    pool.validate()
    pool.close()


def test_oversize_requests_grow_side_by_side():
    # Found by hostile probing: a thread waited for any growth in flight, though an oversize
    # request's backing is exactly its size and can serve no one else, so N threads asking for
    # oversize blocks at once paid N upstream calls one after another. A thread now waits only for
    # a growth whose step could serve it too. Four one-second upstream calls side by side take
    # about one second; one after another, four.
    up = pk.upstream.Simulated(latency_us=1_000_000)
    pool = pk.ArenaPool(up, shards=1, thread_cache_bytes=0)
    barrier = threading.Barrier(4)
    got: list = []

    def worker():
        barrier.wait(30)
        got.append(pool.allocate(40 * MiB))

    ts = [threading.Thread(target=worker) for _ in range(4)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    took = time.monotonic() - t0
    assert len(got) == 4
    assert took < 3.0, f"4 oversize growths took {took:.1f} s: they ran one after another"
    assert pool.stats()["upstream_allocations"] == 4
    for p in got:
        pool.deallocate(p)
    pool.validate()
    pool.close()
