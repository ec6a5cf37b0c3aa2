"""What the RMM-CSV logging adaptor (poolkeeper.LoggingPool) adds to a pool hit.

    python benchmarks/logging_overhead.py [--json PATH] [--nbytes 4096] [--n 100000] [--reps 5]

Same method as hot_path.py: the minimum over --reps loops of --n allocate+deallocate pairs on a
warmed pool over Host memory (every pair a hit), from Python and through the C ABI in a native
loop; with and without a LoggingPool in front. The log goes to a temporary directory (about 100
bytes per pair) and is deleted afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import poolkeeper as pk  # noqa: E402
from poolkeeper import _core  # noqa: E402
from hot_path import best_ns, loop_pair, machine  # noqa: E402


def measure(pool, nbytes: int, n: int, reps: int):
    pool.deallocate(pool.allocate(nbytes))
    py = best_ns(loop_pair(pool, nbytes), n, reps)
    _core.registry_set(-1, pool)
    try:
        capi = min(_core.capi_bench_pair(-1, nbytes, n) for _ in range(reps))
    finally:
        _core.registry_set(-1, None)
    return py, capi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--nbytes", type=int, default=4096)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, cls in (("arena", pk.ArenaPool), ("size_class", pk.SizeClassPool)):
            plain = cls(pk.upstream.Host())
            py0, c0 = measure(plain, args.nbytes, args.n, args.reps)
            plain.close()
            logged = pk.LoggingPool(cls(pk.upstream.Host()), os.path.join(d, f"{name}.csv"))
            py1, c1 = measure(logged, args.nbytes, args.n, args.reps)
            logged.close()
            rows.append({"pool": name, "python_ns": py0, "python_logged_ns": py1, "capi_ns": c0, "capi_logged_ns": c1})
    print(f"logging overhead, {args.nbytes} B pool hits, allocate+deallocate pair, min of {args.reps} x {args.n} "
          f"({machine()['cpu']})")
    print(f"{'pool':12s} {'Python':>9s} {'+log':>9s} {'added':>8s}   {'C ABI':>9s} {'+log':>9s} {'added':>8s}")
    for r in rows:
        print(f"{r['pool']:12s} {r['python_ns']:9.1f} {r['python_logged_ns']:9.1f} "
              f"{r['python_logged_ns'] - r['python_ns']:8.1f}   {r['capi_ns']:9.1f} {r['capi_logged_ns']:9.1f} "
              f"{r['capi_logged_ns'] - r['capi_ns']:8.1f}   (ns per pair)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "nbytes": args.nbytes, "n": args.n, "reps": args.reps, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
