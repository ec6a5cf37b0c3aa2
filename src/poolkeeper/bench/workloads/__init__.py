"""The benchmark workloads, each written once against the pool API and run on every arm.

``WORKLOADS`` maps name -> :class:`~poolkeeper.bench.workloads.base.Workload`, in the order the
table prints them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from poolkeeper.bench.errors import UnknownNameError
from poolkeeper.bench.workloads.base import Measurement, Meter, RunContext, Selection, Workload
from poolkeeper.bench.workloads.fragmentation import RANDOM_LIFETIME
from poolkeeper.bench.workloads.inference import INFERENCE, INFERENCE_MT, KV_CACHE
from poolkeeper.bench.workloads.micro import HIT_PAIR
from poolkeeper.bench.workloads.shapes import GROWTH, LARGE_RECYCLE, STRADDLE
from poolkeeper.bench.workloads.threads import THREADS
from poolkeeper.bench.workloads.trim import TRIM

WORKLOADS: Dict[str, Workload] = {
    w.name: w
    for w in (HIT_PAIR, STRADDLE, LARGE_RECYCLE, GROWTH, TRIM, THREADS, INFERENCE, INFERENCE_MT, KV_CACHE, RANDOM_LIFETIME)
}


def select_workloads(names: Optional[Sequence[str]]) -> List[Workload]:
    """The named workloads in table order (all when ``names`` is None)."""
    if names is None:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise UnknownNameError(f"unknown workload(s) {', '.join(unknown)} (valid: {', '.join(WORKLOADS)})")
    wanted = set(names)
    return [w for n, w in WORKLOADS.items() if n in wanted]


__all__ = ["WORKLOADS", "select_workloads", "Workload", "Measurement", "Meter", "RunContext", "Selection"]
