"""Many threads at once (issue 20): aggregate poolkeeper_malloc+poolkeeper_free pairs/s through the
C ABI for 1..16 native threads, per pool and request size, with p99 call latency per size.

    PYTHONPATH=<site> python3 benchmarks/thread_scaling.py [--backend sim|cuda] [--seconds 0.5]
        [--warmup 0.2] [--threads 1,2,4,8,16]
        [--pools arena,arena_1shard,size_class,arena_expandable,arena_expandable_1shard,direct,reference]
        [--cases "32 MiB;mixed, cross-thread frees"] [--reps 1] [--counters]
        [--json benchmarks/results/thread_scaling.json --key NAME]

The first output line is the command itself (results files keep it).

Each cell: `threads` native threads (capi_bench_threads in the bindings), each doing rounds of 8
allocations then 8 frees on the pool registered for the device, for --warmup seconds unmeasured
(the blocks a steady state keeps in flight get into the pool first), then --seconds measured. Cases: one size at
a time (4 KiB, 256 KiB, 2 MiB, 32 MiB) freed by the allocating thread, and "mixed": the four sizes
at once with every round's blocks freed by the next thread (cross-thread frees); named in --cases
only: "2 MiB, cross-thread frees" (one size handed on: the batches between thread caches alone). Streams: none
(stream=None contract), so the figures are the pools' own paths, not stream bookkeeping. The JSON rows also carry each cell's upstream calls
(after the warm-up they are growth the steady state still needed, or memory given back and taken
again).

Backends: sim = Simulated(latency="none") (a miss costs no device time: the pool's own work is all
that is measured); cuda = CudaDevice(0) (misses are real cuMemAlloc/cuMemFree; the pools are
warmed by the first round, so a steady state touches the upstream only when a pool gives memory
back; the expandable arena runs over CudaVirtual). The direct pool is the reference: every pair is
an upstream call. arena_1shard and arena_expandable_1shard are the arenas with shards=1 (one pool
lock for everything above the thread cache, as before the arena shards): the A/B in one run.
"reference" is no pool at all: each malloc writes one word of a cache-line record from the calling
thread's ring and each free writes it back. It measures the pattern itself -- with cross-thread
frees, the hand-over locks and the lines that move between cores, which any allocator's per-block
state moves too -- so a pool's mixed-case ratio is read against the reference's ratio, not 1.

--reps N measures every cell N times (a fresh pool each time) and keeps the run with the median
rate (its latencies and upstream calls come with it; every rate is in the JSON row's
`pairs_per_s_reps`): one thread's mixed cell moved 5.6-10.5 M pairs/s between runs on the H200
host, which moves the ratio below as much as any change did.

The "16/1" column is aggregate pairs/s at 16 threads over 1 thread. A machine with fewer cores
than threads cannot show scaling beyond its core count, but a collapse (ratio far below 1) still
shows. Timings are wall-clock on the machine that runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys

import poolkeeper as pk
from poolkeeper import _core

KiB, MiB = 1 << 10, 1 << 20
CASES = [("4 KiB", [4 * KiB], False), ("256 KiB", [256 * KiB], False), ("2 MiB", [2 * MiB], False),
         ("32 MiB", [32 * MiB], False), ("mixed, cross-thread frees", [4 * KiB, 256 * KiB, 2 * MiB, 32 * MiB], True)]
# Run only when named in --cases: one size handed between threads (the thread caches' batches alone).
EXTRA_CASES = [("2 MiB, cross-thread frees", [2 * MiB], True)]
# stats() counters of the locked paths and of the batches between thread caches, kept per cell.
COUNTERS = ("slow_allocations", "slow_deallocations", "cache_refills", "cache_spills", "transfer_handovers",
            "transfer_takes", "transfer_evictions")
DEVICE = 0  # registry slot the pools are installed in (also the CUDA ordinal for --backend cuda)


def make_upstream(backend: str, kind: str = ""):
    if backend == "cuda":
        # The expandable arena needs virtual memory: CudaVirtual maps physical pieces into one range.
        return pk.upstream.CudaVirtual(DEVICE) if kind.startswith("arena_expandable") else pk.upstream.CudaDevice(DEVICE)
    return pk.upstream.Simulated(latency="none")


def make_pool(kind: str, up):
    if kind == "arena":
        return pk.ArenaPool(up)
    if kind == "arena_expandable":
        return pk.ArenaPool(up, expandable=True)
    # The same arenas with one shard: the single pool lock of before, side by side in one run.
    if kind == "arena_1shard":
        return pk.ArenaPool(up, shards=1)
    if kind == "arena_expandable_1shard":
        return pk.ArenaPool(up, expandable=True, shards=1)
    if kind == "size_class":
        return pk.SizeClassPool(up)
    if kind == "direct":
        return pk.Direct(up)
    raise SystemExit(f"unknown pool kind {kind!r}")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform()}


def run_cell(backend: str, kind: str, sizes, cross: bool, threads: int, seconds: float, warmup: float) -> dict:
    if kind == "reference":  # the harness alone: no pool, no upstream (see the module docstring)
        r = _core.capi_bench_threads(DEVICE, sizes, threads, seconds, cross, warmup=warmup, reference=True)
        r.update(upstream_allocations=0, upstream_deallocations=0, peak_reserved_bytes=0, shards=1, counters={})
        return r
    up = make_upstream(backend, kind)
    pool = make_pool(kind, up)
    _core.registry_set(DEVICE, pool)
    try:
        try:
            r = _core.capi_bench_threads(DEVICE, sizes, threads, seconds, cross, warmup=warmup)
        except TypeError:  # a build from before the warm-up (an older commit measured side by side)
            r = _core.capi_bench_threads(DEVICE, sizes, threads, seconds, cross)
            r["warmup_unsupported"] = True
    finally:
        _core.registry_set(DEVICE, None)
    pool.validate()  # the books balance after the storm (quiescent now)
    st = pool.stats()
    r["upstream_allocations"] = st.get("upstream_allocations", 0)  # warm-up included
    r["upstream_deallocations"] = st.get("upstream_deallocations", 0)
    r["peak_reserved_bytes"] = st.get("peak_reserved_bytes", 0)
    r["shards"] = st.get("shards", 1)
    r["counters"] = {k: st[k] for k in COUNTERS if k in st}  # warm-up included
    assert st["reserved_bytes"] == st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"], st
    pool.trim()
    pool.close()
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--warmup", type=float, default=0.2, help="unmeasured seconds of the same traffic first")
    ap.add_argument("--threads", default="1,2,4,8,16")
    ap.add_argument("--pools", default="arena,arena_1shard,size_class,arena_expandable,arena_expandable_1shard,direct,reference")
    ap.add_argument("--cases", default="", help="semicolon-separated case labels to run (default: all)")
    ap.add_argument("--json", help="results file; with --key, the run is stored under that key of the "
                    "file's object (other keys kept: one results file for every machine)")
    ap.add_argument("--key", default="")
    ap.add_argument("--reps", type=int, default=1, help="runs per cell; the median-rate run is kept")
    ap.add_argument("--label", default="", help="free text stored with the results (e.g. the commit)")
    ap.add_argument("--counters", action="store_true", help="print each cell's locked-path and batch counters "
                    "(stats(), warm-up included; always in the JSON rows)")
    args = ap.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",")]
    kinds = [k for k in args.pools.split(",") if k]
    cases = [c for c in CASES + EXTRA_CASES if c[0] in args.cases.split(";")] if args.cases else CASES
    if not make_upstream(args.backend, "arena_expandable").supports_virtual:
        for k in [k for k in kinds if k.startswith("arena_expandable")]:
            kinds.remove(k)
            print(f"{k} skipped: the upstream has no virtual memory")
    command = "python3 benchmarks/thread_scaling.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    out = {"machine": machine(), "backend": args.backend, "seconds": args.seconds, "warmup": args.warmup, "reps": args.reps,
           "label": args.label, "command": command, "rows": []}
    print(f"command: {command}")
    print(f"thread scaling, backend {args.backend}, {args.warmup}s warm-up + {args.seconds}s per cell ({machine()['cpu']}, {os.cpu_count()} cores)")
    hdr = "".join(f"{t:>9d}t" for t in threads)
    last_over_first = f"{threads[-1]}/{threads[0]}"  # the ratio column: the last thread count over the first
    print(f"{'pool':23s} {'case':26s}{hdr}  {last_over_first:>6s}   p99 alloc/free ns at {threads[-1]} threads")
    for kind in kinds:
        for label, sizes, cross in cases:
            cells = []
            for t in threads:
                runs = sorted((run_cell(args.backend, kind, sizes, cross, t, args.seconds, args.warmup)
                               for _ in range(max(1, args.reps))), key=lambda x: x["pairs_per_s"])
                r = runs[len(runs) // 2]
                if args.reps > 1:
                    r["pairs_per_s_reps"] = [x["pairs_per_s"] for x in runs]
                cells.append(r)
                out["rows"].append({"pool": kind, "case": label, "sizes": sizes, "cross_thread_frees": cross, **r})
            rates = [c["pairs_per_s"] / 1e6 for c in cells]
            ratio = rates[-1] / rates[0] if rates[0] else float("nan")
            p99 = " ".join(f"{int(s['alloc_p99_ns'])}/{int(s['free_p99_ns'])}" for s in cells[-1]["per_size"])
            print(f"{kind:23s} {label:26s}" + "".join(f"{r:9.2f}M" for r in rates) + f"  {ratio:6.2f}x  {p99}", flush=True)
            if args.counters and any(c.get("counters") for c in cells):  # size_class, direct, reference: none
                for t, c in zip(threads, cells):
                    print(f"    {t:2d} threads: " + " ".join(f"{k} {v}" for k, v in c.get("counters", {}).items()))
    if args.json:
        doc = out
        if args.key:
            doc = {}
            if os.path.exists(args.json):
                with open(args.json) as f:
                    doc = json.load(f)
            doc[args.key] = out
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
