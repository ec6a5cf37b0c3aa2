"""``poolkeeper compare RESULTS.json [...]``: the three comparisons with distinct answers --
direct vs arena, size_class vs arena, cuda_async vs arena -- as arena-advantage ratios per
workload (see :mod:`poolkeeper.bench.pivot` for how rows are grouped and ratios defined).

    poolkeeper compare benchmarks/results/simulated.json --plot compare.png
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Dict

TITLES = {
    "direct_vs_arena": "direct vs arena: what pooling at all buys",
    "size_class_vs_arena": "size_class vs arena: two pool designs",
    "cuda_async_vs_arena": "cuda_async† vs arena: CUDA's own stream-ordered pool",
    "arena_expandable_vs_arena": "arena_expandable vs arena: one virtual range vs separate backings",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="results written by poolkeeper bench --json")
    p.add_argument("--scale", choices=("full", "quick"), default=None,
                   help="which config scale to compare when the results hold both (never mixed)")
    p.add_argument("--plot", metavar="PNG", default=None, help="also draw the comparisons (matplotlib) to PNG")
    p.add_argument("--json", metavar="PATH", default=None, help="write the pivot as JSON")
    p.add_argument("--raw", action="store_true", help="show both arms' values next to every ratio")


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from poolkeeper._paths import check_not_input, output_path, write_output
    from poolkeeper.bench import results
    from poolkeeper.bench.console import make_console
    from poolkeeper.bench.pivot import pivot

    for flag, out in (("--json", args.json), ("--plot", args.plot)):
        if out:
            check_not_input(output_path(out, flag), args.results, flag)
    rows = results.load(args.results)
    piv = pivot(rows, args.scale)
    console = make_console()
    render(piv, console, raw=args.raw)
    if args.json:
        write_output(args.json, json.dumps(jsonable(piv), indent=1) + "\n", "--json", args.results)
        console.print(f"[dim]pivot written to {escape(args.json)}[/]", highlight=False)
    if args.plot:
        from poolkeeper.bench.plot import plot

        plot(piv, args.plot, inputs=args.results)
        console.print(f"[dim]plot written to {escape(args.plot)}[/]", highlight=False)
    return 0


def jsonable(o: Any) -> Any:
    """JSON has no infinity: an infinite advantage is written as the string "inf"."""
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    if isinstance(o, dict):
        return {k: jsonable(v) for k, v in o.items()}
    if isinstance(o, list):
        return [jsonable(v) for v in o]
    return o


def _cell(m: Dict[str, Any], fmt: Any, raw: bool) -> str:
    from poolkeeper.bench.format import fmt_ratio

    adv = m["advantage"]
    if adv is None:
        return "-"
    color = "green" if adv > 1.05 else ("red" if adv < 0.95 else "default")
    text = f"[{color}]{fmt_ratio(adv)}[/]"
    if raw:
        text += f" [dim]({fmt(m['other'])} → {fmt(m['arena'])})[/]"
    return text


def render(piv: Dict[str, Any], console: Any, raw: bool = False) -> None:
    """Print the pivot's tables. Every string from the results files (workload, params, backend,
    arm names) is escaped: rich reads ``[...]`` as markup, so a workload named ``[/]`` raised
    ``MarkupError`` and ``[link=...]`` made a terminal hyperlink."""
    from rich.markup import escape
    from rich.table import Table

    from poolkeeper.bench.arms import STREAM_ORDERED_NOTE
    from poolkeeper.bench.format import fmt_bytes, fmt_ns, fmt_rate
    from poolkeeper.bench.runner import short_params

    def count(v: Any) -> str:
        return "-" if v is None else f"{v:.0f}"

    console.print(f"[bold]arena advantage[/] (scale {piv['scale']}): how many times better the arena is; "
                  "> 1 arena better, < 1 the other arm better. Values in brackets: (other → arena); --raw shows them for "
                  "every column.", highlight=False)
    for name, entries in piv["comparisons"].items():
        if not entries:
            continue
        t = Table(title=TITLES.get(name, name), title_justify="left")
        for c in ("workload", "params", "backend", "p50", "p99", "ops/s", "upstream calls", "peak reserved"):
            t.add_column(c, justify="left" if c in ("workload", "params", "backend") else "right")
        for e in entries:
            t.add_row(escape(e["workload"]),
                      escape(short_params(e["params"]) + (f" {e['params']['upstream']}" if "upstream" in e["params"] else "")),
                      escape(e["backend"]), _cell(e["p50"], fmt_ns, raw), _cell(e["p99"], fmt_ns, raw),
                      _cell(e["ops_per_s"], fmt_rate, raw),
                      _cell(e["upstream_calls"], count, True), _cell(e["peak_reserved"], fmt_bytes, True))
        console.print(t)
        if name.startswith("cuda_async"):
            console.print(f"[yellow]{STREAM_ORDERED_NOTE}[/]", highlight=False)
    if not any(piv["comparisons"].values()):
        console.print("[yellow]nothing to compare: no identity has the arena and another arm[/]")
    if piv["unpaired"]:
        console.print("[dim]unpaired (no arena row): "
                      + "; ".join(escape(f"{u['workload']} {short_params(u['params'])} ({', '.join(u['arms'])})")
                                  for u in piv["unpaired"])
                      + "[/]", highlight=False)


__all__ = ["add_arguments", "run", "render", "jsonable"]
