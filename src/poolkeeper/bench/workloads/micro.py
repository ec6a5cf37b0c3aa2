"""The hit-path micro benchmark: what an ``allocate`` + ``deallocate`` pair costs from Python on a
pool hit, next to an empty Python call measured in the same run, and the same pair through the C
ABI in a native loop (no Python at all).

Timing is batched, because a hit is shorter than the timer's own cost: each sample is one batch of
pairs divided by the batch length, interleaved with a batch of two empty Python calls per
iteration, so both see the same machine state. The row's per-op figures are **ns per pair**.
An arm whose pair goes upstream (``direct``) gets short batches and a time budget instead of a
fixed count, so a quick run stays quick; ``extras["pairs"]`` says how many were measured.
"""
from __future__ import annotations

from statistics import median
from time import perf_counter_ns
from typing import Any, Dict, List

from poolkeeper.bench.quantiles import new_samples, p50
from poolkeeper.bench.workloads.base import KiB, MiB, Measurement, RunContext, Selection, Workload

SLOW_PAIR_NS = 5_000  # a pair slower than this is not a hit: shrink the batches


def _params(sel: Selection) -> List[Dict[str, Any]]:
    full = sel.scale == "full"
    return [
        {"nbytes": n, "batch": 1000, "batches": 200 if full else 40, "budget_s": 4.0 if full else 0.5,
         "capi_iterations": 2_000_000 if full else 200_000}
        for n in (4 * KiB, 1 * MiB, 64 * MiB)
    ]


def _noop(a: Any = None, b: Any = None) -> Any:
    return a


def _run(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    nbytes = p["nbytes"]
    alloc, free, noop = pool.allocate, pool.deallocate, _noop
    # Warm: the first pair may grow a backing; its cost says whether this arm hits at all.
    t = perf_counter_ns()
    free(alloc(nbytes))
    first = perf_counter_ns() - t
    t = perf_counter_ns()
    free(alloc(nbytes))
    second = perf_counter_ns() - t
    slow = second > SLOW_PAIR_NS
    batch = 10 if slow else p["batch"]
    budget_ns = int(p["budget_s"] * 1e9)

    pair = new_samples()
    empty: List[float] = []
    t_start = perf_counter_ns()
    rng = range(batch)
    for i in range(p["batches"]):
        t0 = perf_counter_ns()
        for _ in rng:
            q = noop(nbytes)
            noop(q)
        t1 = perf_counter_ns()
        for _ in rng:
            q = alloc(nbytes)
            free(q)
        t2 = perf_counter_ns()
        empty.append((t1 - t0) / batch)
        pair.append((t2 - t1) // batch)
        if i >= 2 and t2 - t_start > budget_ns:
            break
    wall = perf_counter_ns() - t_start
    pairs = len(pair) * batch

    capi = _capi_pair(pool, nbytes, 200 if slow else p["capi_iterations"])
    two_empty = p50(empty)
    extras = {
        "batch": batch,
        "pairs": pairs,
        "first_pair_ns": first,
        "empty_call_ns": two_empty / 2,
        "two_empty_calls_ns": two_empty,
        # The row's p50_ns (nearest rank) over two empty calls: the ratio printed beside it.
        "pair_over_two_empty_calls": (p50(pair) / two_empty) if two_empty else None,
        "capi_pair_ns": capi,
    }
    return Measurement(samples=pair, ops=pairs, wall_ns=wall, timing=f"batch:{batch} pairs, ns per pair",
                       peak_live_bytes=nbytes, extras=extras)


def _capi_pair(pool: Any, nbytes: int, iterations: int) -> Any:
    """Median ns per pair of poolkeeper_malloc/poolkeeper_free in a native loop (5 runs), with the
    pool installed for device -1 behind the C ABI; the previous registration is restored."""
    try:
        from poolkeeper import _core
    except ImportError:  # pragma: no cover
        return None
    if not hasattr(_core, "capi_bench_pair"):
        return None
    previous = _core.registry_get(-1)
    _core.registry_set(-1, pool)
    try:
        return float(median(_core.capi_bench_pair(-1, nbytes, iterations) for _ in range(5)))
    finally:
        _core.registry_set(-1, previous)


HIT_PAIR = Workload(
    "hit_pair",
    "allocate+deallocate pair on a pool hit from Python (batched) vs two empty Python calls, and the C-ABI pair",
    _params,
    _run,
)

__all__ = ["HIT_PAIR"]
