"""Seeded random multi-stream traffic for the expandable-arena tests, with refusals from Faulty."""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, Sequence, Tuple

import poolkeeper as pk
from poolkeeper.errors import OutOfMemoryError

from expandable_helpers import assert_disjoint


def random_traffic(pool: Any, inner: Any, up: Any, rng: random.Random, steps: int, sizes: Callable[[], int],
                   check: Callable[[], None], alloc_p: float = 0.5, trim_p: float = 0.05) -> None:
    """Allocate, release (on streams too), record_stream, settle, trim and advance the clock at
    random; ``up`` (a Faulty over ``inner``) is armed for about 15% of the steps, so maps, unmaps
    and aliases are refused anywhere. ``check`` runs after every step; no two live blocks ever
    overlap, in addresses or in the memory behind them (``inner`` is a Simulated device). Leaves
    nothing live, the pool closed."""
    streams = [inner.stream() for _ in range(3)]
    live: Dict[int, Tuple[int, Any]] = {}
    for _ in range(steps):
        r = rng.random()
        up.armed = rng.random() < 0.15
        try:
            if r < alloc_p or not live:
                n = sizes()
                s = rng.choice([None] + streams)
                try:
                    p = pool.allocate(n, s)
                except (OutOfMemoryError, pk.errors.UpstreamError):
                    p = None
                if p is not None:
                    for q, (m, _) in live.items():
                        assert p + n <= q or q + m <= p, "a byte reachable twice"
                    live[p] = (n, s)
                    # And no memory behind two of them (a stitched alias and the main range).
                    assert_disjoint(inner, [(q, m) for q, (m, _) in live.items()])
            elif r < 0.8:
                p = rng.choice(list(live))
                n, s = live.pop(p)
                if s is not None:
                    inner.enqueue(s, rng.uniform(0, 50))
                pool.deallocate(p, s)
            elif r < 0.85:
                pool.record_stream(rng.choice(list(live)), rng.choice(streams))
            elif r < 0.9:
                inner.advance(rng.uniform(0, 100))
                pool.process_pending()
            elif r < 0.9 + trim_p:
                pool.trim()
            else:
                inner.advance(rng.uniform(0, 20))
        finally:
            up.armed = False
        check()
    for p, (n, s) in live.items():
        pool.deallocate(p, s)
    pool.synchronize()
    pool.close()
