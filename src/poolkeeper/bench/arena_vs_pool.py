"""``poolkeeper bench --arena-vs-pool``: the arena and the size-class pool in one process, on the
same inference-shaped workloads, against two upstreams: an instant stub (latency 0) and the
simulated device's calibrated busy-wait (each cudaMalloc/cudaFree costs what it costs on an H200).

With the instant stub, the per-op figures are the pools' own bookkeeping; with the busy-wait they
include each upstream call the pool makes. The difference is the arena's amortization (upstream
calls scale with the high-water mark, not with the shapes), visible without a GPU. Both arms run
in alternating order over several rounds in one process, so they share one CPU at one thermal
state; rows of all rounds are written, and ``compare`` takes the median of the rounds.
"""
from __future__ import annotations

from statistics import median
from typing import Any, Callable, Dict, List, Optional, Sequence

from poolkeeper.bench import backends
from poolkeeper.bench.arms import arena_available, make_arm
from poolkeeper.bench.errors import UnknownNameError
from poolkeeper.bench.runner import run_one, timer_floor_ns
from poolkeeper.bench.workloads import Selection
from poolkeeper.bench.workloads import WORKLOADS

INNER = ("inference", "kv_cache")
UPSTREAMS = {"instant": 0.0, "h200": None}  # latency_us override: 0, or the calibrated model
PREFIX = "arena_vs_pool:"


def plan_size(scale: str, rounds: Optional[int] = None, inner: Sequence[str] = INNER) -> int:
    r = rounds or (5 if scale == "full" else 2)
    return len(inner) * len(UPSTREAMS) * r * 2


def run(scale: str = "quick", rounds: Optional[int] = None, seed: int = 0, inner: Sequence[str] = INNER,
        on_progress: Optional[Callable[[int, int, str], None]] = None,
        arm_options: Optional[Dict[str, Dict[str, Any]]] = None,
        instant_latency_us: float = 0.0, device_latency_us: Optional[float] = None) -> List[Dict[str, Any]]:
    """Rows for size_class and arena x inner workloads x {instant, h200} x rounds.

    ``device_latency_us`` replaces the calibrated model (tests only)."""
    if not arena_available():
        raise UnknownNameError("--arena-vs-pool needs ArenaPool, which is not built in this poolkeeper yet")
    arm_options = arm_options or {}
    arms = [make_arm("size_class", arm_options.get("size_class")), make_arm("arena", arm_options.get("arena"))]
    rounds = rounds or (5 if scale == "full" else 2)
    latencies = {"instant": instant_latency_us, "h200": device_latency_us}
    floor = timer_floor_ns()
    total = plan_size(scale, rounds, inner)
    rows: List[Dict[str, Any]] = []
    done = 0
    for name in inner:
        w = WORKLOADS[name]
        for params in w.params(Selection(scale=scale, backend="simulated")):
            for up_name in UPSTREAMS:
                factory = backends.upstream_factory("simulated", latencies[up_name])
                for rnd in range(rounds):
                    order = arms if rnd % 2 == 0 else arms[::-1]
                    for arm in order:
                        if on_progress:
                            on_progress(done, total, f"arena_vs_pool {name} {up_name} round {rnd + 1} [{arm.name}]")
                        row = run_one(w, params, arm, "simulated", scale, factory, seed, floor)
                        row["workload"] = PREFIX + name
                        row["params"] = {**row["params"], "upstream": up_name}
                        row["extras"]["round"] = rnd
                        rows.append(row)
                        done += 1
    if on_progress:
        on_progress(done, total, "done")
    return rows


def summary(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per (workload, upstream): each arm's median over rounds of mean ns per op, upstream calls
    and the share of wall time spent inside the upstream (both for the timed section only: a setup
    phase such as inference's weights is left out); and size_class ÷ arena."""
    groups: Dict[tuple, Dict[str, List[Dict[str, Any]]]] = {}
    for r in rows:
        if not r["workload"].startswith(PREFIX):
            continue
        key = (r["workload"][len(PREFIX):], r["params"]["upstream"])
        groups.setdefault(key, {}).setdefault(r["arm"], []).append(r)
    out = []
    for (name, up), arms in groups.items():
        entry: Dict[str, Any] = {"workload": name, "upstream": up}
        for arm, rs in arms.items():
            mean_ns = median(r["wall_s"] * 1e9 / r["ops"] for r in rs if r["ops"])
            # A setup phase outside the timed section (inference's weights) is outside the share too.
            up_ns = median(((r["upstream_alloc_ns"] or 0) + (r["upstream_dealloc_ns"] or 0)
                            - r["extras"].get("setup_upstream_ns", 0)) / (r["wall_s"] * 1e9)
                           for r in rs if r["wall_s"])
            calls = median(r["upstream_allocations"] + r["upstream_deallocations"]
                           - r["extras"].get("setup_upstream_allocations", 0) for r in rs)
            entry[arm] = {"mean_ns_per_op": mean_ns, "upstream_calls": calls, "upstream_time_share": up_ns,
                          "rounds": len(rs)}
        if "arena" in entry and "size_class" in entry and entry["arena"]["mean_ns_per_op"]:
            entry["size_class_over_arena"] = entry["size_class"]["mean_ns_per_op"] / entry["arena"]["mean_ns_per_op"]
        out.append(entry)
    return out


def summary_table(entries: Sequence[Dict[str, Any]]) -> Any:
    from rich.table import Table

    from poolkeeper.bench.format import fmt_ns, fmt_ratio

    t = Table(title="arena_vs_pool: mean time per op (wall ÷ ops, upstream calls included), median of rounds",
              title_justify="left")
    for c in ("workload", "upstream", "size_class", "arena", "size_class ÷ arena", "upstream calls sc / arena",
              "time in upstream sc / arena"):
        t.add_column(c, justify="left" if c in ("workload", "upstream") else "right")
    for e in entries:
        sc, ar = e.get("size_class", {}), e.get("arena", {})
        t.add_row(e["workload"], "instant stub" if e["upstream"] == "instant" else "H200 busy-wait",
                  fmt_ns(sc.get("mean_ns_per_op")), fmt_ns(ar.get("mean_ns_per_op")),
                  fmt_ratio(e.get("size_class_over_arena")),
                  f"{sc.get('upstream_calls', 0):.0f} / {ar.get('upstream_calls', 0):.0f}",
                  f"{100 * sc.get('upstream_time_share', 0):.0f}% / {100 * ar.get('upstream_time_share', 0):.0f}%")
    return t


__all__ = ["run", "summary", "summary_table", "plan_size", "INNER", "PREFIX"]
