"""Conformance: the contract every pool keeps, run over every pool x upstream (conftest fixtures).

Blocks are aligned and disjoint (tracked as intervals, and on Host memory checked for real with
payload cookies), the accounting equation holds after every step, ``validate()`` passes after
every step, snapshots re-verify, ``live_bytes`` is the sum of the requested sizes, and the
lifecycle (trim, close, context manager, use after close, close with live blocks) behaves.
"""
from __future__ import annotations

import random

import pytest

import poolkeeper as pk
from poolkeeper.errors import LiveBlocksError, PoolClosedError
from pool_variants import VARIANTS
from pool_oracle import Oracle, pick, state

KiB, MiB = 1 << 10, 1 << 20
ALIGN = 256

# Every pool kind, those that need virtual memory included (conftest's make_pool skips them on
# upstreams without it), and the variants (pool_variants.py).
@pytest.fixture(params=sorted(pk.pools.KINDS) + VARIANTS)
def pool_kind(request):
    return request.param


def _class_edges() -> list[int]:
    # SizeClassPool's default classes (4 per doubling) from 1 KiB to 4 MiB: each edge and its
    # neighbours on both sides.
    out = []
    c = 1 * KiB
    while c <= 4 * MiB:
        for k in range(4):
            e = c + k * c // 4
            out += [e - 1, e, e + 1]
        c *= 2
    return out


# Sizes that sit on the pools' boundaries: the alignment, the linear size classes, the arena's
# 128 fast bins (up to 128 * 256 B), its initial backing in the fixture (64 KiB), the thread
# cache's largest block and the fixture's max backing (both 1 MiB: above it, oversize backings).
BOUNDARY_SIZES = sorted(
    set(
        [1, 2, 7, 8, 255, 256, 257, 511, 512, 513, 767, 768, 769]
        + [128 * ALIGN - 1, 128 * ALIGN, 128 * ALIGN + 1, 129 * ALIGN]
        + [64 * KiB - 1, 64 * KiB, 64 * KiB + 1]
        + [MiB - 1, MiB, MiB + 1, MiB + ALIGN]
        + [2 * MiB - 1, 3 * MiB + 7, 4 * MiB]
        + _class_edges()
    )
)


def streams_for(up) -> list:
    return [up.stream() for _ in range(3)] if hasattr(up, "stream") else [1, 2, 3]


def random_size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.45:
        return rng.choice(BOUNDARY_SIZES)
    if r < 0.85:
        return rng.randint(1, 64 * KiB)
    return rng.randint(64 * KiB, 4 * MiB)


# ---------------------------------------------------------------------------------- basic blocks


def test_boundary_sizes_are_aligned_disjoint_and_accounted(pool):
    o = Oracle(pool)
    for n in BOUNDARY_SIZES:
        o.allocate(n)
        o.check()
    o.check(snapshot=True)
    # Free every other block, then the rest backwards: the pool reuses holes of every size.
    ptrs = sorted(o.live)
    for p in ptrs[::2]:
        o.deallocate(p)
        o.check()
    for n in BOUNDARY_SIZES[::3]:
        o.allocate(n)
        o.check()
    o.check(snapshot=True)
    for p in sorted(o.live, reverse=True):
        o.deallocate(p)
        o.check()
    st = o.check(snapshot=True)
    assert st["live_bytes"] == 0 and st["live_blocks"] == 0


def test_live_bytes_are_the_requested_sizes_not_the_rounded_ones(pool):
    o = Oracle(pool)
    for n in (1, 300, 1000, 5000):
        o.allocate(n)
    st = o.check()
    assert st["live_bytes"] == 6301
    # The slack of rounding is overhead, never live and never free.
    assert st["overhead_bytes"] >= sum(o.span(n) - n for n in (1, 300, 1000, 5000))
    o.free_all()
    st = o.check(snapshot=True)
    assert st["live_bytes"] == 0 and st["overhead_bytes"] == 0
    assert st["peak_live_bytes"] >= 6301


