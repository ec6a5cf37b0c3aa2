"""Thread scaling: the same small-block churn on 1, 2, 4, 8, 16 and 32 Python threads sharing one
pool. Total work per row is fixed, split evenly over the threads.

Python threads share the GIL: a pool hit keeps it (tens of ns, no thread switch), a miss releases
it. So the figures are what a threaded Python server gets, not the native pool's scaling.
"""
from __future__ import annotations

import random
from typing import Any, Dict, List

from poolkeeper.bench.workloads.base import KiB, MiB, Measurement, Meter, RunContext, Selection, Workload, run_threads

THREAD_COUNTS = (1, 2, 4, 8, 16, 32)
SIZES = (4 * KiB, 24 * KiB, 64 * KiB, 200 * KiB, 1 * MiB)
WINDOW = 4


def _params(sel: Selection) -> List[Dict[str, Any]]:
    counts = tuple(sel.threads) if sel.threads else THREAD_COUNTS
    total = 128_000 if sel.scale == "full" else 8_000
    return [{"threads": int(t), "total_pairs": total // 2, "window": WINDOW} for t in counts]


def _run(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    n = p["threads"]
    per_thread = max(1, p["total_pairs"] // n)

    def body(i: int, m: Meter) -> None:
        rng = random.Random(ctx.seed * 1000 + i)
        ring = []
        for _ in range(per_thread):
            size = rng.choice(SIZES)
            ring.append((m.alloc(size), size))
            if len(ring) > p["window"]:
                ptr, s = ring.pop(0)
                m.free(ptr, s)
        for ptr, s in ring:
            m.free(ptr, s)

    meas = run_threads(pool, n, body)
    meas.extras["pairs_per_thread"] = per_thread
    return meas


THREADS = Workload(
    "threads",
    "alloc/free churn of 4 KiB-1 MiB blocks (4 live per thread) on 1..32 threads sharing the pool",
    _params,
    _run,
)

__all__ = ["THREADS", "THREAD_COUNTS"]
