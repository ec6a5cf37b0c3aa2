"""Which ArenaPool policy moves peak reserved / peak live and the upstream call count?

Runs, on ArenaPool over an instant simulated upstream (latency 0: only counts and bytes are
reported, and those carry no timing noise):

- the bench's ``random_lifetime`` (the sequence PyTorch was measured on, 4,000 steps) and ``kv_cache`` (quick and
  full parameters) workloads,
- the two PyTorch traces in ``benchmarks/traces`` (replayed like ``poolkeeper replay
  --include-pre-trace``),

varying one option at a time from the defaults, plus one policy the pool does not have, emulated
from Python: ``trim_before_grow`` calls ``trim()`` before any request larger than the pool's
largest free block, i.e. wholly free backings go back upstream before a new one is taken.
Then it prints, for random_lifetime and the BERT trace, every upstream allocation with the pool's
free bytes and largest free block just before it: growth while plenty is free is fragmentation.

    PYTHONPATH=<built poolkeeper> python3 benchmarks/arena_policy_sweep.py > benchmarks/results/arena_policy_sweep.txt
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Tuple

import poolkeeper as pk
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay_engine import replay
from poolkeeper.bench.workloads import WORKLOADS, RunContext, Selection

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
TRACES = [os.path.join(HERE, "traces", n) for n in ("torch_gpt2_generate.pickle.gz", "torch_bert_serve.pickle.gz")]
VARIANTS: List[Tuple[str, Dict[str, Any], bool]] = [
    ("defaults", {}, False),
    ("max_backing=16MiB", {"max_backing": 16 * MiB}, False),
    ("max_backing=64MiB", {"max_backing": 64 * MiB}, False),
    ("max_backing=128MiB", {"max_backing": 128 * MiB}, False),
    ("max_backing=256MiB", {"max_backing": 256 * MiB}, False),
    ("thread_cache_bytes=0", {"thread_cache_bytes": 0}, False),
    ("shrink_interval=0", {"shrink_interval": 0}, False),
    ("shrink_hysteresis=8", {"shrink_hysteresis": 8}, False),
    ("oversize>cap/2", {"oversize_threshold": 16 * MiB}, False),
    ("oversize>cap/4", {"oversize_threshold": 8 * MiB}, False),
    ("128MiB,oversize>32MiB", {"max_backing": 128 * MiB, "oversize_threshold": 32 * MiB}, False),
    ("128MiB,oversize>16MiB", {"max_backing": 128 * MiB, "oversize_threshold": 16 * MiB}, False),
    ("64MiB,oversize>16MiB", {"max_backing": 64 * MiB, "oversize_threshold": 16 * MiB}, False),
    ("128MiB,ovs>32MiB,g1.5", {"max_backing": 128 * MiB, "oversize_threshold": 32 * MiB, "growth_factor": 1.5}, False),
    ("64MiB,ovs>32MiB,g1.5", {"max_backing": 64 * MiB, "oversize_threshold": 32 * MiB, "growth_factor": 1.5}, False),
    ("128MiB,g1.5", {"max_backing": 128 * MiB, "growth_factor": 1.5}, False),
    ("256MiB,ovs>32MiB,g1.5", {"max_backing": 256 * MiB, "oversize_threshold": 32 * MiB, "growth_factor": 1.5}, False),
    ("trim_before_grow", {}, True),
    ("trim_before_grow+256MiB", {"max_backing": 256 * MiB}, True),
]


class TrimBeforeGrow:
    """An ArenaPool that gives wholly free backings back before a request that cannot fit."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def allocate(self, nbytes: int, stream: Any = None) -> int:
        if nbytes > self.pool.stats()["largest_free_block"]:
            self.pool.trim()
        return self.pool.allocate(nbytes, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def run_workload(name: str, scale: str, pool: Any, up: Any) -> Tuple[int, int, int]:
    w = WORKLOADS[name]
    params = w.params(Selection(scale=scale))[0]
    m = w.run(pool, dict(params), RunContext("arena", "simulated", scale, up))
    st = pool.stats()
    live = m.peak_live_bytes if m.peak_live_bytes is not None else st["peak_live_bytes"]
    res = m.peak_reserved_bytes if m.peak_reserved_bytes is not None else st["peak_reserved_bytes"]
    allocs = up.counters()["allocations"] - m.extras.get("probe_upstream_allocations", 0)
    return live, res, allocs


def run_trace(path: str) -> Callable[[Any, Any], Tuple[int, int, int]]:
    trace = read_log(path)

    def go(pool: Any, up: Any) -> Tuple[int, int, int]:
        # The replay `poolkeeper replay --include-pre-trace` runs: blocks held from before the
        # trace first, then every logged allocation and free.
        r = replay(trace, pool, up, include_pre_trace=True)
        return r["peak_live_bytes"], r["peak_reserved_bytes"], r["upstream_allocations"]

    return go


def sweep() -> None:
    cases: List[Tuple[str, Callable[[Any, Any], Tuple[int, int, int]]]] = [
        ("random_lifetime quick", lambda p, u: run_workload("random_lifetime", "quick", p, u)),
        ("kv_cache quick", lambda p, u: run_workload("kv_cache", "quick", p, u)),
        ("kv_cache full", lambda p, u: run_workload("kv_cache", "full", p, u)),
    ] + [(os.path.basename(t).split(".")[0], run_trace(t)) for t in TRACES]
    print(f"{'case':22s} {'variant':24s} {'peak live MiB':>13s} {'peak reserved MiB':>17s} {'ratio':>6s} "
          f"{'upstream allocs':>15s} {'upstream frees':>14s}")
    for case, fn in cases:
        for label, opts, tbg in VARIANTS:
            up = pk.upstream.Simulated(latency_us=0)
            pool = pk.ArenaPool(up, **opts)
            live, res, allocs = fn(TrimBeforeGrow(pool) if tbg else pool, up)
            print(f"{case:22s} {label:24s} {live / MiB:13.1f} {res / MiB:17.1f} {res / live:6.3f} {allocs:15d} "
                  f"{up.counters()['deallocations']:14d}")
            pool.close()
        print()


def growth_events() -> None:
    import random

    print("Upstream allocations of a default ArenaPool, with the pool's state just before each")
    print("\nrandom_lifetime (the sequence PyTorch was measured on):")
    up = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(up)
    rng = random.Random(0)
    live: List[Tuple[int, int]] = []
    for step in range(4000):
        if live and rng.random() < 0.5:
            pool.deallocate(live.pop(rng.randrange(len(live)))[0])
        else:
            n = rng.randint(1, 64) * 1000 * rng.choice([1, 7, 33, 129]) * 4
            live.append((_grow_report(pool, up, n, f"step {step}"), n))
    print("\ntorch_bert_serve trace:")
    up = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(up)
    table: Dict[int, int] = {}
    for ev in read_log(TRACES[1]).events:
        if ev.kind == "alloc":
            table[ev.addr] = _grow_report(pool, up, ev.size, f"entry {ev.where}")
        elif ev.kind == "free" and ev.addr in table:
            pool.deallocate(table.pop(ev.addr))


def _grow_report(pool: Any, up: Any, n: int, where: str) -> int:
    before = pool.stats()
    a0 = up.counters()["allocations"]
    p = pool.allocate(n)
    if up.counters()["allocations"] > a0:
        st = pool.stats()
        print(f"  {where:12s} request {n / MiB:7.2f} MiB | live {before['live_bytes'] / MiB:7.1f} free "
              f"{before['free_bytes'] / MiB:7.1f} largest free {before['largest_free_block'] / MiB:6.2f} MiB "
              f"| reserved after {st['reserved_bytes'] / MiB:7.1f} MiB in {st['backings']} backings")
    return p


if __name__ == "__main__":
    sweep()
    growth_events()
