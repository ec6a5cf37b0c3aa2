"""Snapshots for the memory-map tests: a busy real pool, and synthetic ones of any size.

(Imported by test_memory_map.py and test_browser.py; pytest puts tests/ on sys.path.)
"""
from __future__ import annotations

import random

import poolkeeper as pk
from poolkeeper.accounting import Backing, Chunk, Snapshot, check


def busy_pool(kind: str):
    """A pool holding live, free and pending chunks on two simulated streams."""
    up = pk.upstream.Simulated(latency_us=0)
    opts = {"arena": {"initial_backing": 1 << 16, "max_backing": 1 << 20}}.get(kind, {})
    pool = pk.make_pool(kind, up, **opts)
    s1, s2 = up.stream(), up.stream()
    rng = random.Random(3)
    ptrs = [pool.allocate(rng.choice([100, 3000, 5000, 70000, 200000]), stream=s1) for _ in range(30)]
    pool.record_stream(ptrs[1], s2)
    up.enqueue(s2, 1000)  # s2 still busy: the release of ptrs[1] stays pending
    pool.deallocate(ptrs[1], stream=s1)
    for p in ptrs[2:12]:
        pool.deallocate(p, stream=s1)
    pool.process_pending()
    return pool, up


def synthetic(n_backings: int, n_chunks: int, seed: int = 10, pool: str = "Synthetic") -> Snapshot:
    """A consistent snapshot with every state, built chunk by chunk; stats from the chunks."""
    rng = random.Random(seed)
    backings, addr = [], 1 << 44
    for _ in range(n_backings):
        chunks, off = [], 0
        for _ in range(n_chunks):
            size = 256 * rng.randint(1, 32)
            state = rng.choices(["live", "free", "pending", "thread_cached"], [6, 2, 1, 1])[0]
            chunks.append(
                Chunk(
                    offset=off,
                    size=size,
                    state=state,
                    requested=size - rng.randint(0, 255) if state == "live" else None,
                    alloc_stream=rng.choice([1, 2, 0x7F00DEADBEEF]),
                    last_stream=rng.choice([1, 2]),
                    event=rng.randint(1, 50) if state == "pending" else None,
                    waits_on=[1, 2] if state == "pending" else [],
                )
            )
            off += size
        backings.append(Backing(address=addr, size=off, chunks=chunks))
        addr += off + (1 << 21)
    snap = Snapshot(pool=pool, upstream="none", alignment=256, stats={}, backings=backings)
    p = check(snap, compare_stats=False)
    snap.stats = {
        "reserved_bytes": p.reserved,
        "live_bytes": p.live,
        "free_bytes": p.free,
        "pending_bytes": p.pending,
        "overhead_bytes": p.overhead,
        "thread_cached_bytes": p.thread_cached,
        "largest_free_block": p.largest_free,
        "fragmentation": p.fragmentation,
    }
    return snap
