"""Instructions per pool-hit pair (Python pair and C-ABI pair), counted by callgrind: a figure that
does not move with the machine's load, for before/after comparisons of the hot path on a busy host.

    python benchmarks/hot_path_ir.py [--site DIR ...] [--n 100000]

Runs each case under `valgrind --tool=callgrind` twice (2000 pairs and 2000 + n) and prints the
difference per pair, for each --site (a PYTHONPATH holding a built poolkeeper; default: the
installed one). Host upstream, 4096-byte hits, the pool warmed first (as benchmarks/hot_path.py).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys


def case(kind: str, path: str, n: int) -> None:
    import poolkeeper as pk
    from poolkeeper import _core

    pool = {"arena": pk.ArenaPool, "size_class": pk.SizeClassPool}[kind](pk.upstream.Host())
    pool.deallocate(pool.allocate(4096))
    if path == "python":
        a, d = pool.allocate, pool.deallocate
        for _ in range(n):
            d(a(4096))
    else:
        _core.registry_set(-1, pool)
        _core.capi_bench_pair(-1, 4096, max(n, 1))
        _core.registry_set(-1, None)


def instructions(site: str | None, kind: str, path: str, n: int) -> int:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = site
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", os.path.realpath(sys.executable),
         __file__, "--case", kind, path, str(n)],
        env=env, capture_output=True, text=True, check=True).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", action="append", default=None)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        case(args.case[0], args.case[1], int(args.case[2]))
        return 0
    sites = args.site or [None]
    print(f"instructions per allocate+deallocate pair (callgrind, {args.n} pairs)")
    for kind in ("arena", "size_class"):
        for path in ("python", "capi"):
            row = []
            for site in sites:
                a = instructions(site, kind, path, 2000)
                b = instructions(site, kind, path, 2000 + args.n)
                row.append(f"{(b - a) / args.n:8.0f}")
            print(f"{kind:11s} {path:7s} " + " ".join(row) + "   (" + ", ".join(s or "installed" for s in sites) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
