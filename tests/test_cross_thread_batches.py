"""Blocks freed by one thread and allocated by another (issue 20).

A producer/consumer server allocates on one thread and frees on another. At first every such
block crossed the pool lock alone: the consumer's cache filled, the producer's ran dry, and under
many threads every call met on the lock (benchmarks/thread_scaling.py's "mixed, cross-thread frees"
collapsed below one thread's rate). Then a bin's worth crossed under one lock acquisition (a full
cache spilled a bin into the books, a missed allocation refilled a bin from them), still on the
pool lock every thread meets. Now a full cache hands a bin to the transfer cache and a dry one takes
it from there, under a lock of their own; the books see only what the transfer cache has no room
for. These tests count the locked calls.

The expandable arena's shrink scans, too: a piece a loop reuses between scans is not idle, and
giving it back at every scan cost a map and an unmap each time.
"""
from __future__ import annotations

import concurrent.futures
import threading

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20


def _handoff_rounds(pool, nbytes: int, rounds: int, per_round: int = 8) -> None:
    """The calling thread allocates `per_round` blocks per round; a second thread frees them."""
    todo: list = []
    have, done = threading.Event(), threading.Event()
    stop = False

    def consumer():
        while True:
            have.wait()
            have.clear()
            if stop:
                return
            for p in todo:
                pool.deallocate(p)
            todo.clear()
            done.set()

    t = threading.Thread(target=consumer)
    t.start()
    try:
        for _ in range(rounds):
            todo.extend(pool.allocate(nbytes) for _ in range(per_round))
            have.set()
            assert done.wait(30)
            done.clear()
    finally:
        stop = True
        have.set()
        t.join(30)


def test_a_consumer_thread_hands_bins_to_the_producer_without_the_pool_lock():
    # Small caches: the consumer's fills after 16 blocks of 64 KiB.
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=1 * MiB, shards=1)
    rounds, per_round = 200, 8
    _handoff_rounds(pool, 64 * KiB, rounds, per_round)
    st = pool.stats()
    pool.validate()
    blocks = rounds * per_round
    # At first one block per locked call (every producer allocation missed its empty cache, every
    # consumer free past its budget took the lock), then one per bin of 8 (spills and refills
    # through the books). Now only the first rounds take the lock, before the consumer's first
    # handover: then every round's bin crosses through the transfer cache.
    assert st["slow_allocations"] <= blocks // 32, st
    assert st["slow_deallocations"] <= blocks // 32, st
    assert st["transfer_handovers"] >= rounds // 2 and st["transfer_takes"] >= rounds // 2, st
    assert st["cache_refills"] + st["cache_spills"] <= 2, st
    assert st["upstream_allocations"] == 1, st
    assert st["live_bytes"] == 0
    assert st["reserved_bytes"] == st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"] + st["live_bytes"]
    pool.close()


def test_a_full_transfer_cache_leaves_the_rest_to_the_books_and_the_producer_takes_both():
    # The transfer cache holds at most two caches' budgets (2 MiB here): what the consumer frees
    # beyond its own cache and that goes into the books, as before the transfer cache.
    budget = 1 * MiB
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=budget, shards=1)
    ps = [pool.allocate(64 * KiB) for _ in range(96)]  # 6 MiB; this thread has a cache now
    grown = pool.stats()["upstream_allocations"]

    def consume():
        for p in ps:
            pool.deallocate(p)
        return pool.stats()

    with _worker() as w:
        mid = w.submit(consume).result(30)
        pool.validate()
        assert mid["transfer_cached"] == 2 * budget, mid
        assert mid["cache_spills"] + mid["slow_deallocations"] > 0, mid  # the rest: the books
        assert mid["thread_cached_bytes"] <= 3 * budget, mid  # the consumer's cache + the transfer cache
        assert mid["live_bytes"] == 0, mid
        again = [pool.allocate(64 * KiB) for _ in range(96)]
        st = pool.stats()
    assert st["transfer_takes"] >= 4 and st["transfer_cached"] < 2 * budget, st
    assert st["upstream_allocations"] == grown, st  # all of it reused
    _free_all_validate_close(pool, again)


