"""Shape workloads: size-class straddling, large-block recycling, growth to a GB-scale
high-water mark."""
from __future__ import annotations

import random
from time import perf_counter_ns
from typing import Any, Dict, List

from poolkeeper.bench.workloads.base import GiB, KiB, MiB, Measurement, Meter, RunContext, Selection, Workload, single

# --- straddle -----------------------------------------------------------------------------------
# Size classes at 4 per doubling sit at 2^k * {1, 1.25, 1.5, 1.75}. A tensor whose size wobbles by
# one alignment unit around such a boundary lands in two classes on alternate rounds: a size-class
# pool keeps a block cached in each, an arena reuses the same bytes.


def _straddle_params(sel: Selection) -> List[Dict[str, Any]]:
    top = 24 if sel.scale == "full" else 22
    return [{"min_pow2": 12, "max_pow2": top, "rounds": 400 if sel.scale == "full" else 50, "jitter": 256}]


def _straddle(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    rng = random.Random(ctx.seed)
    boundaries = [
        (1 << k) * num // 4 for k in range(p["min_pow2"], p["max_pow2"] + 1) for num in (4, 5, 6, 7)
    ]
    j = p["jitter"]
    m = Meter(pool)
    t0 = perf_counter_ns()
    for _ in range(p["rounds"]):
        sizes = [b + rng.choice((-j, j)) for b in boundaries]
        order = list(range(len(sizes)))
        rng.shuffle(order)
        live = [(m.alloc(sizes[i]), sizes[i]) for i in order]
        rng.shuffle(live)
        for ptr, n in live:
            m.free(ptr, n)
    return single(m, perf_counter_ns() - t0, boundaries=len(boundaries))


STRADDLE = Workload(
    "straddle",
    "sizes one alignment unit either side of size-class boundaries (4 KiB..16 MiB), all live at once per round",
    _straddle_params,
    _straddle,
)

# --- large_recycle ------------------------------------------------------------------------------
# Large blocks whose sizes are not multiples of the large granularity (2 MiB): a free block of one
# size must serve a request of another, which is either a class rounding or a split.

LARGE_GRANULARITY = 2 * MiB


def _large_params(sel: Selection) -> List[Dict[str, Any]]:
    return [{"distinct_sizes": 24, "working_set": 8, "rounds": 8000 if sel.scale == "full" else 1000}]


def _large_sizes(rng: random.Random, count: int) -> List[int]:
    out = []
    while len(out) < count:
        s = rng.randint(4, 48) * LARGE_GRANULARITY + rng.randrange(4, LARGE_GRANULARITY // 256 - 4) * 256
        if s % LARGE_GRANULARITY and s not in out:
            out.append(s)
    return out


def _large_recycle(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    rng = random.Random(ctx.seed)
    sizes = _large_sizes(rng, p["distinct_sizes"])
    m = Meter(pool)
    t0 = perf_counter_ns()
    live = []
    for _ in range(p["working_set"]):
        n = rng.choice(sizes)
        live.append((m.alloc(n), n))
    for _ in range(p["rounds"]):
        ptr, n = live.pop(rng.randrange(len(live)))
        m.free(ptr, n)
        n = rng.choice(sizes)
        live.append((m.alloc(n), n))
    for ptr, n in live:
        m.free(ptr, n)
    return single(m, perf_counter_ns() - t0, granularity=LARGE_GRANULARITY)


LARGE_RECYCLE = Workload(
    "large_recycle",
    "8 live large blocks, one replaced per round, sizes 8-96 MiB that are not multiples of 2 MiB",
    _large_params,
    _large_recycle,
)

# --- growth -------------------------------------------------------------------------------------
# Climb to a GB-scale high-water mark, drop everything, climb again: the first climb is all
# upstream calls for every arm; the later ones show what each pool kept and how it reuses it.

GROWTH_SIZES = tuple(s * MiB + 4 * KiB for s in (1, 3, 8, 20, 50, 130))


def _growth_params(sel: Selection) -> List[Dict[str, Any]]:
    if sel.backend == "host":  # real host memory: keep it modest whatever the scale
        hwm = 1 * GiB
    else:
        hwm = 8 * GiB if sel.scale == "full" else 2 * GiB
    return [{"high_water_bytes": hwm, "climbs": 3 if sel.scale == "full" else 2}]


def _growth(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    m = Meter(pool)
    t0 = perf_counter_ns()
    for _ in range(p["climbs"]):
        live = []
        i = 0
        while m.live < p["high_water_bytes"]:
            n = GROWTH_SIZES[i % len(GROWTH_SIZES)]
            live.append((m.alloc(n), n))
            i += 1
        for ptr, n in reversed(live):
            m.free(ptr, n)
    return single(m, perf_counter_ns() - t0)


GROWTH = Workload(
    "growth",
    "climb to a GB-scale high-water mark in 1-130 MiB blocks, free all, climb again",
    _growth_params,
    _growth,
)

__all__ = ["STRADDLE", "LARGE_RECYCLE", "GROWTH"]
