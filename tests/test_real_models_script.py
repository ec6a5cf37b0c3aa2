"""benchmarks/real_models.py: its pure parts (quantiles, ratios, comparison, the Markdown table,
output paths, the per-arm environment) without torch, and a CPU dry run when torch and
transformers are importable."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from benchmark_scripts import load_script, loading_imports_torch, script_path

SCRIPT = script_path("real_models.py")
rm = load_script("real_models.py")


def test_script_imports_without_torch():
    # The parent must stay torch-free: torch is imported only in the arm's own process.
    assert not loading_imports_torch("real_models.py")


def test_quantiles_nearest_rank():
    q = rm.quantiles(range(1, 11))
    assert (q["p50"], q["p90"], q["n"], q["total"]) == (5.0, 9.0, 10, 55.0)
    assert q["mean"] == 5.5
    assert rm.quantiles([7.0])["p90"] == 7.0
    assert rm.quantiles([3, 1, 2])["p50"] == 2.0  # unsorted input


def test_quantiles_empty():
    q = rm.quantiles([])
    assert q["n"] == 0 and math.isnan(q["p50"]) and math.isnan(q["p90"])


def test_ratio_missing_or_zero():
    assert rm.ratio(3, 2) == 1.5
    assert rm.ratio(None, 2) is None
    assert rm.ratio(1, 0) is None
    assert rm.ratio(1, float("nan")) is None
    assert rm.ratio("x", 1) is None


def _run(reserved, live, p50, total, sha, per=None):
    return {
        "peak_reserved_bytes": reserved,
        "peak_live_bytes": live,
        "upstream_allocations": 10,
        "upstream_deallocations": 4,
        "maps": None,
        "unmaps": None,
        "request_ms": {"p50": p50, "p90": p50 * 2, "total": total, "n": 3},
        "output_sha256": sha,
        "request_sha256": per or ["a", "b", "c"],
    }


def _results():
    runs = {
        "torch": _run(800 << 20, 500 << 20, 10.0, 40.0, "s" * 64),
        "torch_expandable": _run(600 << 20, 500 << 20, 11.0, 44.0, "s" * 64),
        "arena_expandable": _run(540 << 20, 500 << 20, 10.2, 41.0, "s" * 64),
        "size_class": _run(900 << 20, 500 << 20, 9.0, 36.0, "t" * 64, ["a", "x", "c"]),
        "arena": {"error": "RuntimeError: boom | pipe\nsecond line"},
    }
    return {
        "plan_name": "quick",
        "plan": {"bert": {"requests": 3}},
        "seed": 1,
        "device": "cuda",
        "arms": ["torch", "torch_expandable", "arena", "arena_expandable", "size_class"],
        "workloads": ["bert"],
        "runs": {"bert": runs},
        "meta": {"device_name": "GPU", "torch": "2.11", "transformers": "4.x"},
    }


def test_compare_ratios_and_outputs():
    c = rm.compare(_results()["runs"]["bert"])
    assert c["torch"]["reserved_vs_torch"] == 1.0
    assert c["arena_expandable"]["reserved_vs_torch_expandable"] == pytest.approx(0.9)
    assert c["arena_expandable"]["reserved_vs_torch"] == pytest.approx(540 / 800)
    assert c["arena_expandable"]["ms_p50_vs_torch"] == pytest.approx(1.02)
    assert c["arena_expandable"]["ms_total_vs_torch"] == pytest.approx(41 / 40)
    assert c["arena_expandable"]["same_output_as_torch"] is True
    assert c["size_class"]["same_output_as_torch"] is False
    assert c["size_class"]["first_differing_request"] == 1
    assert c["arena"] == {}  # a failed arm gets no ratios


def test_targets():
    t = rm.targets(rm.compare(_results()["runs"]["bert"]))
    assert set(t) == {"arena", "arena_expandable", "size_class"}  # pool arms only
    assert t["arena_expandable"] == {"reserved": True, "time": False}  # 0.90x reserved, 41/40 = 1.025x time
    assert t["size_class"] == {"reserved": False, "time": True}
    assert t["arena"] == {"reserved": None, "time": None}


def test_compare_without_baselines():
    runs = _results()["runs"]["bert"]
    del runs["torch"], runs["torch_expandable"]
    c = rm.compare(runs)
    assert c["arena_expandable"]["reserved_vs_torch"] is None
    assert c["arena_expandable"]["reserved_vs_torch_expandable"] is None
    assert c["arena_expandable"]["same_output_as_torch"] is None
    assert c["arena_expandable"]["reserved_over_live"] == pytest.approx(540 / 500)


def test_markdown_table():
    res = _results()
    res["runs"]["bert"]["torch"]["decode_step_ms"] = {"p50": 5.0}
    res["runs"]["bert"]["arena_expandable"]["decode_step_ms"] = {"p50": 5.5}
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    md = rm.markdown(res)
    rows = [l for l in md.splitlines() if l.startswith("| ")]
    header = rows[0]
    ncols = header.count("|")
    assert all(r.count("|") == ncols for r in rows), rows  # the failed arm's row keeps the width
    by_arm = {r.split("|")[1].strip(): r for r in rows[1:]}
    assert set(by_arm) == {"torch", "torch_expandable", "arena", "arena_expandable", "size_class"}
    assert "540.0 MiB" in by_arm["arena_expandable"] and "0.900x" in by_arm["arena_expandable"]
    assert "failed: second line" in by_arm["arena"]
    assert "no (request 1)" in by_arm["size_class"]
    assert "10 / 4" in by_arm["torch"]
    assert "5.50 (1.100x)" in by_arm["arena_expandable"]
    assert "arena_expandable: reserved met, time missed" in md


def test_out_stem(tmp_path):
    assert rm.out_stem(None, "cuda", False).endswith(os.path.join("results", "real_models_h200"))
    assert rm.out_stem(None, "cpu", True).endswith("real_models_cpu_quick")
    assert rm.out_stem(str(tmp_path), "cuda", False) == os.path.join(str(tmp_path), "real_models_h200")
    assert rm.out_stem(str(tmp_path / "x.json"), "cuda", False) == str(tmp_path / "x")
    assert rm.out_stem(str(tmp_path / "y"), "cuda", True) == str(tmp_path / "y")


def test_child_env_expandable_only_in_its_arm():
    base = {"PYTORCH_CUDA_ALLOC_CONF": "garbage", "X": "1"}
    assert rm.child_env("torch_expandable", base)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for arm in ("torch", "arena", "arena_expandable", "size_class"):
        env = rm.child_env(arm, base)
        assert "PYTORCH_CUDA_ALLOC_CONF" not in env and env["X"] == "1" and env["PYTHONUNBUFFERED"] == "1"


def test_arm_and_pool_kind_names_agree():
    pools = pytest.importorskip("poolkeeper.pools")
    for arm in rm.POOL_ARMS:
        kind, options = rm.arm_pool(arm)
        assert pools.pool_kind(kind).name == kind
        expected = {}
        for f in arm.split("+")[1:]:  # in order: "+no_X" after a preset overrides it
            if f in rm.PRESETS:
                expected.update(getattr(pools, f.upper()))
            elif f.startswith("no_"):
                expected[f[3:]] = False
            elif "=" in f:
                continue  # checked below
            else:
                expected[f] = True
        set_later = {f.partition("=")[0] for f in arm.split("+")[1:] if "=" in f}
        assert {k: v for k, v in options.items() if k not in set_later} == {k: v for k, v in expected.items()
                                                                            if k not in set_later}
    assert rm.arm_pool("arena_expandable+single_stream+wide_stitch+no_stitch_top_up")[1]["stitch_top_up"] is False
    # "+OPTION=VALUE" reads its value as `poolkeeper replay -o` does.
    assert rm.arm_pool("arena_expandable+single_stream+wide_stitch+map_piece=20MiB")[1]["map_piece"] == 20 << 20


def test_variant_arms_build_a_pool_with_their_option_and_stay_out_of_the_default_run():
    pk = pytest.importorskip("poolkeeper")
    for arm in rm.VARIANT_ARMS:
        kind, options = rm.arm_pool(arm)
        pool = pk.make_pool(kind, pk.upstream.Simulated(latency_us=0), **options)
        assert pool.stats()["single_stream"] == 1
        pool.close()
        assert arm not in rm.DEFAULT_ARMS and arm in rm.ALL_ARMS


def _have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not (_have("torch") and _have("transformers")), reason="needs torch and transformers")
def test_cpu_dry_run(tmp_path):
    # The plumbing end to end: a child per (arm, workload), hashes, JSON and Markdown; the pool
    # arm cannot install on CPU and must be reported, not abort the run.
    out = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--arms", "torch,arena", "--workloads", "bert",
         "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "real_models_cpu_quick.json").read_text())
    for wl in ("bert",):
        t = res["runs"][wl]["torch"]
        assert "error" not in t, t
        assert len(t["output_sha256"]) == 64 and len(t["request_sha256"]) == res["plan"][wl]["requests"]
        assert "error" in res["runs"][wl]["arena"]
        # Every arm's process times torch.empty + drop at each size (no allocation count on CPU).
        assert set(t["empty_drop_ns"]) == {str(k) for k in rm.EMPTY_DROP_SIZES}
        assert all(v > 0 for v in t["empty_drop_ns"].values()) and t["allocations_per_unit"] is None
    assert (tmp_path / "real_models_cpu_quick.md").read_text().count("failed:") == 1


def test_left_padded_batch_pads_on_the_left_in_the_draw_order_both_scripts_used():
    np = pytest.importorskip("numpy")
    ids, mask = rm.left_padded_batch(np, np.random.default_rng(7), (2, 5), (3, 9), 100)
    # The draws the scripts made inline before: batch size, lengths, then the ids.
    rng = np.random.default_rng(7)
    b = int(rng.integers(2, 6))
    lens = rng.integers(3, 10, size=b)
    L = int(lens.max())
    want_mask = (np.arange(L)[None, :] >= (L - lens)[:, None]).astype(np.int64)
    assert (mask == want_mask).all() and (ids == rng.integers(3, 100, size=(b, L)) * want_mask).all()
    assert ids.dtype == mask.dtype == np.int64 and (mask.sum(1) == lens).all()


def test_round_times_pairs_each_round_with_torchs_and_skips_failures():
    def run(total):
        return {"request_ms": {"total": total}}

    rounds = {
        "torch": [run(100.0), run(120.0), run(110.0)],
        "arena": [run(99.0), {"error": "boom"}, run(121.0)],
    }
    t = rm.round_times(rounds)
    assert t["torch"]["median_ms"] == 110.0 and t["torch"]["paired_median_vs_torch"] == 1.0
    assert t["arena"]["total_ms"] == [99.0, None, 121.0]
    assert t["arena"]["median_ms"] == 110.0  # the failed round is left out
    assert t["arena"]["paired_vs_torch"] == pytest.approx([0.99, 1.1])
    assert t["arena"]["paired_median_vs_torch"] == pytest.approx(1.045)
    assert t["arena"]["best_ms"] is None  # no per-request times in these runs
    # Without a torch run there is nothing to pair with.
    assert rm.round_times({"arena": rounds["arena"]})["arena"]["paired_median_vs_torch"] is None


def _each_run(times, hashes=None, broken=None):
    r = {"request_ms": {"total": sum(times)}, "request_ms_each": list(times),
         "request_sha256": list(hashes or [f"h{i}" for i in range(len(times))])}
    if broken is not None:
        r["barrier_broken_at"] = f"request{broken}"
    return r


def test_paired_each_is_the_geometric_mean_of_same_round_request_ratios():
    # Round 2 is twice as slow for both arms (a drifting host): paired within the round it cancels.
    torch = [_each_run([10, 20, 40]), _each_run([20, 40, 80])]
    arena = [_each_run([11, 22, 44]), _each_run([22, 44, 88])]
    e = rm.paired_each({"torch": torch, "arena": arena})
    assert "torch" not in e
    a = e["arena"]
    assert a["gm"] == pytest.approx(1.1) and a["lo"] == pytest.approx(1.1) and a["hi"] == pytest.approx(1.1)
    assert (a["pairs"], a["requests"], a["rounds"]) == (6, 3, 2)
    assert rm.round_times({"torch": torch, "arena": arena})["arena"]["paired_each_vs_torch"] == a


def test_paired_each_counts_only_requests_that_ran_paired_with_the_same_output():
    torch = [_each_run([10, 10, 10, 10], broken=3), _each_run([10, 10, 10, 10])]
    arena = [_each_run([12, 12, 12, 99]),  # request 3 ran after torch's peers stopped meeting it
             _each_run([12, 99, 12, 12], hashes=["h0", "other", "h2", "h3"])]  # request 1: other work
    a = rm.paired_each({"torch": torch, "arena": arena})["arena"]
    assert a["gm"] == pytest.approx(1.2) and (a["pairs"], a["requests"], a["rounds"]) == (6, 4, 2)
    # A failed round and a round without per-request times pair nothing; no pair at all, no entry.
    assert rm.paired_each({"torch": torch, "arena": [{"error": "boom"}, {"request_ms": {"total": 1}}]}) == {}


def test_paired_each_interval_widens_with_the_spread_and_holds_the_mean():
    import random
    rng = random.Random(3)
    base = [float(rng.randint(5, 50)) for _ in range(60)]
    tight = {"torch": [_each_run(base)], "arena": [_each_run([x * 1.05 for x in base])]}
    wide = {"torch": [_each_run(base)],
            "arena": [_each_run([x * (1.05 + (0.3 if i % 2 else -0.3)) for i, x in enumerate(base)])]}
    t, w = rm.paired_each(tight)["arena"], rm.paired_each(wide)["arena"]
    assert t["hi"] - t["lo"] < 1e-9
    assert w["lo"] < w["gm"] < w["hi"] and w["hi"] - w["lo"] > 0.05
    assert rm.paired_each(wide) == rm.paired_each(wide)  # seeded


def test_paired_each_interval_holds_a_rounds_luck():
    # Every request 1.25x in one round and 0.8x in the other: the arms are even, and the interval
    # must say so (drawing requests alone, every draw would average the same two rounds).
    base = [float(x) for x in range(5, 65)]
    torch = [_each_run(base), _each_run(base)]
    arena = [_each_run([x * 1.25 for x in base]), _each_run([x * 0.8 for x in base])]
    a = rm.paired_each({"torch": torch, "arena": arena})["arena"]
    assert a["gm"] == pytest.approx(1.0)
    assert a["lo"] == pytest.approx(0.8) and a["hi"] == pytest.approx(1.25)


def test_round_times_pair_each_rounds_decode_step_with_torchs():
    """Llama runs time their decode steps: each round's median step is paired with torch's round,
    apart from the summed request time (which the prefills dominate)."""
    def run(total, step):
        return {"request_ms": {"total": total}, "decode_step_ms": {"p50": step}}

    t = rm.round_times({
        "torch": [run(100.0, 50.0), run(120.0, 52.0), run(110.0, 48.0)],
        "arena": [run(99.0, 49.0), {"error": "boom"}, run(121.0, 49.5)],
        "bert_like": [{"request_ms": {"total": 90.0}}] * 3,
    })
    assert t["arena"]["decode_p50_ms"] == [49.0, None, 49.5]
    assert t["arena"]["decode_paired_vs_torch"] == pytest.approx([0.98, 49.5 / 48])
    assert t["arena"]["decode_paired_median_vs_torch"] == pytest.approx((0.98 + 49.5 / 48) / 2)
    assert t["bert_like"]["decode_p50_ms"] == [None] * 3 and t["bert_like"]["decode_paired_median_vs_torch"] is None
    res = _results()
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    res["round_times"] = {"bert": {"arena_expandable": t["arena"], "torch": t["torch"]}}
    md = rm.markdown(res)
    assert "Decode step over the rounds" in md
    row = next(l for l in md.splitlines() if l.startswith("| arena_expandable | 49.00, n/a, 49.50"))
    assert "| 0.980, 1.031 | 1.006x |" in row


def test_best_of_rounds_takes_each_requests_fastest_run():
    def run(*each):
        return {"request_ms": {"total": sum(each)}, "request_ms_each": list(each)}

    t = rm.round_times({
        "torch": [run(10.0, 20.0), run(12.0, 18.0)],      # best 10 + 18
        "arena": [run(9.0, 30.0), run(11.0, 19.0), {"error": "x"}],  # best 9 + 19
        "odd": [run(1.0), run(1.0, 2.0)],                 # different plans: no per-request best
    })
    assert t["torch"]["best_ms"] == 28.0 and t["arena"]["best_ms"] == 28.0
    assert t["arena"]["best_vs_torch"] == 1.0
    assert t["odd"]["best_ms"] is None and t["odd"]["best_vs_torch"] is None
    # Request by request, the median of the rounds: torch 11 + 19, arena 10 + 24.5 (the failed
    # round left out).
    assert t["torch"]["median_each_ms"] == 30.0 and t["arena"]["median_each_ms"] == 34.5
    assert t["arena"]["median_each_vs_torch"] == pytest.approx(1.15)
    assert t["torch"]["best_round_share"] == 0.5 and t["arena"]["best_round_share"] == 0.5
    cmp_ = {"arena": {"reserved_vs_torch_expandable": None, "ms_total_vs_torch": 1.5}}
    # The best of the rounds is within the target, the medians are not: not a verdict either way.
    assert rm.targets(cmp_, t)["arena"]["time"] == "unsettled"
    both = {"arena": {**t["arena"], "median_each_vs_torch": 1.01}}
    assert rm.targets(cmp_, both)["arena"]["time"] is True  # judged on the rounds, not round 1's 1.5x
    neither = {"arena": {**t["arena"], "best_vs_torch": 1.03}}
    assert rm.targets(cmp_, neither)["arena"]["time"] is False


def test_time_verdict_unsettled_when_one_quiet_round_holds_torchs_best():
    # On the H200 (8 rounds of BERT) one quiet round of torch's held 56 of its 60 fastest requests
    # and no round of poolkeeper's was as quiet: the best of the rounds said 1.069x, missed, while
    # every other figure said faster (request by request, the median of the rounds 0.971x; the
    # per-round ratios' median 0.935x). The best alone was the verdict.
    def run(*each):
        return {"request_ms": {"total": sum(each)}, "request_ms_each": list(each)}

    t = rm.round_times({
        "torch": [run(12.0, 12.0, 12.0), run(8.0, 8.0, 8.0), run(12.0, 12.0, 12.0)],  # round 2: quiet
        "arena": [run(10.0, 10.0, 10.0), run(11.0, 11.0, 11.0), run(9.0, 10.0, 11.0)],
    })
    assert t["torch"]["best_round_share"] == 1.0 and t["torch"]["best_ms"] == 24.0
    assert t["arena"]["best_round_share"] == 0.5  # request 2 ties between rounds 1 and 3
    assert t["arena"]["best_vs_torch"] == pytest.approx(29 / 24)      # "missed" on the best alone
    assert t["arena"]["median_each_vs_torch"] == pytest.approx(31 / 36)
    cmp_ = {"arena": {"reserved_vs_torch_expandable": 0.9, "ms_total_vs_torch": 30 / 36}}
    assert rm.targets(cmp_, t)["arena"] == {"reserved": True, "time": "unsettled"}
    res = _results()
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    res["round_times"] = {"bert": {"arena_expandable": t["arena"], "torch": t["torch"]}}
    md = rm.markdown(res)
    row = next(l for l in md.splitlines() if l.startswith("| arena_expandable | 30.00, 33.00, 30.00"))
    assert "| 50% | 31.00 | 0.861x |" in row
    assert "time unsettled (the two figures disagree)" in md


def test_targets_judge_time_on_the_rounds_when_there_are_several():
    cmp_ = rm.compare(_results()["runs"]["bert"])  # arena_expandable: 41/40 = 1.025x in round 1
    times = {"arena_expandable": {"paired_median_vs_torch": 1.01}}
    assert rm.targets(cmp_)["arena_expandable"]["time"] is False
    assert rm.targets(cmp_, times)["arena_expandable"]["time"] is True


def test_markdown_has_the_rounds_table():
    res = _results()
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    res["round_times"] = {"bert": rm.round_times({"torch": [res["runs"]["bert"]["torch"]] * 2,
                                                  "arena_expandable": [res["runs"]["bert"]["arena_expandable"]] * 2})}
    md = rm.markdown(res)
    assert "Time over 2 rounds" in md
    row = next(l for l in md.splitlines() if l.startswith("| arena_expandable | 41.00, 41.00"))
    assert "1.025x" in row


def test_round_times_leave_out_what_is_not_a_measured_round():
    # Found by hostile probing: a run that served no request read as a 0 ms round and passed the
    # time target; an arm with fewer requests than torch's was compared over them; NaN, inf and
    # malformed records gave order-dependent results or raised while a report was being written.
    def run(xs):
        return {"request_ms": rm.quantiles(xs), "request_ms_each": list(xs)}

    nan, inf = float("nan"), float("inf")
    t = rm.round_times({"torch": [run([10, 20])], "empty": [run([])], "short": [run([5])],
                        "odd": [run([nan]), {"request_ms": None}, {"request_ms": {"total": 1}, "request_ms_each": [None]}],
                        "inf": [run([inf])]})
    for arm in ("empty", "odd", "inf"):
        assert t[arm]["median_ms"] is None and t[arm]["best_ms"] is None, (arm, t[arm])
        assert t[arm]["paired_median_vs_torch"] is None and t[arm]["best_vs_torch"] is None
        assert rm.targets({"arena": {}}, {"arena": t[arm]})["arena"]["time"] is None
    assert t["short"]["best_ms"] == 5.0 and t["short"]["best_vs_torch"] is None  # 1 request against 2
    # NaN first or last: the same answer.
    a = rm.round_times({"torch": [run([1])] * 3, "arena": [run([nan]), run([5]), run([1])]})["arena"]
    b = rm.round_times({"torch": [run([1])] * 3, "arena": [run([1]), run([5]), run([nan])]})["arena"]
    assert a["median_ms"] == b["median_ms"] == 3.0 and a["best_ms"] == b["best_ms"] == 1.0


def test_rounds_below_one_are_refused():
    with pytest.raises(SystemExit):
        rm.main(["--rounds", "0", "--device", "cpu", "--arms", "torch", "--quick"])


def test_round_outputs_flag_a_round_whose_output_differs_from_torchs_same_round():
    # On the H200 the first round's table showed one arm's output differing at request 2 while the
    # later rounds were not recorded at all; every round's output now is.
    rr = {
        "torch": [{"request_sha256": ["a", "b", "c"], "output_sha256": "t1", "peak_reserved_bytes": 1 << 20},
                  {"request_sha256": ["a", "b", "c"], "output_sha256": "t1", "peak_reserved_bytes": 1 << 20}],
        "arena": [{"request_sha256": ["a", "x", "c"], "output_sha256": "a1", "peak_reserved_bytes": 2 << 20},
                  {"request_sha256": ["a", "b", "c"], "output_sha256": "t1", "peak_reserved_bytes": 3 << 20}],
    }
    lines = rm.round_outputs(rr, ["torch", "arena"])
    row = next(l for l in lines if l.startswith("| arena |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert "differs at [1]" in cells[1] and "2.0 MiB" in cells[1]
    assert "same" in cells[2] and "3.0 MiB" in cells[2]
    assert rm.round_outputs({"arena": [{"error": None}]}, ["arena"]) == []


def test_parse_cpus_takes_lists_and_ranges_and_refuses_the_rest():
    assert rm.parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert rm.parse_cpus("2, 2,1") == [1, 2]
    for bad in ("", "3-1", "-1", "a", "1-", "0-3;8"):
        with pytest.raises(ValueError):
            rm.parse_cpus(bad)


def test_bad_cpus_option_is_a_usage_error_not_a_traceback():
    with pytest.raises(SystemExit) as e:
        rm.main(["--cpus", "3-1", "--device", "cpu"])
    assert e.value.code == 2


def test_host_probe_is_a_positive_time():
    t = rm.host_probe_ms(reps=1)
    assert 0 < t < 60_000


def test_round_outputs_show_each_rounds_time_and_host_probe():
    rr = {"arena": [{"request_sha256": ["a"], "output_sha256": "x", "peak_reserved_bytes": 1 << 20,
                     "request_ms_each": [10.0, 5.0], "host_probe_ms": [12.25, 13.5]}]}
    row = next(l for l in rm.round_outputs(rr, ["arena"]) if l.startswith("| arena |"))
    assert "15.00 ms" in row and "host probe 12.2/13.5 ms" in row


def test_a_run_missing_requests_differs_from_torch_at_those_requests():
    # Found by hostile probing: zip stopped at the shorter list, so a run with fewer requests read
    # "same" in the per-round table and "no (request None)" in the main one.
    torch_run = {"request_sha256": ["a", "b", "c"], "output_sha256": "T"}
    short = {"request_sha256": ["a", "b"], "output_sha256": "A"}
    assert rm.differing_requests(short, torch_run) == [2]
    assert rm.differing_requests(torch_run, short) == [2]
    row = next(l for l in rm.round_outputs({"torch": [torch_run], "arena": [short]}, ["torch", "arena"])
               if l.startswith("| arena |"))
    assert "differs at [2]" in row
    ok = {"request_ms": {"p50": 1.0, "total": 2.0}, "peak_reserved_bytes": 1, "peak_live_bytes": 1}
    c = rm.compare({"torch": {**ok, **torch_run}, "arena": {**ok, **short}})["arena"]
    assert c["same_output_as_torch"] is False and c["first_differing_request"] == 2


def test_a_negative_request_time_is_not_a_measured_round():
    # Found by hostile probing: a -50 ms request made the best of the rounds -2x torch's, "met".
    run = lambda *e: {"request_ms": {"total": abs(sum(e))}, "request_ms_each": list(e)}  # noqa: E731
    t = rm.round_times({"torch": [run(10.0, 10.0)] * 2, "arena": [run(-50.0, 10.0), run(60.0, 10.0)]})
    assert t["arena"]["best_ms"] == 70.0
    assert rm.request_times({"request_ms_each": [1.0, -0.5]}) is None


@pytest.mark.parametrize("cpus", ["99999999999999999999", "0-99999999", "\u0661-\u0663", "\U0001d7d1", "4096"])
def test_cpus_out_of_range_or_not_ascii_is_a_usage_error(cpus, tmp_path):
    # Found by hostile probing: a huge number gave an OverflowError traceback, a huge range took
    # 10 GB and 37 s to build, and unicode digits were read as CPU numbers.
    with pytest.raises(ValueError):
        rm.parse_cpus(cpus)
    # --out in tmp_path: were the option accepted, the dry run would write there, not into the tree.
    r = subprocess.run([sys.executable, SCRIPT, "--cpus", cpus, "--device", "cpu", "--out", str(tmp_path / "rm")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--cpus" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_getaffinity")
def test_cpus_the_process_lacks_are_refused_not_dropped(tmp_path):
    # Found by hostile probing: the kernel kept the CPUs it had and dropped the rest without a word.
    have = sorted(os.sched_getaffinity(0))
    absent = max(have) + 1
    r = subprocess.run([sys.executable, SCRIPT, "--cpus", f"{have[0]},{absent}", "--device", "cpu",
                        "--out", str(tmp_path / "rm")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"[{absent}]" in r.stderr


def test_round_outputs_survive_odd_round_data():
    rr = {"torch": [{"request_sha256": ["a"], "request_ms_each": [None, 1.0], "host_probe_ms": [None, 3.0]}],
          "arena": [{"request_sha256": ["a"], "host_probe_ms": 12.5, "request_ms_each": ["x"]}, {"error": ""}]}
    lines = rm.round_outputs(rr, ["torch", "arena"])
    row = next(l for l in lines if l.startswith("| arena |"))
    assert "host probe n/a ms" in row and "n/a ms" in row and row.rstrip().endswith("failed |")


def _share_run(allocs, pairs, step_p50=50.0, unit="decode step"):
    return {"alloc_unit": unit, "allocations_per_unit": allocs, "decode_step_ms": {"p50": step_p50},
            "empty_drop_ns": {str(k): v for k, v in zip(rm.EMPTY_DROP_SIZES, pairs)}}


def test_allocator_share_prices_each_arms_calls_at_torchs_allocation_count():
    runs = {
        "torch": [_share_run(400, (1000, 1100, 1200)), _share_run(400, (1500, 1100, 1200), step_p50=60.0)],
        # The arena's fastest run of each size: 1100 / 1150 / 1300 (a disturbed run only adds time).
        "arena": [_share_run(410, (1100, 1400, 1300)), _share_run(402, (2000, 1150, 1900)), {"error": "boom"}],
    }
    s = rm.allocator_share(runs)
    assert s["torch"]["allocations"] == 400 and s["torch"]["extra_ms"] == 0.0
    assert s["arena"]["allocations"] == 406  # median of its own runs, shown beside torch's
    # Priced at the workload's count (torch's 400): 400 x mean(100, 50, 100) ns = 0.0333 ms per step,
    # over torch's median decode step (55 ms).
    assert s["arena"]["extra_ms"] == pytest.approx(400 * (250 / 3) / 1e6)
    assert s["arena"]["extra_share"] == pytest.approx(400 * (250 / 3) / 1e6 / 55.0)
    assert s["arena"]["pair_ns_by_size"][str(8 << 20)] == 1300
    md = "\n".join(rm.share_table(s))
    assert "per decode step" in md and "| arena | 406 | 1100 / 1150 / 1300 | +0.033 | +0.06% | n/a | n/a | n/a |" in md


def test_allocator_share_survives_missing_and_odd_figures():
    runs = {
        "torch": [{"request_ms": {"mean": 20.0}, "alloc_unit": "request", "allocations_per_unit": None,
                   "empty_drop_ns": {"16384": 900.0, "x": 5, "524288": -1, "8388608": float("nan")}}],
        "size_class": [{"request_ms": {"mean": 21.0}, "empty_drop_ns": "garbage", "allocations_per_unit": "many"}],
        "arena": [{"error": "exit 1"}],
    }
    s = rm.allocator_share(runs)
    assert s["torch"]["pair_ns_by_size"] == {"16384": 900.0} and s["torch"]["allocations"] is None
    assert s["torch"]["extra_ms"] is None  # no allocation count to price the pairs at
    assert s["size_class"]["pair_ns"] is None and s["arena"]["pair_ns"] is None
    row = next(l for l in rm.share_table(s) if l.startswith("| size_class |"))
    assert row == "| size_class | n/a | n/a | n/a | n/a | n/a | n/a | n/a |"
    assert rm.share_table(rm.allocator_share({"arena": [{"error": "x"}]})) == []


def test_markdown_has_the_allocator_share_table_for_rounds_and_for_one_run():
    res = _results()
    res["runs"]["bert"]["torch"].update(alloc_unit="request", allocations_per_unit=300,
                                        empty_drop_ns={"16384": 1000.0})
    res["runs"]["bert"]["arena_expandable"].update(alloc_unit="request", allocations_per_unit=300,
                                                   empty_drop_ns={"16384": 1200.0})
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    md = rm.markdown(res)
    assert "What the allocator can account for per request" in md
    assert next(l for l in md.splitlines() if l.startswith("| arena_expandable | 300 | 1200 |"))


def test_allocator_share_reports_the_time_inside_poolkeepers_calls_over_the_arms_own_step():
    runs = {"torch": [_share_run(400, (1000, 1000, 1000), step_p50=50.0)],
            "arena": [dict(_share_run(400, (1000, 1000, 1000), step_p50=40.0), allocator_ms_per_unit=0.2,
                           timing_overhead_ns=150.0),
                      dict(_share_run(400, (1000, 1000, 1000), step_p50=60.0), allocator_ms_per_unit=0.4),
                      dict(_share_run(400, (1000, 1000, 1000), step_p50=50.0), allocator_ms_per_unit=0.3)]}
    s = rm.allocator_share(runs)
    assert s["arena"]["inside_ms"] == pytest.approx(0.3) and s["arena"]["inside_share"] == pytest.approx(0.3 / 50.0)
    assert s["torch"]["inside_ms"] is None  # PyTorch's allocator has no such clock
    row = next(l for l in rm.share_table(s) if l.startswith("| arena |"))
    assert row.endswith("| 0.300 | 0.60% | 0.060 |")  # 400 pairs x 150 ns of clock reads
    assert s["arena"]["timing_ms"] == pytest.approx(0.06)


def test_per_unit_divides_the_counter_spans_by_the_units():
    a = lambda n, ns: {"allocations": n, "allocator_ns": ns}  # noqa: E731
    got = rm.per_unit([(a(0, 0), a(100, 2_000_000)), (a(100, 2_000_000), a(300, 3_000_000))], 10)
    assert got == {"allocations_per_unit": 30.0, "allocator_ms_per_unit": pytest.approx(0.3)}
    # A reading without the figure (PyTorch's allocator has no clock), or no units: None, not 0.
    assert rm.per_unit([(a(0, None), a(10, None))], 5) == {"allocations_per_unit": 2.0, "allocator_ms_per_unit": None}
    assert rm.per_unit([], 5)["allocations_per_unit"] is None and rm.per_unit([(a(0, 0), a(1, 1))], 0)["allocator_ms_per_unit"] is None


def test_rounds_keep_what_the_allocator_share_reads():
    # Found in review: the filter that keeps each round's run could drop these and every test passed.
    for key in ("alloc_unit", "allocations_per_unit", "allocator_ms_per_unit", "timing_overhead_ns", "empty_drop_ns",
                "decode_step_ms", "request_ms", "error"):
        assert key in rm.ROUND_RUN_KEYS
    res = _results()
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    run = dict(res["runs"]["bert"]["torch"], alloc_unit="request", allocations_per_unit=100, empty_drop_ns={"16384": 1000.0},
               unknown_key=1)
    res["round_runs"] = {"bert": {"torch": [{k: run[k] for k in rm.ROUND_RUN_KEYS if k in run}] * 2}}
    md = rm.markdown(res)
    assert "| torch | 100 | 1000 | +0.000 | n/a | n/a | n/a | n/a |" in md  # read from the rounds (runs lack it)


def test_allocator_share_takes_only_plain_size_keys():
    # Found in review: "²".isdigit() is True and int("²") raises; a key in other digits read as a size.
    run = {"request_ms": {"mean": 1.0}, "empty_drop_ns": {"²": 5.0, "١٦٣٨٤": 6.0, "0016384": 7.0, "9" * 5000: 8.0}}
    s = rm.allocator_share({"torch": [run], "arena": [{"decode_step_ms": "not a dict", "empty_drop_ns": {"16384": 2.0}}]})
    assert s["torch"]["pair_ns_by_size"] == {"16384": 7.0}
    assert s["arena"]["unit_ms"] is None
    assert rm.share_table(s)  # renders


def test_pool_counter_reads_call_timing_and_says_nothing_while_it_is_off(monkeypatch):
    from poolkeeper.integrations import torch as pkt

    state = {"enabled": True, "malloc_calls": 7, "malloc_ns": 100, "free_calls": 5, "free_ns": 50}
    monkeypatch.setattr(pkt, "call_timing", lambda enable=None: dict(state))
    count = rm.allocation_counter(None, "size_class", "cuda")
    assert count() == {"allocations": 7, "allocator_ns": 150}  # every pool kind, size_class included
    state["enabled"] = False
    assert count() == {"allocations": None, "allocator_ns": None}
    assert rm.allocation_counter(None, "arena", "cpu")() == {"allocations": None, "allocator_ns": None}


def test_log_dir_gives_each_poolkeeper_run_its_own_log_and_none_to_torch(tmp_path, monkeypatch):
    calls = []

    def fake_run(arm, wl, args, tmp, log_file=None):
        calls.append((arm, wl, log_file))
        return {"request_ms": {"p50": 1.0, "total": 1.0, "n": 1}, "request_ms_each": [1.0], "process_s": 0.0}

    monkeypatch.setattr(rm, "run_arm_process", fake_run)
    logs = tmp_path / "logs"
    assert rm.main(["--device", "cpu", "--arms", "torch,arena", "--workloads", "bert", "--rounds", "2",
                    "--log-dir", str(logs), "--out", str(tmp_path / "out")]) == 0
    assert logs.is_dir()
    got = {(arm, log) for arm, _, log in calls}
    assert got == {("torch", None), ("arena", str(logs / "bert_arena_round1.csv")),
                   ("arena", str(logs / "bert_arena_round2.csv"))}


def test_the_child_is_told_its_log_file(tmp_path, monkeypatch):
    seen = []

    class Done:
        returncode = 0

    monkeypatch.setattr(rm.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    args = rm.argparse.Namespace(seed=1, device="cpu", quick=True, timeout=5.0)
    rm.run_arm_process("arena", "bert", args, str(tmp_path), "/logs/bert_arena_round1.csv")
    rm.run_arm_process("torch", "bert", args, str(tmp_path))
    assert seen[0][seen[0].index("--log-file") + 1] == "/logs/bert_arena_round1.csv"
    assert "--log-file" not in seen[1]


def test_a_log_dir_that_cannot_be_made_is_a_usage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        rm.main(["--device", "cpu", "--arms", "torch", "--log-dir", str(blocker / "sub"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2


def test_markdown_names_the_allocation_logs():
    res = _results()
    res["runs"]["bert"]["arena_expandable"].update(log_path="/x/logs/bert_arena_expandable_round1.csv", log_events=1234)
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    md = rm.markdown(res)
    assert "`bert_arena_expandable_round1.csv` (1234 events)" in md
    assert "log_path" in rm.ROUND_RUN_KEYS and "log_events" in rm.ROUND_RUN_KEYS


def test_a_log_dir_holding_this_runs_logs_or_empty_is_refused(tmp_path, monkeypatch):
    # Found by hostile probing: a LoggingPool truncates its file, so a second invocation into the
    # same folder lost the first one's logs; an empty --log-dir silently logged nothing.
    monkeypatch.setattr(rm, "run_arm_process", lambda *a, **k: pytest.fail("must not run"))
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "bert_arena_round2.csv").write_text("x")
    for bad in (str(logs), ""):
        with pytest.raises(SystemExit) as e:
            rm.main(["--device", "cpu", "--arms", "torch,arena", "--workloads", "bert", "--rounds", "2",
                     "--log-dir", bad, "--out", str(tmp_path / "o")])
        assert e.value.code == 2
    assert (logs / "bert_arena_round2.csv").read_text() == "x"


def test_an_arm_named_twice_runs_once():
    # Found by hostile probing: "--arms arena,arena" ran the arm twice a round into one log file.
    assert rm._parse_list("arena, arena,torch,arena", rm.ALL_ARMS, "arm") == ["arena", "torch"]


def test_odd_results_do_not_stop_the_report():
    # Found by hostile probing: each of these raised.
    assert rm.ratio(10**400, 1) is None and rm.fmt_ms(10**400) == "n/a"
    assert rm.allocator_share({"arena": 5, "torch": None})["arena"]["pair_ns"] is None
    assert rm.share_table({"arena": {"unit": 7, "pair_ns": 1.0, "pair_ns_by_size": {"16384": 1.0}}})
    for rr in ({"torch": None}, {"torch": "x"}, [1]):
        res = _results()
        res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
        res["round_runs"] = {"bert": rr}
        assert rm.markdown(res)
    res = _results()
    res["runs"]["bert"]["arena_expandable"].update(log_path="/x/a|b\nc.csv", empty_drop_ns={"16384": 1.0})
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    assert "`a_b_c.csv`" in rm.markdown(res)


def test_deterministic_reaches_every_arms_process(tmp_path, monkeypatch):
    """--deterministic must reach the child (where torch runs), else the outputs it is meant to
    settle would be compared without it."""
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(rm.subprocess, "run", fake_run)
    for flag in ([], ["--deterministic"]):
        args = rm.argparse.Namespace(seed=1, device="cpu", quick=True, timeout=5.0,
                                     deterministic=bool(flag))
        rm.run_arm_process("torch", "bert", args, str(tmp_path))
        assert ("--deterministic" in seen[-1]) == bool(flag)


def _rmm_log(path, base, events):
    rows = ["Thread,Time,Action,Pointer,Size,Stream"]
    for i, (action, off, size) in enumerate(events):
        rows.append(f"1,00:00:{i:02d}.000000,{action},{base + off:x},{size},0")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_same_layouts_compares_calls_and_addresses_relative_to_each_logs_base(tmp_path):
    ev = [("allocate", 0, 4096), ("allocate", 4096, 512), ("free", 0, 4096), ("allocate", 0, 1024)]
    a = _rmm_log(tmp_path / "a.csv", 0x7F0000000000, ev)
    b = _rmm_log(tmp_path / "b.csv", 0x300000000, ev)  # another base: the same layout
    c = _rmm_log(tmp_path / "c.csv", 0x300000000, ev[:3] + [("allocate", 8192, 1024)])  # moved
    assert rm.same_layouts([a, b]) == {"same": True, "events": [4, 4], "first_difference": None}
    assert rm.same_layouts([a, b, c]) == {"same": False, "events": [4, 4, 4], "first_difference": 3}
    d = _rmm_log(tmp_path / "d.csv", 0x300000000, ev[:2])
    assert rm.same_layouts([a, d])["first_difference"] == 2  # a log that stops early differs there


def test_render_prints_a_saved_runs_markdown_with_the_round_figures_recomputed(tmp_path, capsys):
    def run(*each):
        return {"request_ms": {"total": sum(each)}, "request_ms_each": list(each)}

    res = _results()
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    # What an earlier version saved: round runs, and round times without the newer figures.
    res["round_runs"] = {"bert": {"torch": [run(12.0, 12.0), run(8.0, 8.0)],
                                  "arena_expandable": [run(10.0, 10.0), run(11.0, 9.0)]}}
    res["round_times"] = {"bert": {"torch": {"total_ms": [24.0, 16.0]}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(res))
    assert rm.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Time over 2 rounds" in out and "most fastest requests in one round" in out
    row = next(l for l in out.splitlines() if l.startswith("| arena_expandable | 20.00, 20.00"))
    assert row.endswith("| 50% | 20.00 | 1.000x |")  # medians: 10 + 10 against torch's 10 + 10
    with pytest.raises(SystemExit):
        rm.main(["--render", str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(SystemExit):
        rm.main(["--render", str(tmp_path / "bad.json")])


def test_round_share_splits_ties_and_one_round_cannot_settle_the_median():
    def run(*each):
        return {"request_ms": {"total": sum(each)}, "request_ms_each": list(each)}

    t = rm.round_times({"torch": [run(5.0, 5.0, 5.0)] * 3, "arena": [run(4.0, 6.0, 4.0)] * 3})
    # Every round is as fast as the others: no round holds more than its third of the requests.
    assert t["torch"]["best_round_share"] == pytest.approx(1 / 3)
    assert t["arena"]["median_each_vs_torch"] == pytest.approx(14 / 15)
    # One usable round on a side: its best and its median are that round, so there is no second
    # figure; the verdict is the best, as before several-round figures existed.
    one = rm.round_times({"torch": [run(5.0, 5.0), {"error": "x"}], "arena": [run(6.0, 6.0), run(4.0, 4.0)]})
    assert one["arena"]["median_each_vs_torch"] is None and one["arena"]["best_vs_torch"] == pytest.approx(0.8)
    cmp_ = {"arena": {"reserved_vs_torch_expandable": None, "ms_total_vs_torch": 1.2}}
    assert rm.targets(cmp_, one)["arena"]["time"] is True


def test_render_reads_what_earlier_versions_saved(tmp_path, capsys):
    # Found by review: one earlier version saved every round run with "error": None and no
    # request_ms (each read as a failed round: every cell "failed", time n/a); another saved round
    # times without round runs (the rounds table vanished and round 1 alone made the verdict).
    res = _results()
    res["comparison"] = {"bert": rm.compare(res["runs"]["bert"])}
    keys = rm.ROUND_RUN_KEYS
    old = lambda each: {k: ({"request_ms_each": each}.get(k)) for k in keys if k != "request_ms"}  # noqa: E731
    res["round_runs"] = {"bert": {"torch": [old([12.0, 12.0]), old([8.0, 8.0])],
                                  "arena_expandable": [old([10.0, 10.0]), old([11.0, 9.0])]}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(res))
    assert rm.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("| arena_expandable | 20.00, 20.00"))
    assert "failed" not in row and row.endswith("| 50% | 20.00 | 1.000x |")
    assert "arena_expandable: reserved met, time unsettled" in out  # best 19 vs 16, medians 20 vs 20

    saved_times = rm.round_times({"torch": [old([12.0])] * 2, "arena_expandable": [old([1.0])] * 2})
    del res["round_runs"]
    res["round_times"] = {"bert": {a: {**v, "total_ms": [7.0, 7.0]} for a, v in saved_times.items()}}
    path.write_text(json.dumps(res))
    assert rm.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Time over 2 rounds" in out and "| arena_expandable | 7.00, 7.00" in out


def test_request_excess_sets_each_requests_time_beyond_torch_beside_its_driver_calls():
    """The arm's process runs 10% slower than torch's throughout (its median ratio over the requests
    without calls); two requests made driver calls and took 5 and 10 ms more than that: 15 ms over
    300 calls, 50 us a call."""
    def calls(aliases=0, allocs=0, ns=0):
        return {"upstream_allocations": allocs, "upstream_deallocations": 0, "alias_calls": aliases,
                "unalias_calls": 0, "allocator_ns": ns}

    torch_t = [10.0] * 6
    arena_t = [11.0, 11.0, 16.0, 11.0, 21.0, 11.0]
    runs = {
        "torch": {"request_ms": {"total": sum(torch_t)}, "request_ms_each": torch_t},
        "arena_expandable": {"request_ms": {"total": sum(arena_t)}, "request_ms_each": arena_t,
                             "request_calls_each": [calls(), calls(), calls(100, 0, 4_000_000), calls(),
                                                    calls(150, 50, 8_000_000), calls()]},
        "arena": {"request_ms": {"total": 60.0}, "request_ms_each": [10.0] * 6},  # no per-request calls: left out
    }
    ex = rm.request_excess(runs)
    assert set(ex) == {"arena_expandable"}
    e = ex["arena_expandable"]
    assert e["median_ratio"] == pytest.approx(1.1)
    assert e["requests"] == 6 and e["requests_with_calls"] == 2
    assert e["calls"] == {"upstream_allocations": 50, "upstream_deallocations": 0, "alias_calls": 250, "unalias_calls": 0}
    assert e["excess_with_calls_ms"] == pytest.approx(15.0) and e["ms_per_call"] == pytest.approx(0.05)
    assert e["mean_excess_with_calls_ms"] == pytest.approx(7.5)
    assert e["mean_excess_without_calls_ms"] == pytest.approx(0.0, abs=1e-9)
    assert e["allocator_ms_with_calls"] == pytest.approx(12.0)
    assert [row["request"] for row in e["top"][:2]] == [4, 2]
    md = "\n".join(rm.excess_table(ex))
    assert "| arena_expandable | 1.100 | 2 of 6 | 50 / 0 / 250 / 0 | +15.0 | 50 | +7.50 | 12.0 | +0.00 |" in md
    assert "request 4 (+10.0 ms, 200 calls), 2 (+5.0 ms, 100 calls)" in md
    # A run whose calls do not line up with its requests, or no torch run: nothing to say.
    assert rm.request_excess({"torch": runs["torch"], "arena_expandable": {**runs["arena_expandable"], "request_calls_each": []}}) == {}
    assert rm.request_excess({"arena_expandable": runs["arena_expandable"]}) == {}
    assert rm.excess_table({}) == []
    # Saved before the runs were counted: no line about them.
    assert e["runs"] is None and "runs (one driver call" not in md


def test_request_excess_says_what_runs_the_unmaps_and_unaliases_went_in():
    """775 unaliases in 8 runs (one cuMemUnmap each where the driver takes runs), summed over every
    request; a request without the run counts (an older save) leaves them unsaid."""
    def calls(unaliases, runs_):
        return {"upstream_allocations": 0, "upstream_deallocations": 0, "alias_calls": 0, "unalias_calls": unaliases,
                "unmap_runs": 0, "unalias_runs": runs_}

    runs = {"torch": {"request_ms_each": [10.0] * 3, "request_ms": {"total": 30.0}},
            "arena_expandable": {"request_ms_each": [10.0, 10.0, 12.0], "request_ms": {"total": 32.0},
                                 "request_calls_each": [calls(0, 0), calls(0, 0), calls(775, 8)]}}
    e = rm.request_excess(runs)["arena_expandable"]
    assert e["runs"] == {"unmap_runs": 0, "unalias_runs": 8} and e["calls"]["unalias_calls"] == 775
    assert "arena_expandable: its unmaps and unaliases went in 0 / 8 runs" in "\n".join(rm.excess_table({"arena_expandable": e}))
    del runs["arena_expandable"]["request_calls_each"][0]["unalias_runs"]
    assert rm.request_excess(runs)["arena_expandable"]["runs"] is None


def test_regression_request_excess_baseline_leaves_out_the_requests_that_made_calls():
    """A review: with the median ratio taken over every request, four requests of five that made
    calls became "the process's own speed" and their calls cost nothing."""
    one = {"upstream_allocations": 1, "upstream_deallocations": 0, "alias_calls": 0, "unalias_calls": 0}
    none = {**one, "upstream_allocations": 0}
    e = rm.request_excess({"torch": {"request_ms_each": [10.0] * 5, "request_ms": {"total": 50.0}},
                           "arena_expandable": {"request_ms_each": [10.0, 12, 12, 12, 12], "request_ms": {"total": 58.0},
                                                "request_calls_each": [none] + [one] * 4}})["arena_expandable"]
    assert e["median_ratio"] == 1.0 and e["excess_with_calls_ms"] == pytest.approx(8.0) and e["ms_per_call"] == pytest.approx(2.0)


@pytest.mark.parametrize("bad", ["many", float("nan"), [1], float("inf"), 1e308, -1, 2.7, True, None])
def test_regression_request_excess_leaves_out_a_request_whose_counts_cannot_be_read(bad):
    """A review: one bad count in a saved run (a string, NaN, inf, a list, 1e308...) stopped the
    whole report with ValueError / OverflowError; now that request is left out."""
    good = {"upstream_allocations": 0, "upstream_deallocations": 0, "alias_calls": 3, "unalias_calls": 0,
            "allocator_ns": 10**400}
    runs = {"torch": {"request_ms_each": [10.0] * 3, "request_ms": {"total": 30.0}},
            "arena_expandable": {"request_ms_each": [10.0, 11.0, 10.0], "request_ms": {"total": 31.0},
                                 "request_calls_each": [{**good, "alias_calls": 0}, {**good, "upstream_allocations": bad}, good]}}
    e = rm.request_excess(runs)["arena_expandable"]
    assert e["requests"] == 2 and e["requests_with_calls"] == 1 and e["calls"]["alias_calls"] == 3
    assert e["allocator_ms_with_calls"] is None  # 10**400 ns is not a count either
    assert "| arena_expandable | 1.000 | 1 of 2 |" in "\n".join(rm.excess_table(rm.request_excess(runs)))


def test_recurring_excess_names_the_requests_slow_in_more_than_one_round_beside_chance():
    def run(*each):
        return {"request_ms": {"total": sum(each)}, "request_ms_each": list(each)}

    flat = [10.0] * 8
    slow = lambda *hot: run(*[10.0 + (5.0 if i in hot else 0.0) + 0.1 * i for i in range(8)])  # noqa: E731
    rounds = {"torch": [run(*flat)] * 3,
              "arena_expandable": [slow(6, 2), slow(6, 3), slow(6, 2)],
              "arena": [slow(1)]}  # one round: nothing to say
    rec = rm.recurring_excess(rounds, top=2)
    assert rec == {"arena_expandable": {"requests": {6: 3, 2: 2}, "rounds": 3, "top": 2, "n": 8}}
    md = "\n".join(rm.excess_table({}, rec))
    assert "in more than one of 3 rounds, arena_expandable: 6 (3 rounds), 2 (2 rounds) (by chance about 1.2 requests would be)" in md
    assert rm.recurring_excess(rounds)["arena_expandable"]["requests"] == {6: 3}  # 8 requests: the largest one
    # 60 requests, the largest 5 of 3 rounds: about 1.2 repeat by chance.
    assert rm.chance_repeats(60, 5, 3) == pytest.approx(1.18, abs=0.01)
    assert rm.chance_repeats(60, 5, 1) == 0.0


def test_round_decode_steps_leave_out_the_rounds_the_time_table_does():
    """A review: a round whose request times were not numbers was "failed" in the time table but
    paired in the decode-step one."""
    ok = lambda p50, each=(10.0,): {"request_ms": {"total": sum(each), "n": len(each)},  # noqa: E731
                                    "request_ms_each": list(each), "decode_step_ms": {"p50": p50}}
    t = rm.round_times({"torch": [ok(5.0), ok(5.0)], "arena": [ok(6.0, each=(-1.0,)), ok(5.0, each=(float("nan"),))]})
    assert t["arena"]["total_ms"] == [None, None]
    assert t["arena"]["decode_p50_ms"] == [None, None] and t["arena"]["decode_paired_median_vs_torch"] is None


# --together: every arm at once, each on its own CPUs, each request started together ---------------


def test_cpu_slices_give_each_arm_its_own_cpus_and_rotate_them_over_the_rounds():
    cpus = list(range(7))
    r0 = rm.cpu_slices(cpus, 3, 0)
    assert r0 == [[0, 1], [2, 3], [4, 5]]  # the remainder (6) unused: every arm gets as many
    assert rm.cpu_slices(cpus, 3, 1) == [[2, 3], [4, 5], [0, 1]]
    seen = {i: {tuple(rm.cpu_slices(cpus, 3, r)[i]) for r in range(3)} for i in range(3)}
    assert all(len(s) == 3 for s in seen.values())  # over the rounds every arm ran on every slice
    with pytest.raises(ValueError):
        rm.cpu_slices([0], 2, 0)


def test_request_barrier_holds_each_arm_until_every_arm_arrives(tmp_path):
    import threading
    import time

    arrived = {}

    def arm(i, delay):
        time.sleep(delay)
        arrived[i] = time.monotonic()
        b = rm.RequestBarrier(str(tmp_path), 2, i, timeout=30)
        b.meet("request0")
        arrived[f"left{i}"] = time.monotonic()
        arrived[f"broken{i}"] = b.broken

    ts = [threading.Thread(target=arm, args=(0, 0.0)), threading.Thread(target=arm, args=(1, 0.3))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert arrived["left0"] >= arrived[1]  # the early arm waited for the late one
    assert not arrived["broken0"] and not arrived["broken1"]


def test_request_barrier_stops_waiting_for_a_failed_or_late_peer(tmp_path):
    import time

    (tmp_path / "a").mkdir()
    b = rm.RequestBarrier(str(tmp_path / "a"), 2, 0, timeout=0.05)
    t0 = time.monotonic()
    b.meet("request0")  # the peer never comes
    assert b.broken and b.timeouts == 1 and b.broken_at == "request0"
    b.meet("request1")  # broken: no second wait
    assert b.timeouts == 1 and time.monotonic() - t0 < 5
    late = rm.RequestBarrier(str(tmp_path / "a"), 2, 1, timeout=60)
    t0 = time.monotonic()
    late.meet("request0")  # the arm that waited left: the late one does not wait its turn
    late.meet("request1")
    assert late.broken and late.timeouts == 0 and time.monotonic() - t0 < 5
    (tmp_path / "b").mkdir()
    rm.RequestBarrier(str(tmp_path / "b"), 2, 1).leave()  # the peer failed
    b = rm.RequestBarrier(str(tmp_path / "b"), 2, 0, timeout=60)
    t0 = time.monotonic()
    b.meet("request0")
    assert b.broken and b.timeouts == 0 and time.monotonic() - t0 < 5


def test_together_runs_every_arm_at_once_each_on_its_own_cpus(tmp_path, monkeypatch):
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs and sched_getaffinity")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    child = ("import json, os, sys, time\n"
             "sys.path.insert(0, {here!r})\n"
             "from benchmark_scripts import load_script\n"
             "rm = load_script('real_models.py')\n"
             "path, folder, n, i = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])\n"
             "b = rm.RequestBarrier(folder, n, i, timeout=60)\n"
             "time.sleep(0.5 * i)\n"  # the second arm starts late: the barrier lines them up
             "b.meet('request0')\n"
             "t = time.time()\n"
             "json.dump({{'request_ms': {{'p50': 1.0, 'total': 1.0, 'n': 1}}, 'request_ms_each': [1.0], 'met': t,\n"
             "           'cpus': sorted(os.sched_getaffinity(0)), 'omp': os.environ.get('OMP_NUM_THREADS')}},\n"
             "          open(path, 'w'))\n").format(here=os.path.dirname(os.path.abspath(__file__)))

    def fake_command(arm, workload, args, path, log_file=None, barrier=None):
        return [sys.executable, "-c", child, path, barrier[0], str(barrier[1]), str(barrier[2])]

    monkeypatch.setattr(rm, "arm_command", fake_command)
    args = rm.argparse.Namespace(seed=1, device="cpu", quick=True, timeout=60.0)
    out = rm.run_arms_together(["torch", "arena"], "bert", args, str(tmp_path), 1, cpus)
    assert out["torch"]["cpus"] == [cpus[1]] and out["arena"]["cpus"] == [cpus[0]]  # round 2: rotated
    assert out["torch"]["omp"] == out["arena"]["omp"] == "1"
    assert abs(out["torch"]["met"] - out["arena"]["met"]) < 0.3  # both left the barrier together
    assert out["torch"]["together"] == {"arms": 2, "round": 2}


def test_together_reaches_the_rounds_and_the_report(tmp_path, monkeypatch):
    seen = []

    def fake_together(arms, wl, args, tmp, rnd, cpus, log_files=None):
        seen.append((tuple(arms), rnd, tuple(cpus)))
        return {a: {"request_ms": {"p50": 1.0 + (a != "torch"), "total": 1.0 + (a != "torch"), "n": 1},
                    "request_ms_each": [1.0 + (a != "torch")], "request_sha256": ["ab"], "output_sha256": "ab",
                    "process_s": 0.0, "barrier_timeouts": int(a == "arena" and rnd == 1),
                    "barrier_broken_at": "request0" if a == "arena" and rnd == 1 else None} for a in arms}

    monkeypatch.setattr(rm, "run_arms_together", fake_together)
    monkeypatch.setattr(rm, "run_arm_process", lambda *a, **k: pytest.fail("--together runs no arm alone"))
    monkeypatch.setattr(rm.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert rm.main(["--device", "cpu", "--arms", "torch,arena", "--workloads", "bert", "--rounds", "2", "--together",
                    "--out", str(tmp_path / "out")]) == 0
    assert [r for _, r, _ in seen] == [0, 1] and all(c == (0, 1, 2, 3) for _, _, c in seen)
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["together"] is True
    assert saved["round_times"]["bert"]["arena"]["paired_vs_torch"] == [2.0, 2.0]
    md = (tmp_path / "out.md").read_text()
    assert "every arm at once in each round" in md
    assert "unpaired from its request0 on" in md  # round 2's arena run


def test_together_with_more_arms_than_cpus_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(rm.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    with pytest.raises(SystemExit) as e:
        rm.main(["--device", "cpu", "--arms", "torch,arena", "--together", "--out", str(tmp_path / "o")])
    assert e.value.code == 2


def test_together_an_arm_that_cannot_start_is_reported_and_its_peers_do_not_wait(tmp_path, monkeypatch):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs sched_getaffinity")
    cpus = sorted(os.sched_getaffinity(0))[:1] * 2  # two slices of one CPU
    child = ("import json, sys, time\n"
             "sys.path.insert(0, {here!r})\n"
             "from benchmark_scripts import load_script\n"
             "rm = load_script('real_models.py')\n"
             "b = rm.RequestBarrier(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), timeout=60)\n"
             "t = time.monotonic(); b.meet('request0')\n"
             "json.dump({{'waited': time.monotonic() - t, 'broken': b.broken}}, open(sys.argv[1], 'w'))\n"
             ).format(here=os.path.dirname(os.path.abspath(__file__)))

    def fake_command(arm, workload, args, path, log_file=None, barrier=None):
        if arm == "arena":
            return ["/nonexistent/python-for-this-test"]
        return [sys.executable, "-c", child, path, barrier[0], str(barrier[1]), str(barrier[2])]

    monkeypatch.setattr(rm, "arm_command", fake_command)
    args = rm.argparse.Namespace(seed=1, device="cpu", quick=True, timeout=60.0)
    out = rm.run_arms_together(["torch", "arena"], "bert", args, str(tmp_path), 0, cpus)
    assert "could not start" in out["arena"]["error"]
    assert out["torch"]["broken"] and out["torch"]["waited"] < 30
    assert list(out) == ["torch", "arena"]


def test_paired_each_without_a_draw_gives_no_interval():
    torch = [_each_run([10, 10])]
    arena = [_each_run([20, 20])]
    a = rm.paired_each({"torch": torch, "arena": arena}, resamples=0)["arena"]
    assert a["gm"] == pytest.approx(2.0) and a["lo"] is None and a["hi"] is None
