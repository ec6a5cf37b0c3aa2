"""``poolkeeper replay LOG``: replay a real allocation log against poolkeeper's pools.

Reads RMM ``logging_resource_adaptor`` CSV logs and PyTorch memory snapshot pickles
(``torch.cuda.memory._dump_snapshot``), replays them on each selected pool over a fresh
upstream, and reports peak live, peak reserved, their ratio, upstream calls, fragmentation at the
peak and per-op quantiles. ``--json`` writes the same as JSON (to stdout, or to a path).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

from poolkeeper.bench.readers import MAX_LOG_BYTES
from poolkeeper.pools import KINDS

POOLS = tuple(KINDS)  # every pool kind replays


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("log", metavar="LOG", help="RMM logging_resource_adaptor CSV or PyTorch memory snapshot pickle")
    p.add_argument("--pool", default=None,
                   help=f"pool(s) to replay on, comma-separated: {', '.join(POOLS)} (default: all "
                        "available on the backend)")
    p.add_argument("--backend", default="simulated", choices=("simulated", "host", "cuda"),
                   help="upstream the pools draw from (default: simulated, the H200-calibrated device)")
    p.add_argument("--format", dest="log_format", default="auto", choices=("auto", "rmm", "torch"),
                   help="log format (default: detected from the file)")
    p.add_argument("--device", type=int, default=None,
                   help="PyTorch snapshot: which device's trace to replay (default: the one with most allocations)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="pool option, e.g. max_backing=64MiB (given to every selected pool that accepts it)")
    p.add_argument("--include-pre-trace", action="store_true",
                   help="first allocate the blocks the logged process held from before the log began (frees of "
                        "never-allocated addresses; for snapshots also blocks still allocated at the end), so peak live "
                        "matches the logged allocator's")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH (or stdout when no PATH is given)")
    p.add_argument("--max-log-bytes", default=None, metavar="SIZE",
                   help="refuse a log larger than SIZE once decompressed, e.g. 8GiB or none (default: 1GiB; "
                        "the replay holds every event in memory, a few times the log's size)")
    p.add_argument("--sim-latency-us", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _pools(arg: Optional[str], backend: str = "simulated") -> List[str]:
    from poolkeeper.bench.arms import _skip_reason, arena_available
    from poolkeeper.bench.errors import UnknownNameError

    if arg is None:
        return [k for k in POOLS if (KINDS[k].base != "arena" or arena_available()) and not _skip_reason(k, backend)]
    names = [x.strip() for x in arg.split(",") if x.strip()]
    bad = [n for n in names if n not in POOLS]
    if bad or not names:
        raise UnknownNameError(f"unknown pool {', '.join(bad) or arg!r} (valid: {', '.join(POOLS)})")
    return names


def _max_bytes(text: Optional[str]) -> Optional[int]:
    """``--max-log-bytes``: a size (``8GiB``, ``123456``) or ``none``; the reader's default if not given."""
    from poolkeeper.bench.options import parse_value
    from poolkeeper.errors import InvalidArgumentError

    if text is None:
        return MAX_LOG_BYTES
    v = parse_value(text)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidArgumentError(f"--max-log-bytes takes a positive size (e.g. 8GiB) or none, not {text[:40]!r}")
    return v


