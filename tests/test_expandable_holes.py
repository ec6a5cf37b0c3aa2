"""Expandable arena: free pieces anywhere in the range are unmapped (holes) and refilled lowest first.

The books: every backing of an expandable pool is a segment (a run of consecutive mapped pieces);
holes between segments carry no chunk, so nothing there can be handed out. validate() proves the
segments cover exactly the mapped pieces; accounting.check re-verifies the partition from the
snapshot.
"""
from __future__ import annotations

import random

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.accounting import check
from poolkeeper.errors import OutOfMemoryError

from expandable_helpers import G, KiB, MiB, pool_in_granules, sim  # noqa: F401
from expandable_traffic import random_traffic


def consistent(pool, up=None):
    pool.validate()
    check(pool.snapshot())
    st = pool.stats()
    assert st["reserved_bytes"] == st["mapped_bytes"]
    if up is not None:
        assert st["reserved_bytes"] == up.counters()["outstanding_bytes"]
    # A stitched range is one backing per run of its parts still in the books (stitched_backings).
    assert st["backings"] == st["holes"] + (1 if st["mapped_bytes"] else 0) + st["stitched_backings"]
    assert st["stitched_backings"] >= (1 if st["stitched_bytes"] else 0)
    return st


def segments(pool):
    return [(b["address"], b["size"]) for b in pool.snapshot().to_dict()["backings"]]


def test_a_free_middle_piece_is_unmapped_and_the_hole_refilled_lowest_first():
    up = sim()
    pool = pool_in_granules(up)
    blocks = [pool.allocate(G) for _ in range(5)]
    base = blocks[0]
    pool.deallocate(blocks[1])
    pool.deallocate(blocks[3])
    assert pool.trim() == 2 * G  # both middle pieces go, the live tail stays
    st = consistent(pool, up)
    assert (st["holes"], st["hole_bytes"], st["unmap_calls"], st["hole_unmaps"]) == (2, 2 * G, 2, 2)
    assert segments(pool) == [(base, G), (base + 2 * G, G), (base + 4 * G, G)]
    # Growth maps the lowest hole back and carves it; the segments on both sides join.
    p = pool.allocate(G)
    assert p == base + G
    st = consistent(pool, up)
    assert (st["holes"], st["map_calls"], st["hole_refills"]) == (1, 6, 1)
    q = pool.allocate(G)
    assert q == base + 3 * G
    st = consistent(pool, up)
    assert st["holes"] == 0 and st["backings"] == 1 and st["reserved_bytes"] == 5 * G
    for x in (blocks[0], blocks[2], blocks[4], p, q):
        pool.deallocate(x)
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0 and up.counters()["unreserves"] == 1


def test_a_request_larger_than_a_hole_uses_the_hole_with_its_free_neighbours():
    up = sim()
    pool = pool_in_granules(up)
    a, b, c, d = (pool.allocate(G) for _ in range(4))
    pool.deallocate(b)
    pool.trim()  # b's piece is a hole now
    pool.deallocate(c)  # free right after the hole
    p = pool.allocate(2 * G)  # hole (mapped back) + c's free chunk
    assert p == a + G
    st = consistent(pool, up)
    assert st["holes"] == 0 and st["reserved_bytes"] == 4 * G and st["map_calls"] == 5
    for x in (a, d, p):
        pool.deallocate(x)
    pool.close()


def test_only_whole_pieces_go_and_the_resident_first_piece_stays():
    up = sim()
    pool = pool_in_granules(up, map_piece=G)
    a = pool.allocate(G)
    b = pool.allocate(G + 4 * KiB)  # spans two pieces (one step, two map calls)
    c = pool.allocate(G)
    pool.deallocate(a)
    assert pool.trim() == 0  # a is the resident first piece; b's pieces are partly live
    pool.deallocate(b)
    freed = pool.trim()
    assert freed == G  # b's first piece only: its second shares a granule with c
    consistent(pool, up)
    pool.deallocate(c)
    pool.close()


def test_map_piece_splits_a_growth_step_so_its_granules_can_go_alone():
    up = sim()
    pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=8 * G,
                        map_piece=G, thread_cache_bytes=0)
    a = pool.allocate(G)
    big = pool.allocate(6 * G)  # one step of 6 granules: six map calls
    c = pool.allocate(G)
    assert pool.stats()["map_calls"] == 1 + 6 + 1
    pool.deallocate(big)
    assert pool.trim() == 6 * G
    st = consistent(pool, up)
    assert st["holes"] == 1 and st["hole_bytes"] == 6 * G
    # Six unmaps in the books, asked of the upstream as one run (adjacent pieces).
    assert (st["unmap_calls"], st["unmap_runs"], up.counters()["unmaps"]) == (6, 1, 6)
    for x in (a, c):
        pool.deallocate(x)
    pool.close()


