"""Runs workloads x arms and turns each run into a row.

Every (workload, parameter set, arm) runs on a fresh pool over a fresh upstream, so the call
counters and peaks of a row belong to that run alone. The garbage collector is paused during a
run (its pauses would land in the tail quantiles) and the pool is validated afterwards: no figure
is reported from a pool whose invariants broke.

Row fields (see docs/benchmarks.md): arm, stream_ordered, workload, params, backend, scale,
config, upstream, seed, ops, timing, p50/p90/p99/max/mean ns per op, ops_per_s, wall_s,
upstream_allocations/deallocations and their ns, peak_reserved_bytes, peak_live_bytes,
reserved_over_live, timer_floor_ns, extras, machine.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from statistics import median
from time import perf_counter_ns
from typing import Any, Callable, Dict, List, Optional, Sequence

from poolkeeper.bench import backends, footprint
from poolkeeper.bench.arms import Arm, select_arms
from poolkeeper.bench.machine import machine_info
from poolkeeper.bench.quantiles import summarize
from poolkeeper.bench.workloads import RunContext, Selection, Workload, select_workloads

SCHEMA = 1
SCALES = ("full", "quick")


@dataclass
class RunConfig:
    """What to run. ``latency_us`` overrides the simulated latency (tests: 0); ``arm_options``
    gives per-arm pool options (tests: tiny arena backings)."""

    backend: str = "auto"
    scale: str = "full"
    arms: Optional[Sequence[str]] = None
    workloads: Optional[Sequence[str]] = None
    threads: Optional[Sequence[int]] = None
    seed: int = 0
    latency_us: Optional[float] = None
    arm_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)


@dataclass
class Plan:
    """The resolved run: backend, arms, (workload, params) cases, and notes on what was left out."""

    backend: str
    scale: str
    arms: List[Arm]
    cases: List[tuple]
    skipped: List[str]

    @property
    def total(self) -> int:
        return len(self.cases) * len(self.arms)


def timer_floor_ns(n: int = 2000) -> float:
    """Median cost of one ``perf_counter_ns`` pair with nothing between: included in every sample."""
    out = []
    for _ in range(n):
        t0 = perf_counter_ns()
        out.append(perf_counter_ns() - t0)
    return float(median(out))


def plan(cfg: RunConfig) -> Plan:
    from poolkeeper.bench.errors import UnknownNameError

    if cfg.scale not in SCALES:
        raise UnknownNameError(f"unknown scale {cfg.scale!r} (valid: {', '.join(SCALES)})")
    backend = backends.resolve(cfg.backend)
    arms, skipped = select_arms(cfg.arms, backend, cfg.arm_options)
    sel = Selection(scale=cfg.scale, backend=backend, threads=cfg.threads)
    cases = [(w, p) for w in select_workloads(cfg.workloads) for p in w.params(sel)]
    return Plan(backend=backend, scale=cfg.scale, arms=arms, cases=cases, skipped=skipped)


def run_one(workload: Workload, params: Dict[str, Any], arm: Arm, backend: str, scale: str,
            upstream_factory: Callable[[], Any], seed: int = 0, floor_ns: Optional[float] = None) -> Dict[str, Any]:
    """Run one workload parameter set on one arm; return its row."""
    pool, upstream = arm.build(upstream_factory)
    probe = footprint.probe_for(arm.name, upstream)
    ctx = RunContext(arm=arm.name, backend=backend, scale=scale, upstream=upstream, seed=seed)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        meas = workload.run(pool, dict(params), ctx)
    finally:
        if gc_was_enabled:
            gc.enable()
    stats = pool.stats()
    counters = upstream.counters()
    below = probe.finish() if probe is not None else None
    pool.validate()
    pool.close()

    q = summarize(meas.samples)
    peak_live = meas.peak_live_bytes if meas.peak_live_bytes is not None else stats["peak_live_bytes"]
    peak_reserved = meas.peak_reserved_bytes if meas.peak_reserved_bytes is not None else stats["peak_reserved_bytes"]
    extras = dict(meas.extras)
    if below is not None:
        # The memory really held sits below the pool (CUDA's pool): report that, keep the pool's view.
        extras["pool_view_peak_reserved_bytes"] = peak_reserved
        extras["footprint"] = below
        peak_reserved = below["peak_reserved_bytes"]
    wall_s = meas.wall_ns / 1e9
    return {
        "schema": SCHEMA,
        "arm": arm.name,
        "stream_ordered": arm.stream_ordered,
        "workload": workload.name,
        "params": dict(params),
        "backend": backend,
        "scale": scale,
        "config": arm.config(),
        "upstream": backends.describe(backend, upstream),
        "seed": seed,
        "ops": meas.ops,
        "timing": meas.timing,
        "p50_ns": q["p50_ns"],
        "p90_ns": q["p90_ns"],
        "p99_ns": q["p99_ns"],
        "max_ns": q["max_ns"],
        "mean_ns": q["mean_ns"],
        "ops_per_s": (meas.ops / wall_s) if wall_s > 0 else None,
        "wall_s": wall_s,
        "upstream_allocations": counters["allocations"],
        "upstream_deallocations": counters["deallocations"],
        "upstream_alloc_ns": counters.get("alloc_ns"),
        "upstream_dealloc_ns": counters.get("dealloc_ns"),
        "peak_reserved_bytes": peak_reserved,
        "peak_live_bytes": peak_live,
        "reserved_over_live": (peak_reserved / peak_live) if peak_live else None,
        "timer_floor_ns": floor_ns,
        "extras": extras,
        "machine": machine_info(),
    }


def run(cfg: RunConfig, on_progress: Optional[Callable[[int, int, str], None]] = None,
        the_plan: Optional[Plan] = None) -> List[Dict[str, Any]]:
    """Run the whole plan; ``on_progress(done, total, label)`` is called before each run and at the end."""
    pl = the_plan or plan(cfg)
    factory = backends.upstream_factory(pl.backend, cfg.latency_us)
    floor = timer_floor_ns()
    rows: List[Dict[str, Any]] = []
    done = 0
    for workload, params in pl.cases:
        for arm in pl.arms:
            if on_progress:
                on_progress(done, pl.total, f"{workload.name} {short_params(params)} [{arm.label}]")
            rows.append(run_one(workload, params, arm, pl.backend, pl.scale, factory, cfg.seed, floor))
            done += 1
    if on_progress:
        on_progress(done, pl.total, "done")
    return rows


def short_params(params: Dict[str, Any]) -> str:
    """The parameters that tell rows of one workload apart (``threads=8``, ``nbytes=4KiB``)."""
    keys = [k for k in ("threads", "nbytes", "steps") if k in params]
    return " ".join(f"{k}={fmt_value(k, params[k])}" for k in keys)


def fmt_value(key: str, v: Any) -> str:
    if key.endswith("bytes") and isinstance(v, int):
        from poolkeeper.bench.format import fmt_bytes

        return fmt_bytes(v)
    return str(v)


__all__ = ["RunConfig", "Plan", "plan", "run", "run_one", "timer_floor_ns", "short_params", "SCHEMA", "SCALES"]