def replay_log(log: str, pools: List[str], backend: str = "simulated", log_format: str = "auto",
               device: Optional[int] = None, options: Optional[Dict[str, Dict[str, Any]]] = None,
               latency_us: Optional[float] = None, progress: Any = None,
               include_pre_trace: bool = False, max_bytes: Optional[int] = MAX_LOG_BYTES) -> Dict[str, Any]:
    """Parse ``log`` once and replay it on each pool kind; return the report document.

    ``max_bytes``: the most bytes the log may hold once decompressed (``None``: no bound; the
    default is :data:`poolkeeper.bench.readers.MAX_LOG_BYTES`); a larger log is a
    :class:`~poolkeeper.bench.errors.ReplayError` (see :func:`~poolkeeper.bench.readers.read_log`)."""
    import poolkeeper as pk
    from poolkeeper.bench import backends
    from poolkeeper.bench.arms import make_arm_pool, virtual_upstream
    from poolkeeper.bench.machine import machine_info
    from poolkeeper.bench.readers import read_log
    from poolkeeper.bench.replay_engine import replay

    trace = read_log(log, log_format, device, max_bytes)
    factory = backends.upstream_factory(backends.resolve(backend), latency_us)
    results: Dict[str, Any] = {}
    for kind in pools:
        upstream = virtual_upstream(kind, factory)
        pool = make_arm_pool(kind, upstream, **(options or {}).get(kind, {}))
        cb = progress(kind) if progress else None
        results[kind] = replay(trace, pool, upstream, cb, include_pre_trace)
        pool.validate()
        pool.close()
    info = dict(trace.info)
    source_peak = info.get("source_peak_reserved_bytes")
    return {
        "format": "poolkeeper-replay",
        "schema": 1,
        "log": log,
        "log_format": trace.format,
        "log_info": info,
        "backend": backend,
        "events": len(trace.events),
        "pre_trace_blocks": len(trace.pre_trace),
        "pre_trace_bytes": sum(ev.size for ev in trace.pre_trace),
        "include_pre_trace": include_pre_trace,
        "ignored_actions": dict(trace.ignored),
        "source_peak_reserved_bytes": source_peak,
        "source_peak_live_bytes": info.get("source_peak_live_bytes"),
        "pools": results,
        "machine": machine_info(),
    }


def run(args: argparse.Namespace) -> int:
    from poolkeeper._paths import check_not_input, output_path, write_output
    from poolkeeper.bench.options import parse_options, split_for

    from poolkeeper.bench import backends

    pools = _pools(args.pool, backends.resolve(args.backend))
    options = split_for(pools, parse_options(args.option))
    limit = _max_bytes(args.max_log_bytes)
    to_stdout = args.json == "-"
    if args.json is not None and not to_stdout:
        # Now, not after the whole log was replayed; and never the log itself.
        check_not_input(output_path(args.json, "--json"), [args.log], "--json")
    from poolkeeper.bench.console import make_console

    console = make_console(stderr=to_stdout)
    if not args.no_progress and console.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("replay on {task.description}"), BarColumn(), TimeElapsedColumn(),
                       console=console, transient=True)

        def per_pool(kind: str) -> Any:
            task = bar.add_task(kind, total=1)

            def cb(done: int, total: int) -> None:
                bar.update(task, completed=done, total=max(total, 1))

            return cb

        with bar:
            doc = replay_log(args.log, pools, args.backend, args.log_format, args.device, options,
                             args.sim_latency_us, per_pool, args.include_pre_trace, limit)
    else:
        doc = replay_log(args.log, pools, args.backend, args.log_format, args.device, options, args.sim_latency_us,
                         include_pre_trace=args.include_pre_trace, max_bytes=limit)
    if args.json is not None:
        text = json.dumps(doc, indent=1)
        if to_stdout:
            sys.stdout.write(text + "\n")
            return 0
        write_output(args.json, text + "\n", "--json", [args.log])  # whole or not at all
    render(doc, console)
    return 0


