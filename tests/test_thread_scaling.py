"""Many threads at once (issue 20): SizeClassPool's shards, ArenaPool's thread cache over the large
classes, and the books under native threads through the C ABI. Behaviour only (call counts,
accounting equations); the timings are benchmarks/thread_scaling.py's business."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import poolkeeper as pk
from poolkeeper import _core

KiB, MiB = 1 << 10, 1 << 20
# Enough shards that the main thread and a fresh worker never share one (threads are numbered
# round robin in the process; two threads share a shard only when numbered 1024 apart).
MANY = 1024


def sim():
    return pk.upstream.Simulated(latency="none")


def in_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # surfaced in the main thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def balanced(pool) -> dict:
    st = pool.stats()
    assert st["reserved_bytes"] == st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]
    return st


def test_size_class_miss_borrows_another_shards_blocks_before_growing():
    # Before shards there was one free list per class; a shard of its own must not make a thread
    # grow the pool while another thread's shard holds the blocks it needs.
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY)

    def worker():
        ps = [pool.allocate(64 * KiB) for _ in range(8)]
        for p in ps:
            pool.deallocate(p)

    in_thread(worker)
    assert up.counters()["allocations"] == 8
    mine = [pool.allocate(64 * KiB) for _ in range(8)]
    st = balanced(pool)
    assert up.counters()["allocations"] == 8  # no growth: borrowed
    assert st["shard_migrations"] == 8 and st["live_blocks"] == 8
    for p in mine:
        pool.deallocate(p)
    pool.validate()


def test_size_class_cross_thread_free_goes_back_to_the_blocks_shard():
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY)
    ps = [pool.allocate(4 * KiB) for _ in range(4)]

    def worker():
        for p in ps:
            pool.deallocate(p)  # another thread frees: the blocks return to the allocator's shard

    in_thread(worker)
    qs = [pool.allocate(4 * KiB) for _ in range(4)]
    st = balanced(pool)
    assert sorted(qs) == sorted(ps) and st["shard_migrations"] == 0 and st["misses"] == 4
    for q in qs:
        pool.deallocate(q)
    pool.validate()


def test_size_class_double_free_from_another_thread_is_still_a_double_free():
    pool = pk.SizeClassPool(sim(), shards=MANY)
    p = pool.allocate(4 * KiB)
    pool.deallocate(p)
    with pytest.raises(pk.errors.InvalidPointerError, match="double free|already freed"):
        in_thread(lambda: pool.deallocate(p))
    with pytest.raises(pk.errors.InvalidPointerError):
        in_thread(lambda: pool.deallocate(p + 256))
    pool.validate()


def test_size_class_trim_and_close_cover_every_shard():
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY)
    for size in (4 * KiB, 1 * MiB):
        in_thread(lambda: pool.deallocate(pool.allocate(size)))
    pool.deallocate(pool.allocate(256 * KiB))
    assert balanced(pool)["free_chunks"] == 3
    assert pool.trim() == 4 * KiB + 1 * MiB + 256 * KiB
    st = balanced(pool)
    assert st["reserved_bytes"] == 0 and up.counters()["outstanding_bytes"] == 0
    pool.close()


def test_size_class_peak_live_is_exact_for_one_thread_with_shards():
    pool = pk.SizeClassPool(sim(), shards=8)
    a = pool.allocate(3000)
    b = pool.allocate(5000)
    pool.deallocate(a)
    c = pool.allocate(1000)
    assert pool.stats()["peak_live_bytes"] == 8000
    pool.deallocate(b)
    pool.deallocate(c)


@pytest.mark.parametrize("bad", [-1, 4096, "x"])
def test_size_class_shards_option_is_checked(bad):
    with pytest.raises(pk.errors.InvalidArgumentError):
        pk.SizeClassPool(sim(), shards=bad)


def test_arena_thread_cache_holds_2mib_blocks_and_trim_reclaims_them_from_an_idle_thread():
    up = sim()
    pool = pk.ArenaPool(up)
    filled, done = threading.Event(), threading.Event()

    def worker():
        ps = [pool.allocate(2 * MiB) for _ in range(8)]
        for p in ps:
            pool.deallocate(p)
        filled.set()
        done.wait(30)  # stays alive and idle: its cache is not folded back by a thread exit

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert filled.wait(30)
        st = balanced(pool)
        assert st["thread_cached_bytes"] == 16 * MiB  # a round of 2 MiB blocks fits the cache
        pool.trim()
        st = balanced(pool)
        assert st["thread_cached_bytes"] == 0 and st["caches_reclaimed"] >= 1
        pool.validate()
    finally:
        done.set()
        t.join()
    pool.close()


@pytest.mark.parametrize("kind", ["size_class", "arena", "direct"])
def test_books_balance_after_native_threads_with_cross_thread_frees(kind):
    pool = {"size_class": lambda up: pk.SizeClassPool(up, shards=2), "arena": pk.ArenaPool,
            "direct": pk.Direct}[kind](sim())
    _core.registry_set(7, pool)
    try:
        r = _core.capi_bench_threads(7, [4 * KiB, 256 * KiB, 2 * MiB, 3 * MiB], 4, 0.2, True)
    finally:
        _core.registry_set(7, None)
    assert r["threads"] == 4 and r["pairs"] > 0 and len(r["per_size"]) == 4
    assert sum(s["pairs"] for s in r["per_size"]) == r["pairs"]
    pool.validate()
    st = balanced(pool)
    assert st["live_blocks"] == 0 and st["live_bytes"] == 0
    pool.trim()
    pool.close()


def test_the_reference_harness_hands_blocks_across_threads_without_a_pool_and_without_crashing():
    # The reference (no pool: each call writes one word of a per-thread record) measures the
    # pattern's own cost. Its free helper first fell off the end of a lambda whose return type was
    # deduced from poolkeeper_free's int: undefined behaviour that ran into the next function and
    # crashed about one run in three with cross-thread frees. A crash is a test failure, so run it
    # in a child with a timeout, several cells in a row, with no pool registered in the slot.
    code = (
        "from poolkeeper import _core\n"
        "for t in (1, 2, 4):\n"
        "    for _ in range(4):\n"
        "        r = _core.capi_bench_threads(9, [4096, 262144, 2097152, 33554432], t, 0.2, True,\n"
        "                                     warmup=0.1, reference=True)\n"
        "        assert r['pairs'] > 0 and sum(s['pairs'] for s in r['per_size']) == r['pairs'], r\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


def test_capi_bench_threads_refuses_bad_arguments():
    with pytest.raises(pk.errors.InvalidArgumentError):
        _core.capi_bench_threads(7, [], 2, 0.1)
    with pytest.raises(pk.errors.InvalidArgumentError):
        _core.capi_bench_threads(7, [4096], 0, 0.1)
    # The threads run with the GIL released: an endless window could not be interrupted (it hung).
    for seconds, warmup in ((float("inf"), 0.0), (1e300, 0.0), (0.1, float("inf"))):
        with pytest.raises(pk.errors.InvalidArgumentError):
            _core.capi_bench_threads(7, [4096], 1, seconds, warmup=warmup, reference=True)
    with pytest.raises(pk.errors.InvalidArgumentError):
        _core.capi_bench_threads(7, [4096] * 65, 1, 0.1, reference=True)


def test_capi_bench_threads_reports_frees_the_registered_pool_refused():
    # Swapping the slot's pool mid-run made every free of the old pool's blocks fail; the benchmark
    # ignored poolkeeper_free's result and reported a normal run (found by hostile probing).
    old, new = pk.ArenaPool(sim()), pk.ArenaPool(sim())
    _core.registry_set(7, old)
    errors = []

    def run():
        try:
            _core.capi_bench_threads(7, [4 * KiB, 3 * MiB], 2, 1.0, True)
        except pk.errors.PoolkeeperError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    _core.registry_set(7, new)
    t.join(timeout=60)
    _core.registry_set(7, None)
    assert not t.is_alive() and errors, "a run whose frees failed must raise"
    new.validate()
    old.validate()


# ---------------------------------------------------------------- ArenaPool shards (issue 20)
# Requests above thread_cache_max_block (2 MiB) are served by the calling thread's home shard.
# The first thread to use a pool is home in shard 0 (the pool's own books); the next in shard 1.


def test_arena_second_thread_large_blocks_live_in_its_own_shard_and_free_from_anywhere():
    up = sim()
    pool = pk.ArenaPool(up, shards=4)
    a = pool.allocate(4 * MiB)  # main thread: shard 0
    b = in_thread(lambda: pool.allocate(4 * MiB))  # worker: shard 1, a backing of its own
    st = balanced(pool)
    assert st["shards"] == 2 and st["backings"] == 2 and st["live_blocks"] == 2
    assert up.counters()["allocations"] == 2
    pool.validate()
    pool.deallocate(b)  # a cross-thread free reaches the owning shard
    in_thread(lambda: pool.deallocate(a))
    st = balanced(pool)
    assert st["live_blocks"] == 0 and st["live_bytes"] == 0
    pool.validate()
    # trim() covers every shard; an inner shard keeps no resident backing (its thread may be gone).
    assert pool.trim() == 4 * MiB
    assert balanced(pool)["reserved_bytes"] == 4 * MiB  # shard 0's resident backing
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0


def test_arena_shard_borrows_a_fitting_chunk_from_another_shard_before_growing():
    up = sim()
    pool = pk.ArenaPool(up, shards=4)
    pool.deallocate(pool.allocate(4 * MiB))  # shard 0 now holds a free 4 MiB chunk
    assert up.counters()["allocations"] == 1
    p = in_thread(lambda: pool.allocate(4 * MiB))  # home shard 1 is empty: borrowed, not grown
    assert up.counters()["allocations"] == 1
    st = balanced(pool)
    assert st["live_blocks"] == 1 and st["backings"] == 1
    pool.deallocate(p)
    pool.validate()
    pool.close()


def test_arena_growth_failure_in_one_shard_takes_back_other_shards_free_backings():
    up = pk.upstream.Simulated(latency="none", capacity=24 * MiB)
    pool = pk.ArenaPool(up, shards=4)
    ready, done = threading.Event(), threading.Event()

    def worker():  # shard 1: leaves a wholly free 16 MiB backing behind, then idles
        pool.deallocate(pool.allocate(16 * MiB))
        ready.set()
        done.wait(30)

    pool.deallocate(pool.allocate(4 * KiB))  # the main thread takes shard 0 first
    t = threading.Thread(target=worker)
    t.start()
    try:
        assert ready.wait(30)
        # Shard 0 cannot borrow 20 MiB anywhere and the upstream has 24 - 2 - 16 MiB left: the
        # idle shard's free backing must go back before this fails.
        p = pool.allocate(20 * MiB)
        st = balanced(pool)
        assert st["live_blocks"] == 1 and st["ooms"] == 0
        pool.deallocate(p)
        pool.validate()
    finally:
        done.set()
        t.join()
    pool.close()


def test_arena_shard_blocks_errors_are_decided_by_the_owning_shard():
    pool = pk.ArenaPool(sim(), shards=4)
    pool.deallocate(pool.allocate(4 * KiB))  # main thread: shard 0
    p = in_thread(lambda: pool.allocate(4 * MiB))  # shard 1
    with pytest.raises(pk.errors.InvalidPointerError) as e:
        pool.deallocate(p + 256)
    assert e.value.reason == "interior"
    pool.deallocate(p)
    with pytest.raises(pk.errors.InvalidPointerError) as e:
        in_thread(lambda: pool.deallocate(p))
    assert e.value.reason == "double_free"
    pool.validate()
    pool.close()


def test_arena_close_counts_live_blocks_in_every_shard():
    pool = pk.ArenaPool(sim(), shards=4)
    pool.deallocate(pool.allocate(4 * KiB))
    p = in_thread(lambda: pool.allocate(4 * MiB))
    with pytest.raises(pk.errors.LiveBlocksError) as e:
        pool.close()
    assert e.value.blocks == 1 and not pool.closed
    pool.deallocate(p)
    pool.close()
    assert pool.closed


def test_arena_one_shard_with_a_limit_or_when_asked():
    for pool in (pk.ArenaPool(sim(), shards=1), pk.ArenaPool(sim(), limit=64 * MiB, shards=4)):
        pool.deallocate(pool.allocate(4 * KiB))
        p = in_thread(lambda: pool.allocate(4 * MiB))
        st = balanced(pool)
        assert st["shards"] == 1 and st["backings"] == 2  # one set of books: the ramp's 2 backings
        pool.deallocate(p)
        pool.close()


@pytest.mark.parametrize("bad", [-1, 65, "x"])
def test_arena_shards_option_is_checked(bad):
    with pytest.raises(pk.errors.InvalidArgumentError):
        pk.ArenaPool(sim(), shards=bad)


def test_capi_bench_threads_samples_every_size_and_takes_a_warm_up():
    pool = pk.ArenaPool(sim())
    _core.registry_set(7, pool)
    try:
        # One thread, two sizes: a timed round every 8 rounds would only ever time the first size.
        r = _core.capi_bench_threads(7, [4 * KiB, 32 * MiB], 1, 0.1, False, warmup=0.05)
        with pytest.raises(pk.errors.InvalidArgumentError):
            _core.capi_bench_threads(7, [4096], 1, 0.1, warmup=-1.0)
    finally:
        _core.registry_set(7, None)
    assert all(s["pairs"] > 0 and s["alloc_p99_ns"] > 0 for s in r["per_size"])  # every size sampled
    balanced(pool)
    pool.close()
