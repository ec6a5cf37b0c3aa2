"""What a workload is, and the meter that times it.

A workload is written once against the pool API (``allocate(n, stream)``, ``deallocate(p,
stream)``, ``stats()``, ``trim()``) and run unchanged on every arm. It returns a
:class:`Measurement`; the runner adds the pool's and upstream's figures.

Timing: unless a workload says otherwise (``timing="batch:N"``), every allocate and every
deallocate is timed on its own with ``time.perf_counter_ns`` around the one call, so the
quantiles show the slow path (an upstream call, a coalesce pass) as it happens. The timer's own
cost (the ``timer_floor_ns`` of each row, typically 30-80 ns) is included in every sample, not
subtracted: on a pool hit it is a large part of the figure, so compare hits with the batched
``hit_pair`` workload instead.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Optional, Sequence

from poolkeeper.bench.quantiles import new_samples

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


class Meter:
    """Times pool calls one by one and keeps the live byte count the workload asked for.

    One meter per thread (no locking); ``peak_live`` is exact for single-threaded workloads.
    """

    __slots__ = ("samples", "live", "peak_live", "_alloc", "_free")

    def __init__(self, pool: Any) -> None:
        self.samples = new_samples()
        self.live = 0
        self.peak_live = 0
        self._alloc = pool.allocate
        self._free = pool.deallocate

    def alloc(self, nbytes: int, stream: Any = None) -> int:
        t0 = perf_counter_ns()
        p = self._alloc(nbytes, stream)
        self.samples.append(perf_counter_ns() - t0)
        self.live += nbytes
        if self.live > self.peak_live:
            self.peak_live = self.live
        return p

    def free(self, ptr: int, nbytes: int, stream: Any = None) -> None:
        t0 = perf_counter_ns()
        self._free(ptr, stream)
        self.samples.append(perf_counter_ns() - t0)
        self.live -= nbytes


@dataclass
class Measurement:
    """What one workload run on one arm measured."""

    samples: Sequence[int]
    ops: int
    wall_ns: int
    timing: str = "per_op"
    peak_live_bytes: Optional[int] = None  # None: take the pool's own peak_live_bytes
    peak_reserved_bytes: Optional[int] = None  # None: take the pool's own peak_reserved_bytes
    extras: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunContext:
    """What a workload may know about its run besides the pool."""

    arm: str
    backend: str
    scale: str
    upstream: Any
    seed: int = 0


@dataclass(frozen=True)
class Selection:
    """Which parameter sets to generate: scale, backend, and a --threads override."""

    scale: str = "full"
    backend: str = "simulated"
    threads: Optional[Sequence[int]] = None


@dataclass(frozen=True)
class Workload:
    """A named workload: ``params(selection)`` lists its parameter sets (one row each);
    ``run(pool, params, ctx)`` executes one."""

    name: str
    summary: str
    params: Callable[[Selection], List[Dict[str, Any]]]
    run: Callable[[Any, Dict[str, Any], RunContext], Measurement]


def single(meter: Meter, wall_ns: int, **extras: Any) -> Measurement:
    """A single-threaded workload's measurement from its meter."""
    return Measurement(
        samples=meter.samples,
        ops=len(meter.samples),
        wall_ns=wall_ns,
        peak_live_bytes=meter.peak_live,
        extras=extras,
    )


def run_threads(pool: Any, n: int, body: Callable[[int, Meter], None]) -> Measurement:
    """Run ``body(thread_index, meter)`` on ``n`` threads released together by a barrier.

    Wall time runs from the release to the last join. Peak live comes from the pool (threads
    overlap, so per-thread meters cannot see it). An exception in any thread is re-raised.
    """
    meters = [Meter(pool) for _ in range(n)]
    errors: List[BaseException] = []
    barrier = threading.Barrier(n + 1)

    def target(i: int) -> None:
        barrier.wait()
        try:
            body(i, meters[i])
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,), name=f"bench-{i}") for i in range(n)]
    for t in threads:
        t.start()
    t0 = perf_counter_ns()
    barrier.wait()
    for t in threads:
        t.join()
    wall = perf_counter_ns() - t0
    if errors:
        raise errors[0]
    samples = new_samples()
    for m in meters:
        samples.extend(m.samples)
    return Measurement(samples=samples, ops=len(samples), wall_ns=wall, peak_live_bytes=None)


def align_up(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


__all__ = ["Meter", "Measurement", "RunContext", "Selection", "Workload", "single", "run_threads", "KiB", "MiB", "GiB"]
