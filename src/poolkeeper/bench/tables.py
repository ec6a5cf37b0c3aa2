"""The bench command's table: one row per (workload, parameters, arm).

No cell is ever cut short. The parameters that tell a workload's cases apart go under the
workload's name in its cell (one per line), and when the one wide table does not fit the console
it is printed as two narrower ones, timings and memory, with the same row keys.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from poolkeeper.bench.arms import STREAM_ORDERED_MARK
from poolkeeper.bench.format import fmt_bytes, fmt_ns, fmt_rate, fmt_ratio
from poolkeeper.bench.runner import short_params


def arm_label(row: Dict[str, Any]) -> str:
    return row["arm"] + (STREAM_ORDERED_MARK if row.get("stream_ordered") else "")


def _case_cell(row: Dict[str, Any]) -> str:
    params = short_params(row["params"])
    return "\n".join([row["workload"], *(f"  {p}" for p in params.split())])


_TIMING = (("ops", lambda r: str(r["ops"])), ("p50", lambda r: fmt_ns(r["p50_ns"])),
           ("p99", lambda r: fmt_ns(r["p99_ns"])), ("max", lambda r: fmt_ns(r["max_ns"])),
           ("ops/s", lambda r: fmt_rate(r["ops_per_s"])))
_MEMORY = (("upstream\nalloc/free", lambda r: f"{r['upstream_allocations']}/{r['upstream_deallocations']}"),
           ("peak\nreserved", lambda r: fmt_bytes(r["peak_reserved_bytes"])),
           ("peak\nlive", lambda r: fmt_bytes(r["peak_live_bytes"])),
           ("reserved\n/live", lambda r: fmt_ratio(r["reserved_over_live"])))


def _table(rows: Sequence[Dict[str, Any]], title: str, columns: Sequence[Any], compact: bool) -> Any:
    from rich import box
    from rich.table import Table

    if compact:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
                  collapse_padding=True, show_edge=False)
    else:
        t = Table(title=title, title_justify="left")
    # Compact tables are the narrow fallback: if even they are squeezed, a cell folds onto a
    # second line rather than losing characters to an ellipsis.
    cell = {"no_wrap": False, "overflow": "fold"} if compact else {"no_wrap": True}
    t.add_column("workload", justify="left", **cell)
    t.add_column("arm", justify="left", **cell)
    for name, _ in columns:
        t.add_column(name, justify="right", **cell)
    last = None
    for r in rows:
        key = (r["workload"], short_params(r["params"]))
        if last is not None and key != last:
            t.add_section()
        first = key != last
        last = key
        t.add_row(_case_cell(r) if first else "", arm_label(r), *(get(r) for _, get in columns))
    return t


def bench_tables(rows: Sequence[Dict[str, Any]], title: str, width: int) -> List[Any]:
    """The table(s) to print at ``width`` columns: one wide table when it fits, else timings and
    memory as two compact ones (every cell whole in both layouts)."""
    from rich.console import Console

    probe = Console(width=10_000)
    wide = _table(rows, title, _TIMING + _MEMORY, compact=False)
    if probe.measure(wide).maximum <= width:
        return [wide]
    return [_table(rows, title + " — timings", _TIMING, compact=True),
            _table(rows, "memory", _MEMORY, compact=True)]


def bench_table(rows: Sequence[Dict[str, Any]], title: str) -> Any:
    """The one wide table (every column)."""
    return _table(rows, title, _TIMING + _MEMORY, compact=False)


def by_workload(rows: Sequence[Dict[str, Any]], name: str) -> List[Dict[str, Any]]:
    return [r for r in rows if r["workload"] == name]


__all__ = ["bench_table", "bench_tables", "arm_label", "by_workload"]
