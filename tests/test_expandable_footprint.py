"""ArenaPool(expandable=True) footprint with its default options: growth steps capped at 8 MiB, and
the peak reserved / peak live it reaches on the committed PyTorch traces and the bench's
random_lifetime workload (simulated device: byte counts are exact and deterministic).

The bounds are the ratios of benchmarks/results/expandable_peak.txt with a little room; with the
earlier 64 MiB cap the BERT replay read 1.209x and random_lifetime 1.246x.
"""
from __future__ import annotations

import os

import pytest

import poolkeeper as pk
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay_engine import replay
from poolkeeper.bench.workloads import WORKLOADS, RunContext

MiB = 1 << 20
TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "traces")


def test_default_growth_step_is_capped_at_8_mib():
    up = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(up, expandable=True, thread_cache_bytes=0)
    ptrs = [pool.allocate(MiB) for _ in range(400)]
    # Past 128 MiB mapped, mapped x step_fraction (1/16) exceeds 8 MiB: every later step is 8 MiB.
    st = pool.stats()
    steps = []
    for _ in range(40):
        before = (st["map_calls"], st["mapped_bytes"])
        ptrs.append(pool.allocate(MiB))
        st = pool.stats()
        if st["map_calls"] != before[0]:
            assert st["map_calls"] == before[0] + 1
            steps.append(st["mapped_bytes"] - before[1])
    assert st["mapped_bytes"] > 400 * MiB
    assert steps and all(s == 8 * MiB for s in steps), steps
    # A request larger than the cap still maps what it lacks in one step.
    maps = st["map_calls"]
    big = pool.allocate(100 * MiB)
    assert pool.stats()["map_calls"] == maps + 1
    pool.deallocate(big)
    for p in ptrs:
        pool.deallocate(p)
    pool.validate()
    pool.close()


@pytest.mark.parametrize("trace,bound,max_maps", [
    ("torch_bert_serve.pickle.gz", 1.16, 80),
    ("torch_gpt2_generate.pickle.gz", 1.03, 80),  # guard: 1.027x before and after
])
def test_replayed_trace_peak_reserved_over_peak_live_with_default_options(trace, bound, max_maps):
    up = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(up, expandable=True)
    r = replay(read_log(os.path.join(TRACES, trace)), pool, up, include_pre_trace=True)
    pool.validate()
    assert r["peak_reserved_bytes"] <= bound * r["peak_live_bytes"], r["peak_reserved_bytes"] / r["peak_live_bytes"]
    # Not bought with a map per step: tens of maps over tens of thousands of events.
    assert up.counters()["maps"] <= max_maps
    pool.close()


def test_random_lifetime_peak_reserved_over_peak_live_with_default_options():
    up = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(up, expandable=True)
    m = WORKLOADS["random_lifetime"].run(pool, {"steps": 4000, "seed": 0, "probe_bytes": 64 * MiB},
                                         RunContext("arena_expandable", "simulated", "quick", up))
    pool.validate()
    assert m.peak_reserved_bytes <= 1.15 * m.peak_live_bytes, m.peak_reserved_bytes / m.peak_live_bytes
    assert up.counters()["maps"] <= 40
    pool.close()