def test_a_refused_unmap_inside_a_run_keeps_the_run_s_first_pieces_mapped():
    """Six adjacent free pieces go as one run, last first; the third unmap of it is refused: the
    two after it are out of the books, it and the three before it stay mapped and free, and the
    next trim takes them."""
    inner = sim()
    up = pk.upstream.Faulty(inner, fail_frees=True, armed=False, fail_at=[10])
    pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=8 * G,
                        map_piece=G, thread_cache_bytes=0)
    a = pool.allocate(G)
    big = pool.allocate(6 * G)
    c = pool.allocate(G)
    pool.deallocate(big)
    up.armed = True  # watched calls 0-7 were the maps; the run's unmaps are 8, 9, 10 (refused)
    assert pool.trim() == 2 * G
    st = consistent(pool, inner)
    assert (st["unmap_failures"], st["unmap_runs"], st["unmap_calls"], st["reserved_bytes"]) == (1, 1, 2, 6 * G)
    assert st["free_bytes"] == 4 * G
    up.armed = False
    assert pool.trim() == 4 * G
    st = consistent(pool, inner)
    assert (st["unmap_runs"], st["unmap_calls"]) == (2, 6)
    for x in (a, c):
        pool.deallocate(x)
    pool.close()
    assert inner.counters()["outstanding_bytes"] == 0


def test_shrink_scans_unmap_a_middle_piece_only_after_the_hysteresis():
    up = sim()
    pool = pool_in_granules(up, shrink_hysteresis=2, shrink_interval=0)
    a, b, c = (pool.allocate(G) for _ in range(3))
    pool.deallocate(b)
    assert pool.shrink_scan() == 0  # first scan: seen free once
    b2 = pool.allocate(G)  # live at the next scan: the count restarts
    assert b2 == b and pool.shrink_scan() == 0
    pool.deallocate(b2)
    assert pool.shrink_scan() == 0
    assert pool.shrink_scan() == G
    consistent(pool, up)
    for x in (a, c):
        pool.deallocate(x)
    pool.close()


def test_a_growth_that_fills_a_hole_keeps_the_last_hand_out_of_the_free_chunk_it_joins():
    """A growth into a hole merged the free chunk after the hole into its own, and the merged
    chunk forgot that chunk's hand-out: a piece used since the last scan counted idle for two
    scans and was unmapped at the next one (review)."""
    up = sim()
    pool = pool_in_granules(up, shrink_hysteresis=2, shrink_interval=0, map_piece=G)
    a0, a1, a2 = pool.allocate(G), pool.allocate(G), pool.allocate(2 * G)
    h, a5 = pool.allocate(2 * G), pool.allocate(G)
    pool.deallocate(a2)
    pool.trim()  # a two-piece hole before h
    pool.deallocate(h)
    assert pool.shrink_scan() == 0  # h's pieces free once
    x = pool.allocate(2 * G)
    assert x == h  # handed out again after that scan
    pool.deallocate(x)
    y = pool.allocate(3 * G)  # maps the hole and joins x's free chunk: h's second piece stays free
    unmaps = pool.stats()["unmap_calls"]
    assert pool.shrink_scan() == 0 and pool.stats()["unmap_calls"] == unmaps  # used since the last scan
    consistent(pool, up)
    for p in (a0, a1, a5, y):
        pool.deallocate(p)
    pool.close()


def test_pending_releases_are_never_unmapped_until_their_stream_is_done():
    up = sim()
    pool = pool_in_granules(up)
    s = up.stream()
    a, b, c = (pool.allocate(G, s) for _ in range(3))
    up.enqueue(s, 100.0)  # the stream is still working on b
    pool.deallocate(b, s)
    assert pool.trim() == 0  # trim settles what completed; b has not
    st = consistent(pool, up)
    assert st["pending_bytes"] == G and st["unmap_calls"] == 0
    up.advance(200.0)
    assert pool.trim() == G
    consistent(pool, up)
    for x in (a, c):
        pool.deallocate(x, s)
    pool.synchronize()
    pool.close()


def test_thread_cached_blocks_are_never_unmapped():
    up = sim()
    pool = pool_in_granules(up, thread_cache_bytes=8 * MiB, thread_cache_max_block=G)
    a, b, c = (pool.allocate(G) for _ in range(3))
    pool.deallocate(b)  # parked in this thread's cache
    assert pool.shrink_scan() == 0 and pool.shrink_scan() == 0  # scans never flush caches
    consistent(pool, up)
    assert pool.trim() == G  # trim returns the caches first: now it is free
    consistent(pool, up)
    for x in (a, c):
        pool.deallocate(x)
    pool.close()


