"""A stream-order oracle for the simulated device: it remembers, for every byte range released on
a stream, when each stream that used it (the releasing one, the allocating one, record_stream's)
finishes the work enqueued before the release, and checks every allocation against it: a range
handed to stream t must have no unfinished use on any stream other than t (docs/stream_order.md)."""
from __future__ import annotations

import random
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

import poolkeeper as pk
from poolkeeper.errors import OutOfMemoryError


class Hazards:
    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.recs: List[Tuple[int, int, Dict[Any, float]]] = []

    def released(self, p: int, n: int, alloc_s: Any, rel_s: Any, used: Set[Any]) -> None:
        if rel_s is None:
            return  # the caller says every use is done
        h = {x: self.sim.busy_until(x) for x in ({alloc_s, rel_s} | used) - {None}}
        self.recs.append((p, p + n, h))

    def allocated(self, p: int, n: int, t: Any, what: str = "") -> None:
        now = self.sim.now
        keep = []
        for a, e, h in self.recs:
            if e <= p or a >= p + n:
                keep.append((a, e, h))
                continue
            for x, time in h.items():
                assert x == t or now >= time, (
                    f"{what}: [{p:#x}, +{n}) handed to stream {t} at {now} while stream {x} uses "
                    f"[{a:#x}, {e:#x}) until {time}")
            if a < p:
                keep.append((a, p, h))
            if e > p + n:
                keep.append((p + n, e, h))
        self.recs = keep


def _spans(pool: Any) -> List[Tuple[int, int]]:
    return [(b.address, b.address + b.size) for b in pool.snapshot().backings]


def _gone(before: List[Tuple[int, int]], after: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The address ranges of ``before`` that ``after`` no longer covers."""
    out = []
    for a, e in before:
        cur = [(a, e)]
        for x, y in after:
            nxt = []
            for p, q in cur:
                if y <= p or x >= q:
                    nxt.append((p, q))
                    continue
                if p < x:
                    nxt.append((p, x))
                if q > y:
                    nxt.append((y, q))
            cur = nxt
        out += cur
    return out


def check_left_pool(hz: Hazards, before: List[Tuple[int, int]], after: List[Tuple[int, int]], what: str) -> None:
    """No address range may leave the pool (freed, unmapped, unaliased) while a stream's work
    enqueued before its release may still use it. (Ranges are the snapshot's backings. A stitch
    lends mapped pieces of the expandable range to a new range: their main-range addresses leave
    the backings while still mapped, which this check would report; the seeds here make none
    while a use is outstanding.)"""
    for p, q in _gone(before, after):
        for a, e, h in hz.recs:
            if e <= p or a >= q:
                continue
            for x, time in h.items():
                assert hz.sim.now >= time, (
                    f"{what}: [{p:#x}, {q:#x}) left the pool at {hz.sim.now} while stream {x} uses "
                    f"[{a:#x}, {e:#x}) until {time}")


def traffic(pool: Any, sim: Any, rng: random.Random, steps: int, sizes, streams: List[Any],
            up: Any = None, check=None, dead_p: float = 0.0, record_p: float = 0.05,
            cross_p: float = 0.2, lock: Optional[threading.Lock] = None, hz: Optional[Hazards] = None,
            capture_p: float = 0.0, lagmul: float = 1.0, check_releases: bool = False) -> None:
    """Random allocations and releases on ``streams`` (None = no stream) with device lag; every
    allocation checked against the hazards. ``up`` (a Faulty) is armed for some steps.
    ``check_releases``: also check every step's memory going back upstream (single thread only)."""
    hz = hz or Hazards(sim)
    lock = lock or threading.Lock()
    live: Dict[int, Tuple[int, Any, Set[Any]]] = {}
    for i in range(steps):
        r = rng.random()
        before = _spans(pool) if check_releases else None
        if up is not None:
            up.armed = rng.random() < 0.15
        try:
            if r < 0.5 or not live:
                n = sizes()
                s = rng.choice(streams)
                with lock:
                    try:
                        p = pool.allocate(n, s)
                    except (OutOfMemoryError, pk.errors.UpstreamError):
                        p = None
                    if p is not None:
                        hz.allocated(p, n, s, f"step {i}")
                if p is not None:
                    if s is not None:
                        sim.enqueue(s, rng.uniform(0, 80) * lagmul)
                    live[p] = (n, s, set())
            elif r < 0.8:
                p = rng.choice(list(live))
                n, s, used = live.pop(p)
                rs = s
                if rng.random() < cross_p:
                    rs = rng.choice(streams)
                if rs is not None:
                    sim.enqueue(rs, rng.uniform(0, 80) * lagmul)
                else:
                    # A release with no stream promises every use is done: the caller synchronized.
                    users = ({s} | used) - {None}
                    if users:
                        sim.advance(max(0.0, max(sim.busy_until(x) for x in users) - sim.now))
                with lock:
                    hz.released(p, n, s, rs, used)
                    try:
                        pool.deallocate(p, rs)
                    except pk.errors.UpstreamError:
                        # refused event record: the block stays live (strong guarantee)
                        hz.recs = [x for x in hz.recs if x[0] != p or x[1] != p + n]
                        live[p] = (n, s, used)
            elif r < 0.8 + record_p:
                p = rng.choice(list(live))
                u = rng.choice([x for x in streams if x is not None])
                sim.enqueue(u, rng.uniform(0, 80))
                with lock:
                    pool.record_stream(p, u)
                live[p][2].add(u)
            elif r < 0.9:
                sim.advance(rng.uniform(0, 60))
                with lock:
                    pool.process_pending()
            elif r < 0.93:
                with lock:
                    pool.trim()
            else:
                sim.advance(rng.uniform(0, 20))
        finally:
            if up is not None:
                up.armed = False
        if check_releases:
            check_left_pool(hz, before, _spans(pool), f"step {i}")
        if check:
            with lock:
                check()
    for p, (n, s, used) in live.items():
        with lock:
            hz.released(p, n, s, s, used)
            pool.deallocate(p, s)
