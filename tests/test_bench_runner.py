"""The benchmark runner: rows carry every field, counts come from the pools' own accounting, and
the workloads are the sequences they claim to be."""
from __future__ import annotations

import json

import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.bench import results, runner
from poolkeeper.bench.arms import arena_available, select_arms
from poolkeeper.bench.errors import ResultsError, UnknownNameError
from poolkeeper.bench.workloads import WORKLOADS
from poolkeeper.bench.workloads.base import Selection

ARMS = ["direct", "size_class"] + (["arena"] if arena_available() else [])
ROW_FIELDS = set(results.REQUIRED) | {
    "p90_ns", "mean_ns", "wall_s", "timing", "config", "upstream", "extras", "seed", "reserved_over_live",
    "timer_floor_ns", "upstream_alloc_ns", "upstream_dealloc_ns",
}


def instant():
    return pk.upstream.Simulated(latency_us=0)


def run_rows(workloads, arms=None, **kw):
    cfg = runner.RunConfig(backend="simulated", scale="quick", arms=arms or ARMS, workloads=workloads,
                           latency_us=0, **kw)
    return runner.run(cfg)


def test_rows_have_every_field_and_sane_quantiles():
    rows = run_rows(["straddle"])
    assert [r["arm"] for r in rows] == ARMS
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert r["workload"] == "straddle" and r["backend"] == "simulated" and r["scale"] == "quick"
        assert r["stream_ordered"] is False
        assert r["ops"] == len_ops_straddle(r["params"])
        assert 0 < r["p50_ns"] <= r["p90_ns"] <= r["p99_ns"] <= r["max_ns"]
        assert r["ops_per_s"] > 0 and r["wall_s"] > 0
        assert r["peak_reserved_bytes"] >= r["peak_live_bytes"] > 0
        assert r["reserved_over_live"] == pytest.approx(r["peak_reserved_bytes"] / r["peak_live_bytes"])
        assert {"cpu", "cores", "python", "platform", "gpu"} <= set(r["machine"])
        assert r["upstream"]["latency_model"]["alloc_base_us"] == 0
    json.dumps(rows)  # rows are plain JSON


def len_ops_straddle(p):
    boundaries = 4 * (p["max_pow2"] - p["min_pow2"] + 1)
    return p["rounds"] * boundaries * 2


def test_direct_arm_makes_one_upstream_call_per_op():
    (row,) = run_rows(["large_recycle"], arms=["direct"])
    assert row["upstream_allocations"] == row["ops"] // 2
    assert row["upstream_deallocations"] == row["ops"] // 2


def test_size_class_caches_where_direct_does_not():
    rows = {r["arm"]: r for r in run_rows(["kv_cache"], arms=["direct", "size_class"])}
    d, s = rows["direct"], rows["size_class"]
    assert d["ops"] == s["ops"]  # the same sequence on both arms
    assert d["upstream_allocations"] == d["ops"] // 2
    assert s["upstream_allocations"] < d["upstream_allocations"]
    assert s["upstream_deallocations"] == 0  # nothing is trimmed during the run
    assert d["extras"]["distinct_sizes"] == s["extras"]["distinct_sizes"] > 100


def test_random_lifetime_replays_the_torch_anchor_sequence():
    # PyTorch's caching allocator was measured on this exact sequence: peak live 446.1 MiB.
    rows = run_rows(["random_lifetime"], arms=["direct", "size_class"])
    for r in rows:
        assert round(r["peak_live_bytes"] / 2**20, 1) == 446.1
        assert r["extras"]["torch_anchor"]["ratio"] == 1.16
        assert r["extras"]["probe_bytes"] == 64 << 20
    direct = rows[0]
    # Direct holds exactly what is live (plus alignment), so it can never serve the probe from cache.
    assert direct["peak_reserved_bytes"] < direct["peak_live_bytes"] * 1.001
    assert direct["extras"]["probe_fit"] is False and direct["extras"]["probe_upstream_allocations"] == 1


