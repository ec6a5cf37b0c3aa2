#!/usr/bin/env python3
"""The allocation-cost table on a GPU, in one run: cost per allocation of allocate + free + synchronize.

Arms (each at 1 MiB, 64 MiB, 256 MiB and 1 GiB):
  cudaMalloc        CudaDevice directly (cuMemAlloc/cuMemFree)
  async_cold        CudaAsync(warm=False) with the default pool's release threshold at 0
  async_warm        CudaAsync (the warm-pool manager raises the threshold to the maximum)
  size_class_sync   SizeClassPool over CudaDevice
  arena_sync        ArenaPool over CudaDevice (skipped while ArenaPool is not built)
  size_class_nosync / arena_nosync   the same pools, allocate + free pairs without the synchronize
  sync_only         the stream synchronize alone (the floor under every *_sync figure)
  *_native          the upstream arms' same cycle timed inside C++ (no Python in the loop), to
                    separate the bindings' share from the driver's

Every figure is measured from Python through poolkeeper's bindings (one loop iteration = the
calls named above), as the median over --reps repetitions of the mean per iteration; the
measurements of one row group run round-robin so drift hits them alike, and every repetition is
kept in the JSON (runs_us). The synchronize is on a non-blocking stream of our own, as in the native C++ reference program
whose figures (measured on an H200 host) are printed beside ours as "anchor (native C++)".
The main thread has the device's primary context current (driver.set_device), as a CUDA program
does after cudaSetDevice; async_warm_native_noctx repeats the warm cycle on a fresh thread.

Usage (device machine):  python3 benchmarks/cuda_alloc_bench.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

MiB = 1 << 20
SIZES = [1 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB]

# The native C++ reference program's per-call figures in us (H200, driver 580.159.04, CUDA 13).
ANCHORS = {
    "cudaMalloc": {1: 86.90, 64: 147.99, 256: 280.25, 1024: 892.26},  # pair, no synchronize
    "async_cold": {1: 134.89, 64: 237.91, 256: 866.51, 1024: 3340.65},
    "async_warm": {1: 3.54, 64: 3.53, 256: 3.37, 1024: 3.78},
}
TARGETS = {"async_warm": 4.0, "arena_nosync": 1.0}  # us, from issue 4


def per_op_runs(fn: Callable[[], None], iters: int, warmup: int = 3) -> Callable[[], float]:
    """A measurement: one call runs `iters` iterations of fn and returns us per iteration."""

    def one() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        return (time.perf_counter_ns() - t0) / iters / 1000.0

    for _ in range(warmup):
        fn()
    return one


def native_runs(up, size: int, iters: int, stream: int) -> Callable[[], float]:
    """The same cycle timed inside C++ (no Python in the loop)."""
    from poolkeeper import _core

    _core.cuda_time_upstream_cycle(up, size, 3, stream)
    return lambda: _core.cuda_time_upstream_cycle(up, size, iters, stream) / 1000.0


def interleaved(measures: Dict[str, Callable[[], float]], reps: int) -> Dict[str, List[float]]:
    """Run the measurements round-robin, reps times, so drift and order effects hit all alike."""
    runs: Dict[str, List[float]] = {k: [] for k in measures}
    for _ in range(reps):
        for k, m in measures.items():
            runs[k].append(m())
    return runs


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    ap.add_argument("--out", default="cuda_alloc_bench.json")
    args = ap.parse_args(argv)

    import poolkeeper as pk
    from poolkeeper.cuda import driver, warm

    if not pk.cuda.is_available():
        print(f"CUDA unavailable: {pk.cuda.unavailable_reason()}", file=sys.stderr)
        return 2
    dev = args.device
    info = pk.cuda.device_info(dev)
    stream = driver.Stream(dev)
    sync = stream.synchronize

    def n(k: int) -> int:
        return max(3, int(k * args.scale))

    rows: List[Dict] = []

    def record(arm: str, size: int, runs: List[float], iters: int, up=None, pool=None, note: str = "") -> None:
        us = statistics.median(runs)
        row = {"arm": arm, "size_bytes": size, "size_mib": size // MiB, "us_per_op": round(us, 3), "iters": iters,
               "reps": len(runs), "runs_us": [round(r, 3) for r in runs], "note": note}
        if up is not None:
            row["upstream_counters"] = up.counters()
        if pool is not None:
            st = pool.stats()
            row["pool_upstream_allocations"] = st.get("upstream_allocations")
            row["pool_reserved_bytes"] = st["reserved_bytes"]
        rows.append(row)
        print(f"  {arm:<24} {size // MiB:>5} MiB  {us:10.2f} us  (median of {len(runs)} x {iters}; "
              f"min {min(runs):.2f}, max {max(runs):.2f})", flush=True)

    def upstream_arm(arm: str, up, size: int, iters: int, note: str = "") -> None:
        def op():
            p = up.allocate(size)
            up.deallocate(p, size)
            sync()

        runs = interleaved({"py": per_op_runs(op, iters), "native": native_runs(up, size, iters, stream.handle)},
                           args.reps)
        record(arm, size, runs["py"], iters, up=up, note=note)
        record(arm + "_native", size, runs["native"], iters, note="timed in C++; " + note)

    print(f"device {dev}: {info.name}, driver {pk.cuda.driver_version()}", flush=True)
    # Like any CUDA program after cudaSetDevice: the thread's current context is the device's.
    driver.set_device(dev)

    # floor: the synchronize alone
    record("sync_only", 0, interleaved({"s": per_op_runs(sync, n(20000))}, args.reps)["s"], n(20000))

    # 1. cudaMalloc: CudaDevice directly
    up = pk.upstream.CudaDevice(dev)
    for s in SIZES:
        upstream_arm("cudaMalloc", up, s, n(40))
    del up

    # 2. CudaAsync cold: threshold 0, no warm handle
    assert warm.state().total_handles == 0
    original = warm.release_threshold(dev)
    warm.set_release_threshold(dev, 0)
    driver.device_synchronize(dev)
    warm.trim_to(dev, 0)
    cold = pk.upstream.CudaAsync(dev, stream, warm=False)
    for s in SIZES:
        upstream_arm("async_cold", cold, s, n(60), note="release threshold 0")
    del cold

    # 3. CudaAsync warm: the manager raises the threshold while the upstream lives
    hot = pk.upstream.CudaAsync(dev, stream)
    thr = warm.release_threshold(dev)
    for s in SIZES:
        upstream_arm("async_warm", hot, s, n(5000),
                     note=f"release threshold {'max' if thr == warm.MAX_THRESHOLD else thr}")
    # the same on a thread with no current context (what a fresh worker thread sees)
    import threading

    box: Dict[str, List[float]] = {}

    def fresh_thread() -> None:
        m = native_runs(hot, MiB, n(5000), stream.handle)
        box["runs"] = [m() for _ in range(args.reps)]

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    record("async_warm_native_noctx", MiB, box["runs"], n(5000), note="timed in C++ on a thread with no current context")
    del hot
    warm_state = warm.state()
    restored = warm.release_threshold(dev)
    warm.set_release_threshold(dev, original)

    # 4. pools over CudaDevice, with and without the synchronize
    for kind in ("size_class", "arena"):
        base = pk.upstream.CudaDevice(dev)
        try:
            pool = pk.make_pool(kind, base)
        except pk.PoolkeeperError as e:
            print(f"  {kind}: skipped ({e})", flush=True)
            for s in SIZES:
                rows.append({"arm": f"{kind}_sync", "size_bytes": s, "size_mib": s // MiB, "us_per_op": None,
                             "note": f"skipped: {e}"})
            continue
        for s in SIZES:
            alloc, free = pool.allocate, pool.deallocate

            def op_sync(s=s):
                p = alloc(s)
                free(p)
                sync()

            def op_pair(s=s):
                p = alloc(s)
                free(p)

            runs = interleaved({"sync": per_op_runs(op_sync, n(5000)), "pair": per_op_runs(op_pair, n(50000))},
                               args.reps)
            record(f"{kind}_sync", s, runs["sync"], n(5000), up=base, pool=pool)
            record(f"{kind}_nosync", s, runs["pair"], n(50000), up=base, pool=pool)
        pool.close()

    stream.close()

    # table
    by = {(r["arm"], r["size_mib"]): r["us_per_op"] for r in rows}
    present = {r["arm"] for r in rows}
    hdr = f"{'arm (us per allocation)':<26}" + "".join(f"{str(s // MiB) + ' MiB':>12}" for s in SIZES)
    print("\n" + hdr)
    print("-" * len(hdr))

    def line(label: str, vals) -> None:
        print(f"{label:<26}" + "".join(f"{v:>12.2f}" if v is not None else f"{'-':>12}" for v in vals))

    print(f"{'sync_only':<26}{by[('sync_only', 0)]:>12.2f}")
    if ("async_warm_native_noctx", 1) in by:
        print(f"{'async_warm, C++, no ctx':<26}{by[('async_warm_native_noctx', 1)]:>12.2f}   (1 MiB, fresh thread)")
    for arm in ("cudaMalloc", "async_cold", "async_warm", "size_class_sync", "size_class_nosync", "arena_sync",
                "arena_nosync"):
        if arm not in present:
            continue
        line(arm, [by.get((arm, s // MiB)) for s in SIZES])
        if arm + "_native" in present:
            line("  same, timed in C++", [by.get((arm + "_native", s // MiB)) for s in SIZES])
        if arm in ANCHORS:
            line("  anchor (native C++)", [ANCHORS[arm][s // MiB] for s in SIZES])
    checks = {}
    for arm, limit in TARGETS.items():
        vals = [by.get((arm, s // MiB)) for s in SIZES]
        if all(v is not None for v in vals):
            checks[arm] = {"limit_us": limit, "max_us": max(vals), "met": max(vals) <= limit}
            print(f"target {arm} <= {limit} us at every size: {'met' if max(vals) <= limit else 'NOT met'}"
                  f" (max {max(vals):.2f} us)")
        else:
            checks[arm] = {"limit_us": limit, "max_us": None, "met": None}
            print(f"target {arm} <= {limit} us: not measured")

    out = {
        "benchmark": "cuda_alloc_bench",
        "command": "python3 benchmarks/cuda_alloc_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"device": info.name, "device_index": dev, "driver_version": pk.cuda.driver_version(),
                    "total_memory": info.total_memory, "compute_capability": list(info.compute_capability),
                    "python": platform.python_version(), "platform": platform.platform()},
        "warm_pool": {"threshold_while_warm": thr, "threshold_after_release": restored,
                      "messages": warm_state.messages, "last_error": warm_state.last_error},
        "rows": rows,
        "anchors_native_us": ANCHORS,
        "targets": checks,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
