"""Cost of per-stream bookkeeping after a pool has seen many distinct streams (issue 16, item 18).

For each pool kind: release one block on each of N distinct simulated streams (nothing stays
pending: each release is settled), then time alloc+free on a stream seen before them and on one seen after them, and process_pending(), and
report the RSS growth and the lanes alive. Before lane retirement every stream ever seen kept a
lane, found by a linear scan: 40,000 streams cost ~51 MiB and alloc+free went from ~2 us to ~112 us.

    PYTHONPATH=<site> python3 benchmarks/many_streams.py [--streams 40000] [--json out.json]

Timings are wall-clock on whatever machine runs it (compare runs on the same machine only).
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MiB


def per_op_us(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def measure(kind: str, nstreams: int) -> dict:
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.SizeClassPool(sim) if kind == "size_class" else pk.ArenaPool(sim, thread_cache_bytes=0)
    hot = sim.stream()

    def alloc_free():
        p = pool.allocate(4 * KiB, hot)
        pool.deallocate(p, hot)

    alloc_free()
    pool.process_pending()
    base_af, base_pp = per_op_us(alloc_free, 2000), per_op_us(pool.process_pending, 2000)
    rss0 = rss_mib()
    t0 = time.perf_counter()
    for i in range(nstreams):
        s = sim.stream()
        p = pool.allocate(4 * KiB, s)
        pool.deallocate(p, s)
        if i % 64 == 63:
            pool.process_pending()  # nothing stays pending
    pool.process_pending()
    fill_s = time.perf_counter() - t0
    late = sim.stream()  # a stream first seen now: its lane comes after every other one

    def alloc_free_late():
        p = pool.allocate(4 * KiB, late)
        pool.deallocate(p, late)

    late_af = per_op_us(alloc_free_late, 200)
    st = pool.stats()
    out = {
        "pool": kind,
        "streams": nstreams,
        "alloc_free_us_before": round(base_af, 3),
        "process_pending_us_before": round(base_pp, 3),
        "alloc_free_us_after": round(per_op_us(alloc_free, 2000), 3),
        "alloc_free_new_stream_us_after": round(late_af, 3),
        "process_pending_us_after": round(per_op_us(pool.process_pending, 200), 3),
        "rss_growth_mib": round(rss_mib() - rss0, 2),
        "seconds_to_see_streams": round(fill_s, 2),
        "pending_bytes": st["pending_bytes"],
        "stream_lanes": st.get("stream_lanes", "n/a (no lane retirement)"),
        "fences_recorded": st["fences_recorded"],
        "live_events": sim.live_events,
    }
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=40000)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    rows = [measure(k, a.streams) for k in ("arena", "size_class")]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