def test_transferred_blocks_are_reclaimed_before_an_out_of_memory_error():
    # Limit 3 MiB. The first 2 MiB backing is handed out in 64 KiB blocks; another thread frees
    # them all: 1 MiB stays in its cache, 1 MiB goes to the transfer cache. A 2 MiB request then
    # fits only once both come back and merge: without the transfer cache in the reclaim, half
    # of the backing stayed out of reach and the request failed inside the limit.
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), limit=3 * MiB, initial_backing=2 * MiB,
                        max_backing=2 * MiB, thread_cache_bytes=1 * MiB)
    ps = [pool.allocate(64 * KiB) for _ in range(32)]
    assert pool.stats()["reserved_bytes"] == 2 * MiB
    with _worker() as w:
        w.submit(lambda: [pool.deallocate(p) for p in ps]).result(30)
        st = pool.stats()
        assert st["transfer_cached"] == 1 * MiB and st["thread_cached_bytes"] == 2 * MiB, st
        big = pool.allocate(2 * MiB)
    st = pool.stats()
    assert st["reserved_bytes"] == 2 * MiB and st["transfer_cached"] == 0, st
    _free_all_validate_close(pool, [big])


def test_the_transfer_cache_empties_when_one_cache_is_left():
    # It is a bridge between caches, and a lone cache never takes from it: when the consumer
    # exits, what it handed over goes back to the books, not stranded until the next reclaim.
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=1 * MiB, shards=1)
    ps = [pool.allocate(64 * KiB) for _ in range(32)]
    t = threading.Thread(target=lambda: [pool.deallocate(p) for p in ps])
    t.start()
    t.join(30)
    # join() returns before the thread's exit hook has run (it runs as the OS thread ends).
    from test_threads import _wait_for
    _wait_for(lambda: pool.stats()["thread_caches"] == 1, "the consumer's cache to be folded back")
    st = pool.stats()
    assert st["transfer_handovers"] >= 1, st
    assert st["transfer_cached"] == 0 and st["thread_cached_bytes"] == 0, st
    assert st["free_bytes"] >= 32 * 64 * KiB, st
    pool.validate()
    pool.close()


def test_a_block_in_the_transfer_cache_freed_again_is_a_double_free_and_the_books_hold():
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=1 * MiB, shards=1)
    ps = [pool.allocate(64 * KiB) for _ in range(32)]
    with _worker() as w:
        w.submit(lambda: [pool.deallocate(p) for p in ps]).result(30)
        assert pool.stats()["transfer_cached"] == 1 * MiB
        # The consumer kept two bins (16 blocks); the other 16 went on to the transfer cache.
        for p in ps:
            with pytest.raises(pk.errors.InvalidPointerError, match="double free|freed"):
                pool.deallocate(p)
            with pytest.raises(pk.errors.InvalidPointerError, match="double free|freed"):
                w.submit(pool.deallocate, p).result(30)
        st = pool.stats()
        assert st["transfer_cached"] == 1 * MiB and st["live_bytes"] == 0, st
        pool.validate()
        again = [pool.allocate(64 * KiB) for _ in range(16)]
        st = pool.stats()
        assert len(set(again)) == 16 and set(again) <= set(ps)  # the transferred blocks, each once
        assert st["transfer_takes"] == 2 and st["transfer_cached"] == 0, st
    _free_all_validate_close(pool, again)


