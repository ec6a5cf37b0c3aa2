"""``poolkeeper bench`` end to end through the command's main(argv), on tiny subsets."""
from __future__ import annotations

import json

import pytest

from poolkeeper.bench.arms import arena_available
from poolkeeper.cli import main

FAST = ["--backend", "simulated", "--sim-latency-us", "0", "--no-progress", "--quick"]


def test_bench_quick_subset_writes_rows_and_prints_the_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = main(["bench", *FAST, "--arms", "direct,size_class", "--workloads", "kv_cache,random_lifetime",
               "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["format"] == "poolkeeper-bench"
    assert [(r["workload"], r["arm"]) for r in doc["rows"]] == [
        ("kv_cache", "direct"), ("kv_cache", "size_class"),
        ("random_lifetime", "direct"), ("random_lifetime", "size_class")]
    assert {r["scale"] for r in doc["rows"]} == {"quick"}
    text = capsys.readouterr().out
    assert "poolkeeper bench" in text and "backend simulated" in text and "scale quick" in text
    assert "kv_cache upstream allocations: direct" in text
    assert "PyTorch on the H200: 1.16×" in text
    assert f"poolkeeper compare {out}" in text


def test_bench_then_compare_round_trip(tmp_path, capsys):
    if not arena_available():
        pytest.skip("ArenaPool not built yet")
    out = tmp_path / "rows.json"
    assert main(["bench", *FAST, "--workloads", "kv_cache", "-o", "arena.max_backing=16MiB", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    arena = [r for r in rows if r["arm"] == "arena"][0]
    assert arena["config"]["max_backing"] == 16 << 20
    assert main(["compare", str(out)]) == 0
    assert "size_class vs arena" in capsys.readouterr().out


def test_bench_threads_option(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", *FAST, "--arms", "size_class", "--workloads", "threads", "--threads", "2,4",
                 "--json", str(out)]) == 0
    assert [r["params"]["threads"] for r in json.loads(out.read_text())["rows"]] == [2, 4]


def test_bench_list(capsys):
    assert main(["bench", "--list"]) == 0
    text = capsys.readouterr().out
    for name in ("hit_pair", "straddle", "large_recycle", "growth", "trim", "threads", "inference",
                 "inference_mt", "kv_cache", "random_lifetime", "cuda_async†"):
        assert name in text


@pytest.mark.parametrize("argv, message", [
    (["--workloads", "nope"], "unknown workload"),
    (["--arms", "cuda_async"], "needs the cuda backend"),
    (["--threads", "0"], "--threads"),
    (["-o", "arena=1"], "ARM.KEY=VALUE"),
])
def test_bench_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["bench", *FAST, *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_arena_vs_pool_needs_or_runs_the_arena(tmp_path, capsys):
    out = tmp_path / "avp.json"
    rc = main(["bench", *FAST, "--arena-vs-pool", "--rounds", "1", "--json", str(out)])
    if not arena_available():
        assert rc == 1 and "needs ArenaPool" in capsys.readouterr().err
        return
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["params"]["upstream"] for r in rows} == {"instant", "h200"}
    assert "arena_vs_pool" in capsys.readouterr().out
