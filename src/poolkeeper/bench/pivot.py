"""Pivot benchmark rows into the comparisons that have distinct answers:
``direct`` vs ``arena``, ``size_class`` vs ``arena``, ``cuda_async`` vs ``arena``, and
``arena_expandable`` vs ``arena`` (one virtual range against separate backings).

Rows are grouped by their identity -- workload, parameters, backend and config scale. Repeats of
one identity (several runs, several rounds) are reduced to their median; rows of different
identities are never averaged. In particular rows of different scales measure different
workloads: asking to pivot a mix of scales is an error (:class:`ScaleMixError`) until one scale is
chosen.

Every ratio is an **arena advantage**: how many times better the arena is on that metric, so
> 1 means the arena is better and < 1 that the other arm is:
``p50``, ``p99``, ``upstream calls`` and ``peak reserved``: other ÷ arena (lower is better);
``ops/s``: arena ÷ other (higher is better). ``cuda_async`` rows are stream-ordered (a weaker
release guarantee), so their ratios are not a drop-in speedup.
"""
from __future__ import annotations

import json
import math
from statistics import median
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from poolkeeper.bench.errors import ScaleMixError

COMPARISONS = ("direct", "size_class", "cuda_async", "arena_expandable")
BASE = "arena"
# metric name -> (row field getter, higher_is_better)
METRICS: Dict[str, Tuple[Any, bool]] = {
    "p50": (lambda r: r["p50_ns"], False),
    "p99": (lambda r: r["p99_ns"], False),
    "ops_per_s": (lambda r: r["ops_per_s"], True),
    "upstream_calls": (lambda r: r["upstream_allocations"] + r["upstream_deallocations"], False),
    "peak_reserved": (lambda r: r["peak_reserved_bytes"], False),
}


def identity(row: Dict[str, Any]) -> Tuple[str, str, str, str]:
    """What makes two rows measurements of the same thing (the arm aside)."""
    return (row["workload"], json.dumps(row["params"], sort_keys=True), row["backend"], row["scale"])


def check_scales(rows: Sequence[Dict[str, Any]], scale: Optional[str] = None) -> List[Dict[str, Any]]:
    """The rows of one scale: ``scale`` if given, else the only scale present (a mix is an error)."""
    scales = sorted({r["scale"] for r in rows})
    if scale is not None:
        kept = [r for r in rows if r["scale"] == scale]
        if not kept:
            raise ScaleMixError(f"no rows of scale {scale!r} (the results hold: {', '.join(scales) or 'nothing'})",
                                scales=scales)
        return kept
    if len(scales) > 1:
        raise ScaleMixError(
            f"the results mix config scales ({', '.join(scales)}); rows of different scales measure different "
            "workloads and are never averaged or paired -- choose one with --scale", scales=scales)
    return list(rows)


def _median_metric(rows: Sequence[Dict[str, Any]], get: Any) -> Optional[float]:
    vals = [get(r) for r in rows]
    vals = [float(v) for v in vals if v is not None]
    return median(vals) if vals else None


def aggregate(rows: Iterable[Dict[str, Any]]) -> Dict[Tuple[str, str, str, str], Dict[str, Dict[str, Any]]]:
    """identity -> arm -> {metric: median over repeats, "n": repeats, "stream_ordered": bool}."""
    groups: Dict[Tuple[str, str, str, str], Dict[str, List[Dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault(identity(r), {}).setdefault(r["arm"], []).append(r)
    out: Dict[Tuple[str, str, str, str], Dict[str, Dict[str, Any]]] = {}
    for key, arms in groups.items():
        scales = {r["scale"] for rs in arms.values() for r in rs}
        assert len(scales) == 1, "identity includes the scale"  # never averaged across scales
        out[key] = {}
        for arm, rs in arms.items():
            agg = {m: _median_metric(rs, get) for m, (get, _) in METRICS.items()}
            agg["n"] = len(rs)
            agg["stream_ordered"] = any(r.get("stream_ordered") for r in rs)
            out[key][arm] = agg
    return out


def advantage(other: Optional[float], arena: Optional[float], higher_is_better: bool) -> Optional[float]:
    """How many times better the arena is (> 1: arena better). Both zero: 1. Undefined: None."""
    if other is None or arena is None:
        return None
    num, den = (arena, other) if higher_is_better else (other, arena)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


def pivot(rows: Sequence[Dict[str, Any]], scale: Optional[str] = None) -> Dict[str, Any]:
    """``{"scale", "comparisons": {name: [entry, ...]}, "unpaired": [...]}``.

    An entry: workload, params, backend, scale, stream_ordered, n_other, n_arena, and per metric
    ``{"other", "arena", "advantage"}``. Identities lacking the arena or the other arm are listed in
    ``unpaired``.
    """
    rows = check_scales(rows, scale)
    agg = aggregate(rows)
    comps: Dict[str, List[Dict[str, Any]]] = {f"{o}_vs_{BASE}": [] for o in COMPARISONS}
    unpaired: List[Dict[str, Any]] = []
    for key in sorted(agg, key=lambda k: k[2]):  # by backend; otherwise the order rows were run in
        arms = agg[key]
        workload, params, backend, sc = key
        if BASE not in arms:
            unpaired.append({"workload": workload, "params": json.loads(params), "backend": backend,
                             "arms": sorted(arms), "missing": BASE})
            continue
        base = arms[BASE]
        for o in COMPARISONS:
            if o not in arms:
                continue
            other = arms[o]
            entry: Dict[str, Any] = {
                "workload": workload, "params": json.loads(params), "backend": backend, "scale": sc,
                "stream_ordered": bool(other["stream_ordered"]), "n_other": other["n"], "n_arena": base["n"],
            }
            for m, (_, hib) in METRICS.items():
                entry[m] = {"other": other[m], "arena": base[m], "advantage": advantage(other[m], base[m], hib)}
            comps[f"{o}_vs_{BASE}"].append(entry)
    scales = sorted({r["scale"] for r in rows})
    return {"scale": scales[0] if scales else scale, "comparisons": comps, "unpaired": unpaired}


__all__ = ["pivot", "aggregate", "advantage", "identity", "check_scales", "COMPARISONS", "METRICS", "BASE"]