def render(doc: Dict[str, Any], console: Any) -> None:
    """Print the report. The log's path and the action names read from it are escaped: rich reads
    ``[...]`` as markup (a log named ``x[/]y.csv``, or a snapshot action ``"[/]"``, raised
    ``MarkupError`` after the whole replay had run)."""
    from rich.markup import escape
    from rich.table import Table

    from poolkeeper.bench.format import fmt_bytes, fmt_ns, fmt_rate, fmt_ratio

    first = next(iter(doc["pools"].values()), None)
    c = first["counts"] if first else {}
    head = (f"[bold]{escape(str(doc['log']))}[/] ({doc['log_format']}"
            + (f", device {doc['log_info']['device']}" if "device" in doc["log_info"] else "")
            + f"): {doc['events']} events replayed on the {doc['backend']} backend")
    console.print(head, soft_wrap=True)
    if first:
        console.print(f"  allocations {c['allocations']}, frees {c['frees']}, unknown frees skipped "
                      f"{c['unknown_frees']}, failed in log {c['failed_in_log']}, zero-size {c['zero_size']}, "
                      f"still live at end {first['live_at_end_blocks']} ({fmt_bytes(first['live_at_end_bytes'])})")
    if doc["ignored_actions"]:
        console.print("  not replayed: " + escape(", ".join(f"{k} {v}" for k, v in sorted(doc["ignored_actions"].items()))),
                      highlight=False)
    pools = list(doc["pools"].items())
    src = doc.get("source_peak_reserved_bytes")
    t = Table(title="replay: one column per pool")
    t.add_column("", justify="left")
    for kind, _ in pools:
        t.add_column(kind, justify="right")
    if src and first and first["peak_live_bytes"]:
        t.add_column("logged allocator", justify="right", style="dim")

    def frag(r: Dict[str, Any]) -> str:
        f = r["fragmentation_at_peak"]
        return "-" if f is None else f"{f:.3f}"

    metrics = [
        ("peak live", lambda r: fmt_bytes(r["peak_live_bytes"])),
        ("peak reserved", lambda r: fmt_bytes(r["peak_reserved_bytes"])),
        ("reserved / live", lambda r: fmt_ratio(r["reserved_over_live"])),
        ("upstream allocations", lambda r: str(r["upstream_allocations"])),
        ("upstream frees", lambda r: str(r["upstream_deallocations"])),
        *([("aliases / unaliases", lambda r: f"{r.get('upstream_aliases', 0)} / {r.get('upstream_unaliases', 0)}")]
          if any(r.get("upstream_aliases") or r.get("upstream_unaliases") for _, r in pools) else []),
        *([("  in runs (frees / unaliases)", lambda r: f"{r.get('unmap_runs', 0)} / {r.get('unalias_runs', 0)}")]
          if any(r.get("unmap_runs") or r.get("unalias_runs") for _, r in pools) else []),
        ("fragmentation at peak", frag),
        ("allocate p50 / p99", lambda r: f"{fmt_ns(r['alloc']['p50_ns'])} / {fmt_ns(r['alloc']['p99_ns'])}"),
        ("free p50 / p99", lambda r: f"{fmt_ns(r['free']['p50_ns'])} / {fmt_ns(r['free']['p99_ns'])}"),
        ("max op", lambda r: fmt_ns(r["all"]["max_ns"])),
        ("ops/s", lambda r: fmt_rate(r["ops_per_s"])),
    ]
    for name, get in metrics:
        cells = [get(r) for _, r in pools]
        if src and first and first["peak_live_bytes"]:
            src_live = doc.get("source_peak_live_bytes") or first["peak_live_bytes"]
            extra = {"peak live": fmt_bytes(src_live), "peak reserved": fmt_bytes(src),
                     "reserved / live": fmt_ratio(src / src_live)}
            cells.append(extra.get(name, ""))
        t.add_row(name, *cells)
    console.print(t)
    if doc["pre_trace_bytes"]:
        if doc["include_pre_trace"]:
            note = (f"{doc['pre_trace_blocks']} blocks ({fmt_bytes(doc['pre_trace_bytes'])}) held from before the log "
                    "began were allocated first (--include-pre-trace), so the pools hold what the logged process held")
        else:
            note = (f"the logged process also held {doc['pre_trace_blocks']} blocks ({fmt_bytes(doc['pre_trace_bytes'])}) "
                    "allocated before the log began: the pools' peak live leaves them out"
                    + (", the logged allocator's counts them" if doc.get("source_peak_live_bytes") else "")
                    + " (--include-pre-trace replays them too)")
        console.print(f"[dim]{note}[/]", highlight=False, soft_wrap=True)
    console.print("[dim]reserved/live = peak reserved ÷ peak live (1.00× holds nothing beyond what was asked); "
                  "fragmentation = 1 − largest free ÷ free, at the moment live bytes peaked[/]")


__all__ = ["add_arguments", "run", "replay_log", "render"]