def test_stats_sampled_while_native_threads_pass_bins_across_always_balance():
    # Eight native threads (no GIL), each round's blocks freed by the next thread, while this
    # thread samples stats(): a handover moves bytes from one cache's counters to the transfer
    # cache's, and a sample that read the cache before and the transfer cache after the move would
    # count them twice.
    from test_threads import REGISTRY_DEVICE, _sample_stats_while
    from poolkeeper import _core

    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=1 * MiB, shards=1)
    _core.registry_set(REGISTRY_DEVICE, pool)
    try:
        samples, bad = _sample_stats_while(
            pool, lambda: _core.capi_bench_threads(REGISTRY_DEVICE, [64 * KiB, 256 * KiB], 8, 0.5, True, warmup=0.0))
    finally:
        _core.registry_set(REGISTRY_DEVICE, None)
    st = pool.stats()
    assert st["transfer_handovers"] > 0 and st["transfer_takes"] > 0, st
    assert samples >= 20
    assert not bad, f"{len(bad)} of {samples} samples broke the equation, e.g. {bad[0]}"
    pool.validate()
    pool.trim()
    assert pool.stats()["transfer_cached"] == 0
    pool.validate()
    pool.close()


def test_a_single_thread_pool_keeps_its_free_chunks_in_the_pool():
    # One cache: no batches (free chunks stay in the index, where they merge; the footprint
    # figures are single-threaded and must not move).
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=256 * KiB, shards=1)
    for _ in range(50):
        ps = [pool.allocate(64 * KiB) for _ in range(8)]
        for p in ps:
            pool.deallocate(p)
    st = pool.stats()
    assert st["cache_refills"] == 0 and st["cache_spills"] == 0, st
    assert st["transfer_handovers"] == 0 and st["transfer_cached"] == 0, st
    pool.validate()
    pool.close()


def test_three_rounds_of_2mib_blocks_from_another_thread_stay_in_the_receivers_cache():
    # benchmarks/thread_scaling.py's mixed case: every thread allocates and frees, and a round's
    # blocks arrive from the previous thread out of phase with the receiver's own allocations of
    # that size, up to three rounds of 8 x 2 MiB at once. With a 32 MiB budget (the old default)
    # the receiver's cache overflowed into the shared books and the next round came back from
    # them, both under the pool lock that all 16 threads met on (16 threads 0.72x of one, H200).
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), shards=1)  # default budget
    produced = [pool.allocate(2 * MiB) for _ in range(24)]

    def receiver():
        pool.deallocate(pool.allocate(4 * KiB))  # a cache of its own, as any working thread has
        for p in produced:
            pool.deallocate(p)
        before = pool.stats()
        again = [pool.allocate(2 * MiB) for _ in range(24)]  # its own round of that size, later
        after = pool.stats()
        for p in again:
            pool.deallocate(p)
        return before, after

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        before, after = ex.submit(receiver).result(timeout=60)
    assert before["cache_spills"] == 0, before
    assert after["slow_allocations"] == before["slow_allocations"], (before, after)  # all cache hits
    pool.validate()
    pool.close()


def test_batched_blocks_are_reclaimed_by_trim_and_the_books_balance():
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=1 * MiB, shards=1)
    _handoff_rounds(pool, 64 * KiB, 40)
    pool.trim()  # every thread's cache, the idle consumer's included
    st = pool.stats()
    assert st["thread_cached_bytes"] == 0, st
    pool.validate()
    pool.close()


@pytest.fixture
def fake_vm():
    up = pk.upstream.Simulated(latency="none")
    if not up.supports_virtual:
        pytest.skip("Simulated upstream without virtual memory on this host")
    return up


def test_expandable_pieces_reused_between_scans_are_not_unmapped_at_every_scan(fake_vm):
    # Each round maps nothing new once warm; a scan lands after every round's last free (8
    # releases per round, shrink_interval 8), when every piece is free. Before, two such scans
    # unmapped them all and the next round mapped them again: two upstream calls per piece per
    # two rounds, forever.
    pool = pk.ArenaPool(fake_vm, expandable=True, map_piece=2 * MiB, shrink_interval=8, shrink_hysteresis=2,
                        thread_cache_bytes=0)
    def round_():
        ps = [pool.allocate(2 * MiB) for _ in range(8)]
        for p in ps:
            pool.deallocate(p)
    for _ in range(3):
        round_()
    warm = pool.stats()
    for _ in range(40):
        round_()
    st = pool.stats()
    assert st["shrink_scans"] - warm["shrink_scans"] >= 40
    assert st["map_calls"] == warm["map_calls"], (warm, st)
    assert st["unmap_calls"] == warm["unmap_calls"], (warm, st)
    pool.validate()
    # Left alone, the same pieces do go back after shrink_hysteresis scans.
    pool.shrink_scan()
    pool.shrink_scan()
    assert pool.stats()["unmap_calls"] > st["unmap_calls"]
    pool.validate()
    pool.close()


