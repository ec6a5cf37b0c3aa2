"""Trim cost, split into the pool's own traversal and the upstream frees it makes.

Each repetition fills the pool with a few thousand mixed-size blocks, frees them in random
order, then times one ``trim()``. The upstream's own ``dealloc_ns`` counter says how much of
that time was spent inside upstream frees (on a device each one synchronizes); the rest is the
pool walking its free structures. The row's per-op figures are per ``trim()`` call.
"""
from __future__ import annotations

import math
import random
from time import perf_counter_ns
from typing import Any, Dict, List

from poolkeeper.bench.quantiles import new_samples, p50
from poolkeeper.bench.workloads.base import KiB, MiB, Measurement, Meter, RunContext, Selection, Workload


def _params(sel: Selection) -> List[Dict[str, Any]]:
    if sel.scale == "full":
        return [{"blocks": 4000, "repetitions": 10, "min_bytes": 4 * KiB, "max_bytes": 8 * MiB}]
    return [{"blocks": 1000, "repetitions": 3, "min_bytes": 4 * KiB, "max_bytes": 8 * MiB}]


def _run(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    rng = random.Random(ctx.seed)
    lo, hi = math.log(p["min_bytes"]), math.log(p["max_bytes"])
    fill = Meter(pool)  # fill/free ops are not the measured op here; kept for peak live
    trims = new_samples()
    traversal: List[int] = []
    upstream_free: List[int] = []
    frees: List[int] = []
    released: List[int] = []
    up = ctx.upstream
    t_start = perf_counter_ns()
    for _ in range(p["repetitions"]):
        live = []
        for _ in range(p["blocks"]):
            n = int(math.exp(rng.uniform(lo, hi)))
            live.append((fill.alloc(n), n))
        rng.shuffle(live)
        for ptr, n in live:
            fill.free(ptr, n)
        before = up.counters()
        t0 = perf_counter_ns()
        got = pool.trim()
        dt = perf_counter_ns() - t0
        after = up.counters()
        up_ns = after["dealloc_ns"] - before["dealloc_ns"]
        trims.append(dt)
        upstream_free.append(up_ns)
        traversal.append(max(0, dt - up_ns))
        frees.append(after["deallocations"] - before["deallocations"])
        released.append(int(got or 0))
    wall = perf_counter_ns() - t_start
    target = p50(trims)
    mid = next(i for i, t in enumerate(trims) if t == target)
    return Measurement(
        samples=trims,
        ops=len(trims),
        wall_ns=wall,
        timing="per_trim",
        peak_live_bytes=fill.peak_live,
        # The p50 trim's own split (the repetition whose time is the row's p50_ns, by nearest
        # rank), so "p50 = traversal + upstream frees" holds exactly where it is printed.
        extras={
            "trim_ns_p50": float(trims[mid]),
            "trim_traversal_ns_p50": float(traversal[mid]),
            "trim_upstream_free_ns_p50": float(upstream_free[mid]),
            "trim_upstream_frees_p50": float(frees[mid]),
            "trim_released_bytes_p50": float(released[mid]),
            "fill_ops": len(fill.samples),
        },
    )


TRIM = Workload(
    "trim",
    "fill with mixed 4 KiB-8 MiB blocks, free all, time trim(): traversal vs upstream frees",
    _params,
    _run,
)

__all__ = ["TRIM"]
