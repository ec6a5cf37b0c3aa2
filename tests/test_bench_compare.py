"""poolkeeper compare: pivots rows into arena-advantage ratios, never mixes scales, plots."""
from __future__ import annotations

import json
import math

import pytest

from poolkeeper.bench import results
from poolkeeper.bench.compare import jsonable
from poolkeeper.bench.errors import ScaleMixError
from poolkeeper.bench.pivot import advantage, pivot
from poolkeeper.cli import main

MACHINE = {"cpu": "test", "cores": 2, "python": "3", "platform": "test", "gpu": None}


def row(arm, workload="kv_cache", scale="quick", p50=100.0, p99=1000.0, ops_per_s=1e6, up_a=10, up_d=0,
        reserved=1000, live=500, params=None, backend="simulated"):
    return {
        "arm": arm, "workload": workload, "params": params or {"layers": 4}, "backend": backend, "scale": scale,
        "ops": 100, "p50_ns": p50, "p90_ns": p50, "p99_ns": p99, "max_ns": p99, "ops_per_s": ops_per_s,
        "upstream_allocations": up_a, "upstream_deallocations": up_d, "peak_reserved_bytes": reserved,
        "peak_live_bytes": live, "machine": MACHINE, "stream_ordered": arm == "cuda_async",
    }


def test_advantage_direction_and_edge_cases():
    assert advantage(1000, 100, higher_is_better=False) == 10  # other slower: arena 10x better
    assert advantage(1e5, 1e6, higher_is_better=True) == 10  # arena does 10x the ops/s
    assert advantage(0, 0, False) == 1.0
    assert advantage(5, 0, False) == math.inf
    assert advantage(None, 3, False) is None


def test_pivot_pairs_each_arm_with_the_arena_per_workload():
    rows = [
        row("arena", p50=100, p99=200, ops_per_s=2e6, up_a=12, reserved=1050),
        row("size_class", p50=150, p99=100, ops_per_s=1e6, up_a=300, reserved=2000),
        row("direct", p50=50_000, ops_per_s=2e4, up_a=5000, up_d=5000, reserved=1000),
        row("direct", workload="straddle"),  # no arena row: unpaired
    ]
    piv = pivot(rows)
    (sc,) = piv["comparisons"]["size_class_vs_arena"]
    assert sc["workload"] == "kv_cache" and sc["scale"] == "quick"
    assert sc["p50"]["advantage"] == pytest.approx(1.5)
    assert sc["p99"]["advantage"] == pytest.approx(0.5)  # size_class has the better tail here
    assert sc["ops_per_s"]["advantage"] == pytest.approx(2.0)
    assert sc["upstream_calls"] == {"other": 300, "arena": 12, "advantage": 25.0}
    assert sc["peak_reserved"]["advantage"] == pytest.approx(2000 / 1050)
    (d,) = piv["comparisons"]["direct_vs_arena"]
    assert d["upstream_calls"]["other"] == 10000 and d["stream_ordered"] is False
    assert piv["comparisons"]["cuda_async_vs_arena"] == []
    assert piv["unpaired"] == [{"workload": "straddle", "params": {"layers": 4}, "backend": "simulated",
                                "arms": ["direct"], "missing": "arena"}]


def test_repeats_reduce_to_their_median_within_one_identity():
    rows = [row("arena", p50=p) for p in (100, 300, 200)] + [row("size_class", p50=400)]
    (e,) = pivot(rows)["comparisons"]["size_class_vs_arena"]
    assert e["p50"]["arena"] == 200 and e["n_arena"] == 3 and e["n_other"] == 1
    assert e["p50"]["advantage"] == 2.0


def test_different_params_or_backends_are_separate_identities():
    rows = [row("arena", params={"threads": 1}), row("size_class", params={"threads": 1}, p50=200),
            row("arena", params={"threads": 8}, p50=1000), row("size_class", params={"threads": 8}, p50=100)]
    es = pivot(rows)["comparisons"]["size_class_vs_arena"]
    assert [(e["params"]["threads"], e["p50"]["advantage"]) for e in es] == [(1, 2.0), (8, 0.1)]


def test_scales_are_never_mixed():
    rows = [row("arena", scale="quick"), row("size_class", scale="quick", p50=200),
            row("arena", scale="full", p50=1000), row("size_class", scale="full", p50=1000)]
    with pytest.raises(ScaleMixError, match="--scale") as ei:
        pivot(rows)
    assert ei.value.scales == ["full", "quick"]
    (q,) = pivot(rows, scale="quick")["comparisons"]["size_class_vs_arena"]
    assert q["p50"]["advantage"] == 2.0 and q["n_arena"] == 1  # the full-scale arena row did not join
    (f,) = pivot(rows, scale="full")["comparisons"]["size_class_vs_arena"]
    assert f["p50"]["advantage"] == 1.0
    with pytest.raises(ScaleMixError, match="no rows of scale"):
        pivot([row("arena", scale="quick")], scale="full")


def test_cuda_async_is_marked_stream_ordered(tmp_path, capsys):
    rows = [row("arena"), row("cuda_async", p50=50)]
    (e,) = pivot(rows)["comparisons"]["cuda_async_vs_arena"]
    assert e["stream_ordered"] is True
    path = tmp_path / "r.json"
    results.write(str(path), rows)
    assert main(["compare", str(path)]) == 0
    out = capsys.readouterr().out
    assert "stream-ordered" in out and "not a drop-in speedup" in out


def test_compare_cli_writes_json_and_plot(tmp_path, capsys):
    rows = [row("arena", up_a=0), row("size_class", up_a=7), row("direct", p50=1e5)]
    path = tmp_path / "r.json"
    results.write(str(path), rows)
    png = tmp_path / "c.png"
    out_json = tmp_path / "pivot.json"
    assert main(["compare", str(path), "--plot", str(png), "--json", str(out_json), "--raw"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    piv = json.loads(out_json.read_text())
    (sc,) = piv["comparisons"]["size_class_vs_arena"]
    assert sc["upstream_calls"]["advantage"] == "inf"  # JSON has no infinity
    text = capsys.readouterr().out
    assert "size_class vs arena" in text and "direct vs arena" in text


def test_compare_cli_refuses_mixed_scales(tmp_path, capsys):
    a, b = tmp_path / "quick.json", tmp_path / "full.json"
    results.write(str(a), [row("arena"), row("size_class")])
    results.write(str(b), [row("arena", scale="full"), row("size_class", scale="full")])
    assert main(["compare", str(a), str(b)]) == 1
    assert "mix config scales" in capsys.readouterr().err
    assert main(["compare", str(a), str(b), "--scale", "full"]) == 0


def test_jsonable():
    assert jsonable({"a": [math.inf, 1.0]}) == {"a": ["inf", 1.0]}


def test_arena_expandable_is_a_fourth_comparison_against_the_arena():
    from poolkeeper.bench.pivot import pivot as _pivot

    def row(arm, reserved, calls):
        return {"workload": "kv_cache", "params": {}, "backend": "simulated", "scale": "quick", "arm": arm,
                "p50_ns": 100, "p99_ns": 200, "ops_per_s": 1e6, "upstream_allocations": calls,
                "upstream_deallocations": 0, "peak_reserved_bytes": reserved}

    piv = _pivot([row("arena", 150, 9), row("arena_expandable", 120, 30)])
    (e,) = piv["comparisons"]["arena_expandable_vs_arena"]
    assert e["peak_reserved"]["advantage"] == 120 / 150  # < 1: the expandable arm holds less
    assert e["upstream_calls"]["advantage"] == 30 / 9
