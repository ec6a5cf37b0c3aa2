"""``poolkeeper bench``: run the benchmark matrix (workloads x arms) and print a table.

    poolkeeper bench                      # every workload x every arm on the auto backend
    poolkeeper bench --quick              # reduced sizes: under a minute on 2 cores
    poolkeeper bench --arms size_class,arena --workloads kv_cache,random_lifetime --json out.json
    poolkeeper bench --arena-vs-pool      # arena vs size_class on instant and H200-busy-wait upstreams
    poolkeeper bench --list               # the workloads and arms
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from poolkeeper.bench.backends import BACKENDS


def _names(text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    from poolkeeper.errors import InvalidArgumentError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgumentError(f"--threads takes comma-separated thread counts, e.g. 1,4,16; got {text!r}") from None
    if not out or any(n < 1 or n > 1024 for n in out):
        raise InvalidArgumentError(f"--threads: counts must be 1..1024; got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto (cuda if a GPU is present, else simulated), simulated (H200-calibrated), host, cuda")
    p.add_argument("--quick", action="store_true", help="reduced sizes (under a minute on 2 cores)")
    from poolkeeper.bench.arms import ARM_NAMES

    p.add_argument("--arms", default=None, help="comma-separated arms (default: all that run here): "
                   + ", ".join(ARM_NAMES))
    p.add_argument("--workloads", default=None, help="comma-separated workloads (default: all; see --list)")
    p.add_argument("--threads", default=None, help="thread counts for the threads workload (default 1,2,4,8,16,32)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every row to PATH as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomized workloads (default 0)")
    p.add_argument("--arena-vs-pool", action="store_true",
                   help="instead of the matrix: arena vs size_class in one process on an instant stub and on the "
                        "H200-calibrated busy-wait upstream")
    p.add_argument("--rounds", type=int, default=None, help="--arena-vs-pool rounds (default 5, --quick 2)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="ARM.KEY=VALUE",
                   help="pool option for one arm, e.g. arena.max_backing=64MiB")
    p.add_argument("--list", action="store_true", help="list workloads and arms, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--sim-latency-us", type=float, default=None, help=argparse.SUPPRESS)


def _arm_options(items: List[str]) -> Dict[str, Dict[str, Any]]:
    from poolkeeper.bench.arms import ARM_NAMES
    from poolkeeper.bench.options import parse_value
    from poolkeeper.errors import InvalidArgumentError

    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        lhs, sep, value = item.partition("=")
        arm, dot, key = lhs.partition(".")
        if not sep or not dot or arm not in ARM_NAMES or not key:
            raise InvalidArgumentError(f"option {item!r} is not ARM.KEY=VALUE with ARM one of {', '.join(ARM_NAMES)}")
        out.setdefault(arm, {})[key] = parse_value(value)
    return out


def _list(console: Any) -> int:
    from poolkeeper.bench.arms import ARM_NAMES, make_arm
    from poolkeeper.bench.workloads import WORKLOADS

    console.print("[bold]workloads[/]")
    for w in WORKLOADS.values():
        console.print(f"  {w.name:16s} {w.summary}")
    console.print("[bold]arms[/]")
    for n in ARM_NAMES:
        a = make_arm(n)
        console.print(f"  {a.label:16s} {a.description}")
    return 0


class _Bar:
    """A rich progress bar (with an ETA) fed by the runner's (done, total, label) callback."""

    def __init__(self, console: Any, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                     console=console, transient=True)
            self.task = None

    def __enter__(self) -> "_Bar":
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress:
            self.progress.__exit__(*exc)

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.progress:
            return
        if self.task is None:
            self.task = self.progress.add_task(label, total=total)
        self.progress.update(self.task, completed=done, total=total, description=label)