def _free_all_validate_close(pool, blocks) -> None:
    for p in blocks:
        pool.deallocate(p)
    pool.validate()
    pool.close()


def _worker():
    """One long-lived thread (its home shard stays the same across calls)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1)


def test_blocks_freed_by_another_shards_thread_go_through_the_owners_remote_list():
    # Two shards: the first thread to use the pool lives in shard 0, the next in shard 1. Blocks
    # above the thread cache are served by the allocating thread's shard; freed here, they are
    # pushed on that shard's remote-free list (no lock) and filed when the shard next takes it.
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), shards=2)
    pool.deallocate(pool.allocate(64 * KiB))  # this thread: home shard 0 (nothing there fits 4 MiB)
    w = _worker()
    ps = w.submit(lambda: [pool.allocate(4 * MiB) for _ in range(8)]).result(30)  # home shard 1
    assert pool.stats()["shards"] == 2
    for p in ps:
        pool.deallocate(p)
    st = pool.stats()  # files the remote list first: exact books
    assert st["remote_frees"] == 8, st
    assert st["live_bytes"] == 0 and st["live_blocks"] == 0, st
    pool.validate()
    # The shard's owner reuses them: no growth.
    grown = st["upstream_allocations"]
    ps = w.submit(lambda: [pool.allocate(4 * MiB) for _ in range(8)]).result(30)
    assert pool.stats()["upstream_allocations"] == grown
    w.shutdown()
    _free_all_validate_close(pool, ps)


def test_a_remote_freed_block_freed_again_is_a_typed_error_and_the_books_hold():
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), shards=2)
    pool.deallocate(pool.allocate(64 * KiB))
    with _worker() as w:
        p = w.submit(pool.allocate, 4 * MiB).result(30)
    pool.deallocate(p)  # pushed, not yet filed
    with pytest.raises(pk.errors.InvalidPointerError, match="double free|freed"):
        pool.deallocate(p)
    st = pool.stats()
    assert st["live_bytes"] == 0 and st["remote_frees"] == 1, st
    pool.validate()
    pool.close()


def test_a_thread_whose_shard_cannot_be_made_is_served_by_shard_0(fake_vm):
    # Each expandable shard reserves a range of its own; the Simulated device's address space
    # holds only three of the default size. The fourth thread's shard cannot be made: that
    # thread used to get UpstreamOutOfMemoryError on every large request with 4 MiB reserved.
    pool = pk.ArenaPool(fake_vm, expandable=True, shards=8)
    ps = []
    for _ in range(6):
        with _worker() as w:
            ps.append(w.submit(pool.allocate, 4 * MiB).result(30))
    st = pool.stats()
    assert st["shard_fallbacks"] >= 1, st
    assert st["shards"] <= 4, st
    _free_all_validate_close(pool, ps)


def test_out_of_memory_in_a_shard_reports_the_whole_pools_figures():
    # The error came from the thread's home shard with that shard's books: "8.00 MiB reserved by
    # this pool, 8.00 MiB live" while 72 MiB were live in the pool (found by hostile probing).
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), shards=4)
    a = pool.allocate(64 * MiB)  # this thread: shard 0
    with _worker() as w:
        keep = w.submit(pool.allocate, 8 * MiB).result(30)  # home shard 1
        with pytest.raises(pk.errors.OutOfMemoryError) as e:
            w.submit(pool.allocate, 1 << 40).result(30)
    assert e.value.live == 72 * MiB and e.value.reserved == 72 * MiB, str(e.value)
    assert "72.00 MiB live" in str(e.value)
    assert pool.stats()["ooms"] == 1
    _free_all_validate_close(pool, [keep, a])


def test_blocks_in_the_transfer_cache_serve_other_sizes_before_the_pool_grows():
    # A burst of 2 MiB blocks freed by another thread, then the allocating thread moves on to
    # 1 MiB blocks. The consumer keeps two bins (32 MiB); the rest of what it freed but what the
    # transfer cache holds (up to two caches' budgets, 128 MiB) went to the books. The transfer
    # cache's blocks are free memory nobody owns: before any growth they go back to the books and
    # merge like the rest. Without that the 1 MiB phase grew the pool from 227 to 470 MiB with
    # 200 MiB live (the build before the transfer cache: no growth at all).
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), shards=1)  # default budget, 64 MiB
    with _worker() as w:
        w.submit(lambda: pool.deallocate(pool.allocate(4 * KiB))).result(30)  # a working thread's cache
        ps = [pool.allocate(2 * MiB) for _ in range(100)]
        w.submit(lambda: [pool.deallocate(p) for p in ps]).result(30)
        mid = pool.stats()
        assert mid["transfer_cached"] > 0, mid  # the scenario: a burst the transfer cache took
        consumer_cache = mid["thread_cached_bytes"] - mid["transfer_cached"]
        # All that the consumer's own cache does not hold, in 1 MiB blocks.
        n = (mid["reserved_bytes"] - consumer_cache) // MiB - 8
        qs = [pool.allocate(1 * MiB) for _ in range(n)]
        st = pool.stats()
        assert st["upstream_allocations"] == mid["upstream_allocations"], (mid, st)
        assert st["peak_reserved_bytes"] == mid["reserved_bytes"], (mid, st)
        pool.validate()
    _free_all_validate_close(pool, qs)


def test_sizes_nobody_asks_for_again_do_not_keep_a_new_size_out_of_the_transfer_cache():
    # Eight sizes, each freed by the other thread in one burst and never asked for again, take
    # the transfer cache's eight slots. A ninth size then passed between the threads must still
    # get one: before, every round of it went through the pool lock (a spill into the books and a
    # refill from them, 199 of each in 200 rounds), the transfer cache full of blocks nobody takes,
    # until a trim(), synchronize(), growth or out-of-memory error happened to flush it.
    pool = pk.ArenaPool(pk.upstream.Simulated(latency="none"), thread_cache_bytes=4 * MiB, shards=1)
    with _worker() as w:
        w.submit(lambda: pool.deallocate(pool.allocate(4 * KiB))).result(30)
        pool.deallocate(pool.allocate(16 * MiB))  # room for everything below: no growth, no pressure pass
        for k in range(8):
            ps = [pool.allocate((17 + k) * KiB) for _ in range(24)]
            w.submit(lambda: [pool.deallocate(p) for p in ps]).result(30)
        before = pool.stats()
        assert before["transfer_handovers"] >= 8 and before["transfer_cached"] > 0, before  # the slots are taken
        rounds = 200
        for _ in range(rounds):
            ps = [pool.allocate(64 * KiB) for _ in range(8)]
            w.submit(lambda: [pool.deallocate(p) for p in ps]).result(30)
        st = pool.stats()
        pool.validate()
    locked = {k: st[k] - before[k] for k in ("slow_allocations", "slow_deallocations", "cache_refills", "cache_spills")}
    assert locked["cache_spills"] + locked["cache_refills"] <= 8, locked
    assert locked["slow_deallocations"] <= 8 and locked["slow_allocations"] <= 32, locked
    assert st["transfer_takes"] - before["transfer_takes"] >= rounds // 2, (before, st)
    assert st["upstream_allocations"] == before["upstream_allocations"], (before, st)
    pool.close()
