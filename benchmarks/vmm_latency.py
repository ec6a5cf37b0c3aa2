"""What a map and an unmap cost on the GPU, next to cuMemAlloc / cuMemFree of the same size.

The simulated device assumes a map costs what its cudaMalloc fit says an allocation costs (and an
unmap what a free costs); this measures both on the device so the assumption can be checked.
Each figure is the median of ``--reps`` calls, timed inside the upstream (its counters' ns).

Runs (``--runs``, default 8,32 pieces of one granule): the expandable arena maps a growth and
aliases a stitch as one run (``map_pieces`` / ``alias_pieces``: a cuMemMap per piece, one
cuMemSetAccess for the run), and takes free pieces and stitched ranges down as runs
(``unmap_pieces`` / ``unalias_pieces``: one cuMemUnmap over the run where the driver takes one,
``CudaVirtual.unmap_runs``). Beside each run, the same pieces mapped (aliased, unaliased, unmapped)
one call each, as ``map`` / ``alias`` / ``unalias`` / ``unmap`` do: per piece, the median of
``--reps`` runs, wall time around the calls.

    PYTHONPATH=<built poolkeeper> python3 benchmarks/vmm_latency.py [--reps 20] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List

import poolkeeper as pk

MiB = 1 << 20


def timed(up, call) -> tuple:
    c0 = up.counters()
    call()
    c1 = up.counters()
    return c1["alloc_ns"] - c0["alloc_ns"], c1["dealloc_ns"] - c0["dealloc_ns"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes-mib", default="2,8,32,64,256")
    ap.add_argument("--runs", default="8,32", help="pieces per run (comma-separated; empty: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(x) * MiB for x in args.sizes_mib.split(",")]
    vm = pk.upstream.CudaVirtual(0)
    dev = pk.upstream.CudaDevice(0)
    g = vm.vm_granularity
    va = max(sizes) * 2
    base = vm.reserve(va)
    rows: List[Dict] = []
    for n in sizes:
        n = -(-n // g) * g
        m_ns, u_ns, a_ns, f_ns = [], [], [], []
        for _ in range(args.reps):
            m_ns.append(timed(vm, lambda: vm.map(base, n))[0])
            u_ns.append(timed(vm, lambda: vm.unmap(base, n))[1])
            holder = {}
            a_ns.append(timed(dev, lambda: holder.setdefault("p", dev.allocate(n)))[0])
            f_ns.append(timed(dev, lambda: dev.deallocate(holder["p"], n))[1])
        row = {"bytes": n, "map_us": statistics.median(m_ns) / 1e3, "unmap_us": statistics.median(u_ns) / 1e3,
               "cuMemAlloc_us": statistics.median(a_ns) / 1e3, "cuMemFree_us": statistics.median(f_ns) / 1e3}
        rows.append(row)
        print(f"{n / MiB:7.0f} MiB  map {row['map_us']:8.1f} us  unmap {row['unmap_us']:8.1f} us  |  "
              f"cuMemAlloc {row['cuMemAlloc_us']:8.1f} us  cuMemFree {row['cuMemFree_us']:8.1f} us")
    vm.unreserve(base, va)
    print(f"granularity {g} B; simulated model per call: 43.05 us + 0.3935 us/MiB")
    runs = [run_row(vm, int(n), args.reps) for n in args.runs.split(",") if n.strip()]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"granularity": g, "reps": args.reps, "rows": rows, "runs": runs}, f, indent=1)


def run_row(vm, n: int, reps: int) -> Dict:
    """Per piece (us): n granules mapped one call each vs as one run, and likewise aliased,
    unaliased and unmapped, medians over ``reps`` repetitions (each and run alternate)."""
    g = vm.vm_granularity
    base, dst = vm.reserve(n * g), vm.reserve(n * g)
    srcs = [(base + k * g, g) for k in range(n)]
    keys = ("map_each", "map_run", "alias_each", "alias_run", "unalias_each", "unalias_run", "unmap_each", "unmap_run")
    t: Dict[str, List[float]] = {k: [] for k in keys}

    def clock(key, fn):
        t0 = time.perf_counter_ns()
        fn()
        t[key].append((time.perf_counter_ns() - t0) / n / 1e3)

    for rep in range(reps):
        if rep % 2:
            clock("map_each", lambda: [vm.map(a, g) for a, _ in srcs])
        else:
            clock("map_run", lambda: vm.map_pieces(base, n * g, g))
        for each in (True, False):
            if each:
                clock("alias_each", lambda: [vm.alias(dst + k * g, a, g) for k, (a, _) in enumerate(srcs)])
            else:
                clock("alias_run", lambda: vm.alias_pieces(dst, srcs))
            if (rep + each) % 2:
                clock("unalias_each", lambda: [vm.unalias(dst + k * g, g) for k in range(n)])
            else:
                clock("unalias_run", lambda: vm.unalias_pieces(dst, [g] * n))
        if rep % 2:
            clock("unmap_each", lambda: [vm.unmap(a, g) for a, _ in srcs])
        else:
            clock("unmap_run", lambda: vm.unmap_pieces(base, [g] * n))
    vm.unreserve(dst, n * g)
    vm.unreserve(base, n * g)
    row = {"pieces": n, **{f"{k}_us": statistics.median(v) for k, v in t.items() if v}}
    # None where the upstream has no say (a simulated one); False: each run went piece by piece.
    row["unmap_runs"] = getattr(vm, "unmap_runs", None)
    print(f"run of {n:3d} x {g >> 20} MiB, per piece (each / one run):  map {row['map_each_us']:6.1f} / "
          f"{row['map_run_us']:6.1f} us  |  alias {row['alias_each_us']:6.1f} / {row['alias_run_us']:6.1f} us  |  "
          f"unalias {row['unalias_each_us']:6.1f} / {row['unalias_run_us']:6.1f} us  |  unmap "
          f"{row['unmap_each_us']:6.1f} / {row['unmap_run_us']:6.1f} us  (driver takes unmap runs: {row['unmap_runs']})")
    return row


if __name__ == "__main__":
    main()