def test_no_unmap_while_a_capture_scope_is_open():
    up = pk.upstream.Simulated(latency="none")
    pool = pool_in_granules(up)
    gp = _core.GraphPools(pool)
    s = up.stream()
    a, b, c = (pool.allocate(G) for _ in range(3))
    pool.deallocate(b)
    gp.begin((1, 0), s)
    up.begin_capture(s)
    try:
        assert pool.trim() == 0 and pool.shrink_scan() == 0 and pool.shrink_scan() == 0
        assert pool.stats()["unmap_calls"] == 0
    finally:
        valid = up.end_capture(s)
        gp.end((1, 0))
    assert valid and up.capture_violations == 0
    assert pool.trim() == G
    consistent(pool)
    for x in (a, c):
        pool.deallocate(x)
    pool.close()


def test_oom_recovery_unmaps_middle_holes_but_keeps_the_free_tail():
    up = sim(capacity=8 * G)
    pool = pool_in_granules(up)
    blocks = [pool.allocate(G) for _ in range(6)]
    keep = blocks[0::2]
    for p in blocks[1::2]:
        pool.deallocate(p)  # the odd granules are free: 3 free pieces, none adjacent, one the tail
    # 6 G mapped, 3 G free in 1 G holes: a 4 G request cannot fit, and 2 G is left on the device.
    p = pool.allocate(4 * G)
    st = consistent(pool, up)
    assert st["reserved_bytes"] <= 8 * G and st["oom_retries"] == 1
    assert st["unmap_calls"] == 2  # the two middle holes; the free tail was extended
    pool.deallocate(p)
    for x in keep:
        pool.deallocate(x)
    pool.close()


def test_a_refused_unmap_mid_walk_leaves_the_pool_consistent():
    inner = sim()
    up = pk.upstream.Faulty(inner, fail_frees=True, armed=False, fail_at=[7])
    pool = pool_in_granules(up)
    blocks = [pool.allocate(G) for _ in range(6)]
    for p in blocks[1::2]:
        pool.deallocate(p)
    up.armed = True
    # Watched calls 0-5 were the maps; the unmaps of pieces 5, 3, 1 are calls 6, 7, 8: the second
    # is refused and the walk stops.
    freed = pool.trim()
    st = consistent(pool, inner)
    assert st["unmap_failures"] == 1 and freed == G and st["reserved_bytes"] == 5 * G
    up.armed = False
    assert pool.trim() == 2 * G
    consistent(pool, inner)
    for p in blocks[0::2]:
        pool.deallocate(p)
    pool.close()
    assert inner.counters()["outstanding_bytes"] == 0


# An OOM is retried once after recovery (map #4, refused too); a failure is not retried.
@pytest.mark.parametrize("error,exc,fail_at", [("oom", OutOfMemoryError, [3, 4]),
                                               ("upstream", pk.errors.UpstreamError, [3])])
def test_a_refused_map_mid_step_keeps_what_was_mapped_and_stays_consistent(error, exc, fail_at):
    inner = sim()
    up = pk.upstream.Faulty(inner, fail_at=fail_at, error=error)
    pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0, max_step=8 * G,
                        map_piece=G, thread_cache_bytes=0)
    a = pool.allocate(G)  # map #0
    with pytest.raises(exc):
        pool.allocate(4 * G)  # maps #1, #2 succeed, #3 is refused
    st = consistent(pool, inner)
    assert st["reserved_bytes"] == 3 * G and st["live_bytes"] == G and st["free_bytes"] == 2 * G
    p = pool.allocate(4 * G)  # the two mapped granules are reused, two more mapped
    st = consistent(pool, inner)
    assert st["reserved_bytes"] == 5 * G
    for x in (a, p):
        pool.deallocate(x)
    pool.close()
    assert inner.counters()["outstanding_bytes"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_multi_stream_traffic_with_holes_stays_consistent(seed):
    rng = random.Random(seed)
    inner = sim(capacity=96 * MiB)
    up = pk.upstream.Faulty(inner, fail_every=7, fail_frees=True, armed=False)
    pool = pk.ArenaPool(up, expandable=True, initial_backing=G, step_fraction=0.0625, max_step=8 * MiB,
                        shrink_interval=16, map_piece=G if seed % 3 else 0,
                        release_on_grow=seed % 2 == 1, thread_cache_bytes=256 * KiB if seed % 2 else 0)
    sizes = [256, 4 * KiB, 100 * KiB, MiB, 3 * MiB + 7]
    random_traffic(pool, inner, up, rng, 500, lambda: rng.choice(sizes + [rng.randint(1, 9 * MiB)]),
                   lambda: consistent(pool, inner))
    c = inner.counters()
    assert c["outstanding_bytes"] == 0 and c["maps"] == c["unmaps"] and c["unreserves"] == c["reserves"]
