"""The bench command's table: one row per (workload, parameters, arm)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from poolkeeper.bench.arms import STREAM_ORDERED_MARK
from poolkeeper.bench.format import fmt_bytes, fmt_ns, fmt_rate, fmt_ratio
from poolkeeper.bench.runner import short_params


def arm_label(row: Dict[str, Any]) -> str:
    return row["arm"] + (STREAM_ORDERED_MARK if row.get("stream_ordered") else "")


def bench_table(rows: Sequence[Dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for name, just in (("workload", "left"), ("params", "left"), ("arm", "left"), ("ops", "right"),
                       ("p50", "right"), ("p99", "right"), ("max", "right"), ("ops/s", "right"),
                       ("upstream alloc/free", "right"), ("peak reserved", "right"), ("peak live", "right"),
                       ("reserved/live", "right")):
        t.add_column(name, justify=just, no_wrap=(name != "params"))
    last = None
    for r in rows:
        key = (r["workload"], short_params(r["params"]))
        if last is not None and key != last:
            t.add_section()
        first = key != last
        last = key
        t.add_row(
            r["workload"] if first else "",
            short_params(r["params"]) if first else "",
            arm_label(r),
            str(r["ops"]),
            fmt_ns(r["p50_ns"]),
            fmt_ns(r["p99_ns"]),
            fmt_ns(r["max_ns"]),
            fmt_rate(r["ops_per_s"]),
            f"{r['upstream_allocations']}/{r['upstream_deallocations']}",
            fmt_bytes(r["peak_reserved_bytes"]),
            fmt_bytes(r["peak_live_bytes"]),
            fmt_ratio(r["reserved_over_live"]),
        )
    return t


def by_workload(rows: Sequence[Dict[str, Any]], name: str) -> List[Dict[str, Any]]:
    return [r for r in rows if r["workload"] == name]


__all__ = ["bench_table", "arm_label", "by_workload"]