def test_each_step_keeps_the_accounting_equation(pool):
    o = Oracle(pool)
    for i in range(200):
        o.allocate(1 + (i * 7919) % (300 * KiB))
        if i % 3 == 2:
            o.deallocate(pick(random.Random(i), sorted(o.live)))
        o.check(snapshot=i % 25 == 0)
    o.free_all()
    o.check(snapshot=True)


def test_a_freed_block_is_reused_without_an_upstream_call_where_the_pool_caches(pool_kind, pool):
    o = Oracle(pool)
    p = o.allocate(4000)
    o.deallocate(p)
    before = pool.stats()["upstream_allocations"]
    q = o.allocate(4000)
    after = pool.stats()["upstream_allocations"]
    if pool_kind == "direct":
        assert after == before + 1  # the pass-through baseline pays for every allocation
    else:
        assert after == before
    o.deallocate(q)
    o.check(snapshot=True)


# ---------------------------------------------------------------------------------- lifecycle


def test_free_everything_then_trim_keeps_only_the_resident_backing(pool):
    o = Oracle(pool)
    for n in BOUNDARY_SIZES:
        o.allocate(n)
    o.free_all()
    pool.synchronize()
    before = o.check()
    released = pool.trim()
    after = o.check(snapshot=True)
    assert isinstance(released, int) and released >= 0
    assert after["reserved_bytes"] == before["reserved_bytes"] - released
    assert all(b.resident for b in pool.snapshot().backings), "trim left a non-resident backing"
    assert after["live_bytes"] == after["pending_bytes"] == 0
    assert pool.trim() == 0  # nothing left to give back
    # Still serves after a trim.
    o.allocate(12345)
    o.free_all()
    o.check()


def test_close_returns_every_byte_to_the_upstream(pool, upstream):
    o = Oracle(pool)
    for n in BOUNDARY_SIZES:
        o.allocate(n)
    o.free_all()
    pool.close()
    assert pool.closed
    c = upstream.counters()
    assert c["outstanding_bytes"] == 0
    assert c["allocations"] == c["deallocations"] > 0
    pool.close()  # idempotent


def test_close_waits_for_pending_releases(make_pool, sim):
    pool = make_pool(sim)
    s = sim.stream()
    o = Oracle(pool)
    ptrs = [o.allocate(n, s) for n in (1000, 70 * KiB, 2 * MiB)]
    sim.enqueue(s, 500.0)
    for p in ptrs:
        o.deallocate(p, s)
    o.check()
    pool.close()  # nothing live: pending releases are waited for, then everything goes back
    assert sim.counters()["outstanding_bytes"] == 0


def test_context_manager_closes(make_pool, upstream):
    with make_pool(upstream) as pool:
        o = Oracle(pool)
        for n in (1, 5000, 2 * MiB):
            o.allocate(n)
        o.free_all()
        o.check()
    assert pool.closed
    assert upstream.counters()["outstanding_bytes"] == 0


def test_context_manager_on_error_keeps_the_error_and_the_live_blocks(make_pool, upstream):
    with pytest.raises(KeyError, match="boom"):
        with make_pool(upstream) as pool:
            o = Oracle(pool)
            p = o.allocate(4096)
            raise KeyError("boom")
    # The pool could not close under a live block: it stays open and intact.
    assert not pool.closed
    o.check(snapshot=True)
    o.deallocate(p)
    pool.close()
    assert upstream.counters()["outstanding_bytes"] == 0


def test_use_after_close_raises_pool_closed(pool):
    p = pool.allocate(1000)
    pool.deallocate(p)
    pool.close()
    with pytest.raises(PoolClosedError, match="closed"):
        pool.allocate(1000)
    with pytest.raises(PoolClosedError, match="closed"):
        pool.deallocate(p)
    with pytest.raises(PoolClosedError, match="closed"):
        pool.allocate(1000, 3)
    st = pool.stats()  # still readable, and empty
    assert st["reserved_bytes"] == st["live_bytes"] == 0


