"""Latency samples and their quantiles (nearest-rank, no interpolation: every reported figure is
a latency that was actually observed)."""
from __future__ import annotations

import math
from array import array
from typing import Dict, Iterable, Sequence

QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of already sorted values by the nearest-rank method."""
    if not sorted_values:
        raise ValueError("no samples")
    k = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[k - 1]


def summarize(samples: Iterable[int]) -> Dict[str, float]:
    """``{"p50_ns", "p90_ns", "p99_ns", "max_ns", "mean_ns", "samples"}`` of ns samples.

    Empty input gives ``None`` figures and ``samples == 0``.
    """
    values = sorted(samples)
    if not values:
        return {"p50_ns": None, "p90_ns": None, "p99_ns": None, "max_ns": None, "mean_ns": None, "samples": 0}
    out = {f"{name}_ns": float(nearest_rank(values, q)) for name, q in QUANTILES}
    out["max_ns"] = float(values[-1])
    out["mean_ns"] = float(sum(values)) / len(values)
    out["samples"] = len(values)
    return out


def p50(values: Iterable[float]) -> float:
    """The median as every table reports it (nearest rank): use this, not ``statistics.median``,
    for any p50 printed next to a table's, so one quantity has one figure."""
    return float(nearest_rank(sorted(values), 0.5))


def new_samples() -> array:
    """A compact growable buffer of int64 ns samples (8 bytes each, not a Python int object)."""
    return array("q")


__all__ = ["QUANTILES", "nearest_rank", "summarize", "p50", "new_samples"]