@pytest.mark.parametrize("name", ["straddle", "large_recycle", "kv_cache", "random_lifetime"])
def test_workload_peak_live_agrees_with_the_pool(name):
    w = WORKLOADS[name]
    (params,) = w.params(Selection(scale="quick"))[:1]
    pool = pk.SizeClassPool(instant())
    from poolkeeper.bench.workloads.base import RunContext

    meas = w.run(pool, params, RunContext("size_class", "simulated", "quick", pool.upstream))
    st = pool.stats()
    assert st["live_bytes"] == 0 and st["live_blocks"] == 0  # every workload frees what it allocated
    if name != "random_lifetime":  # its probe is counted by the pool but is not one of the run's ops
        assert meas.peak_live_bytes == st["peak_live_bytes"]
    pool.close()


def test_threads_rows_follow_the_thread_option():
    rows = run_rows(["threads"], arms=["size_class"], threads=[1, 3])
    assert [r["params"]["threads"] for r in rows] == [1, 3]
    for r in rows:
        per = r["extras"]["pairs_per_thread"]
        assert r["ops"] == 2 * per * r["params"]["threads"]


def test_trim_splits_traversal_from_upstream_frees():
    rows = {r["arm"]: r for r in run_rows(["trim"], arms=["direct", "size_class"])}
    d, s = rows["direct"]["extras"], rows["size_class"]["extras"]
    assert d["trim_upstream_frees_p50"] == 0 and d["trim_released_bytes_p50"] == 0  # nothing cached
    assert s["trim_upstream_frees_p50"] > 0 and s["trim_released_bytes_p50"] > 0
    assert rows["size_class"]["ops"] == rows["size_class"]["params"]["repetitions"]
    assert rows["size_class"]["timing"] == "per_trim"


def test_hit_pair_reports_empty_call_and_capi_and_restores_the_registry():
    assert _core.registry_get(-1) is None
    (row,) = run_rows(["hit_pair"], arms=["size_class"])[:1]
    x = row["extras"]
    assert x["empty_call_ns"] > 0 and x["two_empty_calls_ns"] == pytest.approx(2 * x["empty_call_ns"])
    assert x["capi_pair_ns"] > 0
    assert row["upstream_allocations"] == 1  # every measured pair was a hit
    assert row["timing"].startswith("batch:")
    assert _core.registry_get(-1) is None


def test_arm_selection():
    arms, skipped = select_arms(None, "simulated")
    assert "cuda_async" not in [a.name for a in arms]
    assert any(s.startswith("cuda_async") for s in skipped)
    with pytest.raises(UnknownNameError, match="cuda backend"):
        select_arms(["cuda_async"], "simulated")
    with pytest.raises(UnknownNameError, match="unknown arm"):
        select_arms(["nope"], "simulated")
    with pytest.raises(UnknownNameError, match="unknown workload"):
        runner.plan(runner.RunConfig(backend="simulated", workloads=["nope"]))
    with pytest.raises(UnknownNameError, match="unknown backend"):
        runner.plan(runner.RunConfig(backend="tpu"))


def test_results_roundtrip_and_rejects_foreign_files(tmp_path):
    rows = run_rows(["straddle"], arms=["direct"])
    path = tmp_path / "r.json"
    results.write(str(path), rows, command=["poolkeeper", "bench"])
    doc = json.loads(path.read_text())
    assert doc["format"] == "poolkeeper-bench" and doc["command"] == ["poolkeeper", "bench"]
    assert results.load([str(path)]) == json.loads(json.dumps(rows))
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(ResultsError, match="not a poolkeeper bench results file"):
        results.load([str(other)])
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": "poolkeeper-bench", "schema": 1, "rows": [{"arm": "direct"}]}))
    with pytest.raises(ResultsError, match="row 0 lacks"):
        results.load([str(broken)])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ResultsError, match="not JSON"):
        results.load([str(bad)])


@pytest.mark.skipif(not arena_available(), reason="ArenaPool not built yet")
def test_arena_vs_pool_rows():
    from poolkeeper.bench import arena_vs_pool

    rows = arena_vs_pool.run("quick", rounds=1, inner=["kv_cache"], device_latency_us=0)
    assert {(r["arm"], r["params"]["upstream"]) for r in rows} == {
        ("size_class", "instant"), ("arena", "instant"), ("size_class", "h200"), ("arena", "h200")}
    assert all(r["workload"] == "arena_vs_pool:kv_cache" for r in rows)
    (entry, _) = arena_vs_pool.summary(rows)
    assert entry["size_class"]["upstream_calls"] > 0 and "size_class_over_arena" in entry
