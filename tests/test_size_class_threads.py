"""SizeClassPool under many threads (issue 20): a block freed by a thread other than the one that
allocated it goes back to the allocating shard lock-free (its remote list), is reused there, and
the pool takes from the upstream only what the live set needs. Behaviour only (call counts,
accounting equations, which error); the timings are benchmarks/thread_scaling.py's business."""
from __future__ import annotations

import queue
import threading

import pytest

import poolkeeper as pk
from poolkeeper import _core

import capi_lib
from test_thread_scaling import MANY, balanced, in_thread, sim  # (MANY: a shard per thread)

KiB, MiB = 1 << 10, 1 << 20
DEVICE = 7  # registry slot for the C-ABI tests


def free_all(pool, ps):
    for p in ps:
        pool.deallocate(p)


def test_cross_thread_frees_go_lock_free_to_the_allocating_shard_and_are_reused_there():
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY)
    ps = [pool.allocate(64 * KiB) for _ in range(8)]
    in_thread(lambda: free_all(pool, ps))  # another shard's thread: the remote list, no lock
    st = balanced(pool)  # an observation point files the list: free at once
    assert st["remote_frees"] == 8
    assert st["live_blocks"] == 0 and st["free_chunks"] == 8 and st["free_bytes"] == 8 * 64 * KiB
    pool.validate()
    qs = [pool.allocate(64 * KiB) for _ in range(8)]
    st = balanced(pool)
    assert sorted(qs) == sorted(ps)  # reused by the shard that allocated them
    assert st["shard_migrations"] == 0 and up.counters()["allocations"] == 8
    free_all(pool, qs)  # the allocating thread's own frees take its lock, not the remote list
    assert balanced(pool)["remote_frees"] == 8
    pool.validate()
    pool.close()


@pytest.mark.parametrize("reuser", ["allocating thread", "third thread"])
def test_a_miss_files_the_remote_list_before_it_borrows_or_grows(reuser):
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY)
    ps = [pool.allocate(4 * KiB) for _ in range(4)]
    in_thread(lambda: free_all(pool, ps))  # on the main thread's shard's remote list
    # No observation in between: the allocation itself must find the blocks on the remote list --
    # in its own shard, or (a third thread, a third shard) filed by its borrow -- and not grow.
    take = lambda: [pool.allocate(4 * KiB) for _ in range(4)]  # noqa: E731
    qs = take() if reuser == "allocating thread" else in_thread(take)
    assert sorted(qs) == sorted(ps) and up.counters()["allocations"] == 4
    st = balanced(pool)
    assert st["live_blocks"] == 4 and st["remote_frees"] == 4
    if reuser == "allocating thread":
        assert st["shard_migrations"] == 0 and st["misses"] == 4
    else:
        assert st["shard_migrations"] >= 1
    free_all(pool, qs)
    pool.validate()


def test_trim_and_close_take_back_blocks_on_remote_lists():
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY)
    ps = [pool.allocate(256 * KiB) for _ in range(3)]
    in_thread(lambda: free_all(pool, ps))
    assert pool.trim() == 3 * 256 * KiB  # filed, then released: nothing left behind on the list
    assert up.counters()["outstanding_bytes"] == 0
    qs = [pool.allocate(2 * MiB) for _ in range(2)]
    in_thread(lambda: free_all(pool, qs))
    pool.close()  # no live blocks: the remote-freed ones are not counted live
    assert pool.closed and up.counters()["outstanding_bytes"] == 0


def test_a_second_free_of_a_remote_freed_block_is_a_double_free():
    pool = pk.SizeClassPool(sim(), shards=MANY)
    p = pool.allocate(4 * KiB)
    in_thread(lambda: pool.deallocate(p))  # remote list, not filed yet
    with pytest.raises(pk.errors.InvalidPointerError) as e:
        in_thread(lambda: pool.deallocate(p))
    assert e.value.reason == "double_free"
    with pytest.raises(pk.errors.InvalidPointerError) as e:
        pool.deallocate(p)  # from the allocating thread too
    assert e.value.reason == "double_free"
    st = balanced(pool)
    assert st["live_blocks"] == 0 and st["free_chunks"] == 1 and st["remote_frees"] == 1
    pool.validate()


def test_remote_frees_keep_the_cache_cap():
    up = sim()
    pool = pk.SizeClassPool(up, shards=MANY, max_cached_bytes=128 * KiB)
    ps = [pool.allocate(64 * KiB) for _ in range(4)]
    in_thread(lambda: free_all(pool, ps))
    st = balanced(pool)
    # Two fit under the cap (lock-free); the other two go back upstream (the locked path).
    assert st["free_bytes"] == 128 * KiB and st["remote_frees"] == 2
    assert up.counters()["deallocations"] == 2
    pool.validate()
    pool.close()


def test_peak_live_does_not_count_blocks_waiting_on_the_remote_list():
    pool = pk.SizeClassPool(sim(), shards=MANY)
    ps = [pool.allocate(4 * KiB) for _ in range(4)]  # 16 KiB live
    in_thread(lambda: free_all(pool, ps))  # 0 live (the shard's books still say 16 KiB)
    qs = [pool.allocate(8 * KiB) for _ in range(4)]  # 32 KiB live: the peak, not 48 KiB
    assert pool.stats()["peak_live_bytes"] == 32 * KiB
    free_all(pool, qs)
    pool.validate()


def test_producers_and_consumers_through_the_c_abi_take_only_what_the_live_set_needs():
    # Native concurrency: ctypes drops the GIL in every C-ABI call. Producers allocate one class in
    # batches and queue them; consumers on other threads free them. Whatever the interleaving,
    # at most LIVE blocks are live at once, so the upstream must never be asked for more than
    # that (plus a little for a miss racing a free), however many rounds run.
    lib = capi_lib.load()
    up = sim()
    pool = pk.SizeClassPool(up)
    producers, consumers, rounds, batch, depth = 3, 3, 150, 8, 4
    LIVE = batch * (depth + producers + consumers)  # queued + one batch in each thread's hands
    q: queue.Queue = queue.Queue(maxsize=depth)
    errors = []

    def produce():
        try:
            for _ in range(rounds):
                ps = [lib.poolkeeper_malloc(64 * KiB, DEVICE, capi_lib.NO_STREAM) for _ in range(batch)]
                assert all(ps), capi_lib.last_error(lib)
                q.put(ps)
        except BaseException as e:
            errors.append(e)

    def consume():
        try:
            while (ps := q.get()) is not None:
                for p in ps:
                    assert lib.poolkeeper_free(p, DEVICE, capi_lib.NO_STREAM) == capi_lib.OK, capi_lib.last_error(lib)
        except BaseException as e:
            errors.append(e)

    _core.registry_set(DEVICE, pool)
    try:
        for _ in range(2):  # a second phase on new threads (new shards) must not grow the pool
            cs = [threading.Thread(target=consume) for _ in range(consumers)]
            ps = [threading.Thread(target=produce) for _ in range(producers)]
            for t in cs + ps:
                t.start()
            for t in ps:
                t.join()
            for _ in cs:
                q.put(None)
            for t in cs:
                t.join()
            assert not errors, errors
    finally:
        _core.registry_set(DEVICE, None)
    st = balanced(pool)
    assert st["live_blocks"] == 0
    assert st["remote_frees"] > 0  # the consumers' frees went lock-free to the producers' shards
    assert up.counters()["allocations"] <= LIVE + batch
    assert up.counters()["deallocations"] == 0
    pool.validate()
    pool.trim()
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0