class _Lines:
    """Progress for a pipe or a file (no bar can redraw there): one line on stderr each time a
    workload's runs are all done, with the elapsed time and a remaining-time estimate."""

    def __init__(self, stream: Any) -> None:
        import time

        self._clock = time.monotonic
        self._stream = stream
        self._t0 = self._clock()
        self._workload: Optional[str] = None
        self._since = self._t0

    def _line(self, done: int, total: int) -> None:
        now = self._clock()
        elapsed = now - self._t0
        eta = elapsed / done * (total - done) if done else 0.0
        self._stream.write(f"[{done}/{total}] {self._workload} done in {now - self._since:.1f} s "
                           f"(elapsed {elapsed:.0f} s, eta {eta:.0f} s)\n")
        self._stream.flush()
        self._since = now

    def __call__(self, done: int, total: int, label: str) -> None:
        workload = None if label == "done" else label.split(" ", 1)[0]
        if self._workload is not None and workload != self._workload:
            self._line(done, total)
        self._workload = workload


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from poolkeeper.bench import results
    from poolkeeper.bench.console import make_console

    console = make_console()
    if args.list:
        return _list(console)
    scale = "quick" if args.quick else "full"
    arm_options = _arm_options(args.option)
    if args.json:
        results.check_writable(args.json)  # now, not after the whole matrix ran
    show_bar = not args.no_progress and console.is_terminal
    show_lines = not args.no_progress and not console.is_terminal
    if args.arena_vs_pool:
        return _arena_vs_pool(args, console, scale, arm_options, show_bar)

    from poolkeeper.bench import runner
    from poolkeeper.bench.arms import STREAM_ORDERED_NOTE
    from poolkeeper.bench.highlights import highlights
    from poolkeeper.bench.tables import bench_tables

    cfg = runner.RunConfig(backend=args.backend, scale=scale, arms=_names(args.arms),
                           workloads=_names(args.workloads), threads=_ints(args.threads), seed=args.seed,
                           latency_us=args.sim_latency_us, arm_options=arm_options)
    pl = runner.plan(cfg)
    start = (f"{pl.total} runs ({len(pl.cases)} workload cases x {len(pl.arms)} arms) on backend {pl.backend}, "
             f"scale {scale}" + ("; --quick runs in under a minute" if scale == "full" else ""))
    if show_bar:
        console.print(f"[dim]{start}[/]", highlight=False)
    elif show_lines:
        print(f"poolkeeper bench: {start}", file=sys.stderr, flush=True)
    if show_lines:
        rows = runner.run(cfg, _Lines(sys.stderr), pl)
    else:
        with _Bar(console, show_bar) as bar:
            rows = runner.run(cfg, bar, pl)
    title = (f"poolkeeper bench — backend {pl.backend}"
             + (" (H200-calibrated simulated device)" if pl.backend == "simulated" and args.sim_latency_us is None else "")
             + f", scale {scale}, arms {', '.join(a.label for a in pl.arms)}")
    for table in bench_tables(rows, title, console.width):
        console.print(table)
    for line in highlights(rows):
        console.print(line, highlight=False, soft_wrap=True)
    notes = list(pl.skipped and [f"not run: {'; '.join(pl.skipped)}"] or [])
    if any(r["stream_ordered"] for r in rows):
        notes.append(STREAM_ORDERED_NOTE)
    notes.append("ops: allocate and deallocate calls, each timed alone (timer cost "
                 f"~{rows[0]['timer_floor_ns']:.0f} ns included); hit_pair: ns per pair, batched; trim: ns per trim()."
                 if rows else "no rows")
    for n in notes:
        console.print(f"[dim]{n}[/]", highlight=False, soft_wrap=True)
    if args.json:
        # After the table: if the write fails after all, the rows were shown and are rescued.
        results.write_or_rescue(args.json, rows)
        # The path is escaped: rich reads "[...]" as markup, and `--json 'x[/]y.json'` raised
        # MarkupError here, after the whole matrix had run.
        shown = escape(args.json)
        console.print(f"[dim]rows written to {shown} (compare them with: poolkeeper compare {shown})[/]",
                      highlight=False, soft_wrap=True)
    return 0


def _arena_vs_pool(args: argparse.Namespace, console: Any, scale: str, arm_options: Dict[str, Dict[str, Any]],
                   show_bar: bool) -> int:
    from poolkeeper.bench import arena_vs_pool, results

    with _Bar(console, show_bar) as bar:
        rows = arena_vs_pool.run(scale, args.rounds, args.seed, on_progress=bar, arm_options=arm_options,
                                 device_latency_us=args.sim_latency_us)
    console.print(arena_vs_pool.summary_table(arena_vs_pool.summary(rows)))
    if args.json:
        results.write_or_rescue(args.json, rows)
    console.print("[dim]instant stub: the pools' own bookkeeping; H200 busy-wait: each upstream call costs the "
                  "calibrated cudaMalloc/cudaFree time (86 µs + 0.79 µs/MiB per pair)[/]", highlight=False)
    return 0


__all__ = ["add_arguments", "run"]