def test_close_with_live_blocks_reports_them_and_stays_usable(pool, upstream):
    o = Oracle(pool)
    sizes = [1000, 3000, 70 * KiB, 1, 2 * MiB, 256, 9999, 12, 13, 14]
    for n in sizes:
        o.allocate(n)
    before = state(pool)
    with pytest.raises(LiveBlocksError) as ei:
        pool.close()
    e = ei.value
    assert e.blocks == len(sizes)
    assert e.bytes == sum(sizes)
    assert set(e.sample) <= set(o.live) and len(e.sample) == min(8, len(sizes))
    assert f"{len(sizes)} block(s)" in str(e) and "still live" in str(e)
    assert not pool.closed
    assert state(pool) == before
    o.check(snapshot=True)
    # Usable: new blocks, frees, and the old blocks' payloads are intact.
    for n in (500, 64 * KiB):
        o.allocate(n)
    for p in list(o.live)[:5]:
        o.deallocate(p)
    o.check(snapshot=True)
    with pytest.raises(LiveBlocksError) as ei:
        pool.close()
    assert ei.value.blocks == len(o.live)
    o.free_all()
    pool.close()
    assert pool.closed and upstream.counters()["outstanding_bytes"] == 0


# ---------------------------------------------------------------------------------- random runs


@pytest.mark.parametrize("seed", [11, 22, 33])
def test_seeded_random_run_validates_every_step(pool, upstream, seed):
    rng = random.Random(seed)
    o = Oracle(pool)
    streams = streams_for(upstream)
    simulated = hasattr(upstream, "enqueue")
    max_live = 40
    for step in range(2000):
        r = rng.random()
        if r < 0.01:
            pool.trim()
        elif r < 0.02:
            pool.process_pending()
        elif r < 0.025:
            pool.synchronize()
        elif r < 0.05 and simulated:
            upstream.enqueue(rng.choice(streams), rng.uniform(1.0, 200.0))
        elif r < 0.08 and simulated:
            upstream.advance(rng.uniform(1.0, 150.0))
        elif o.live and (len(o.live) >= max_live or r < 0.5):
            p = pick(rng, o.starts)
            o.deallocate(p, rng.choice(streams) if rng.random() < 0.2 else None)
        else:
            o.allocate(random_size(rng), rng.choice(streams) if rng.random() < 0.2 else None)
        o.check(snapshot=step % 250 == 0)
    o.free_all()
    pool.synchronize()
    st = o.check(snapshot=True)
    assert st["live_bytes"] == st["pending_bytes"] == st["live_blocks"] == 0
    pool.trim()
    pool.close()
    assert upstream.counters()["outstanding_bytes"] == 0


# ---------------------------------------------------------------------------------- the oracle


class _OverlappingPool:
    """A broken pool for the oracle's own test: its second block starts inside its first."""

    alignment = ALIGN

    def __init__(self):
        self.upstream = pk.upstream.Host()
        self.base = self.upstream.allocate(64 * KiB)
        self.n = 0

    def allocate(self, n, stream=None):
        self.n += 1
        return self.base + (0 if self.n == 1 else 4 * KiB)


def test_the_oracle_catches_overlap_and_overwritten_payloads():
    bad = _OverlappingPool()
    o = Oracle(bad, exclusive_upstream=False)
    p = o.allocate(16 * KiB)
    with pytest.raises(AssertionError, match="overlaps"):
        o.allocate(1000)
    # The same overlap seen only through memory: another writer scribbles inside the block.
    import ctypes

    ctypes.memset(p + 5000, 0xAB, 10)
    with pytest.raises(AssertionError, match=r"payload of block .* overwritten at offset 5000"):
        o.check_cookie(p)
    bad.upstream.deallocate(bad.base, 64 * KiB)
