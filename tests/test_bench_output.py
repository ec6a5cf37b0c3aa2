"""``poolkeeper bench`` output read in a pipe: whole cells at 80 and 160 columns, progress lines
instead of a bar, and one figure per quantity (the table's p50 is the one the notes print)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import poolkeeper
from poolkeeper.bench.arms import ARM_NAMES
from poolkeeper.bench.tables import bench_tables
from poolkeeper.bench.workloads import WORKLOADS

ELLIPSIS = "…"


def _row(workload: str, arm: str, **params) -> dict:
    big = 123_456_789
    return {"workload": workload, "params": params, "arm": arm, "stream_ordered": arm == "cuda_async",
            "ops": big, "p50_ns": 987_654.0, "p99_ns": 12_345_678.0, "max_ns": 1.5e9, "ops_per_s": 1.23e7,
            "upstream_allocations": big, "upstream_deallocations": big, "peak_reserved_bytes": 1234567890123,
            "peak_live_bytes": 1234567890, "reserved_over_live": 1000.0}


def _render(tables, width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    c = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for t in tables:
        c.print(t)
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 160])
def test_no_cell_truncated_with_the_longest_names(width):
    # The regression: the params column was cut to "nbyte…" / "threa…" at 160 columns.
    longest_workload = max(WORKLOADS, key=len)
    rows = [_row(longest_workload, arm, threads=32, nbytes=64 << 20, steps=4000) for arm in ARM_NAMES]
    rows += [_row("hit_pair", arm, nbytes=4096) for arm in ARM_NAMES]
    text = _render(bench_tables(rows, "poolkeeper bench", width), width)
    assert ELLIPSIS not in text
    assert all(len(line) <= width for line in text.splitlines())
    for word in [longest_workload, "threads=32", "nbytes=64MiB", "steps=4000", *ARM_NAMES]:
        assert word in text


def test_wide_console_gets_one_table_narrow_gets_two():
    rows = [_row("trim", "arena")]
    assert len(bench_tables(rows, "t", 400)) == 1
    assert len(bench_tables(rows, "t", 80)) == 2


def _bench_in_a_pipe(columns: int, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS=str(columns))
    site = str(Path(poolkeeper.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "poolkeeper.cli", "bench", "--quick", "--backend", "simulated",
           "--sim-latency-us", "0", "--workloads", "trim,random_lifetime", "--arms", "direct,arena", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("columns", [80, 160])
def test_cli_in_a_pipe_keeps_every_cell_whole_and_reports_progress(columns):
    r = _bench_in_a_pipe(columns)
    assert r.returncode == 0, r.stderr
    # The notes under the tables are sentences ("trim arena: p50 ..."); every other line is a table's.
    table_lines = [line for line in r.stdout.splitlines() if ": " not in line]
    assert any("random_lifetime" in line for line in table_lines)
    assert ELLIPSIS not in r.stdout
    assert all(len(line) <= columns for line in table_lines)
    assert "steps=4000" in r.stdout
    # Not a terminal: a start line and one line per workload on stderr, with an estimate.
    err = r.stderr.splitlines()
    assert err[0].startswith("poolkeeper bench: 4 runs (2 workload cases x 2 arms)")
    assert err[1].startswith("[2/4] trim done in") and "eta" in err[1]
    assert err[2].startswith("[4/4] random_lifetime done in")


def test_no_progress_means_no_progress_lines():
    r = _bench_in_a_pipe(160, "--no-progress")
    assert r.returncode == 0 and r.stderr == ""


def test_trim_p50_in_the_notes_is_the_tables_p50():
    # The regression: the notes took statistics.median (the mean of the two middle repetitions)
    # while the table took the nearest-rank p50, so "trim p50" had two different figures.
    from poolkeeper.bench import runner
    from poolkeeper.bench.highlights import highlights
    from poolkeeper.bench.format import fmt_ns

    cfg = runner.RunConfig(backend="simulated", scale="quick", arms=["arena"], workloads=["trim"], latency_us=0)
    (row,) = runner.run(cfg)
    x = row["extras"]
    assert x["trim_ns_p50"] == row["p50_ns"]
    assert x["trim_traversal_ns_p50"] + x["trim_upstream_free_ns_p50"] == x["trim_ns_p50"]
    (line,) = [ln for ln in highlights([row]) if ln.startswith("trim ")]
    assert f"p50 {fmt_ns(row['p50_ns'])} =" in line


def test_hit_pair_ratio_is_of_the_tables_p50():
    from poolkeeper.bench import runner

    cfg = runner.RunConfig(backend="simulated", scale="quick", arms=["direct"], workloads=["hit_pair"], latency_us=0)
    row = runner.run(cfg)[0]
    x = row["extras"]
    assert x["pair_over_two_empty_calls"] == pytest.approx(row["p50_ns"] / x["two_empty_calls_ns"])
