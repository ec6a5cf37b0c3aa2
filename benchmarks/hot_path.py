"""Issue 2's hot-path figures, side by side in one run: the Python-level allocate+deallocate pair on
a pool hit against an empty Python call, and the C-ABI pair in a native loop.

    python benchmarks/hot_path.py [--json PATH] [--nbytes 4096] [--n 300000] [--reps 9]

Each figure is the minimum over --reps repetitions of a loop of --n pairs (the minimum is the
least disturbed repetition: every disturbance only adds time). Host upstream, so a hit touches no
device; the pools are warmed first so every timed pair is a hit.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.bench.machine import machine_info


def best_ns(fn, n: int, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn(n)
        out.append((time.perf_counter_ns() - t0) / n)
    return min(out)


def noop() -> None:
    pass


def loop_empty(n: int) -> None:
    for _ in range(n):
        noop()


def loop_two_empty(n: int) -> None:
    for _ in range(n):
        noop()
        noop()


def loop_pair(pool, nbytes):
    a, d = pool.allocate, pool.deallocate

    def run(n: int) -> None:
        for _ in range(n):
            d(a(nbytes))

    return run


def loop_pair_nanobind(pool, nbytes):
    a, d = _core._slow_allocate, _core._slow_deallocate

    def run(n: int) -> None:
        for _ in range(n):
            d(pool, a(pool, nbytes))

    return run


def capi_lib():
    """The C ABI's graph calls, from the extension itself (as PyTorch's hooks call them)."""
    lib = ctypes.CDLL(_core.__file__)
    u64 = ctypes.c_uint64
    for name, args in (("graph_begin", [ctypes.c_int, u64, u64, u64]), ("graph_end", [ctypes.c_int, u64, u64]),
                       ("graph_release", [ctypes.c_int, u64, u64]), ("malloc", [ctypes.c_size_t, ctypes.c_int, u64]),
                       ("free", [ctypes.c_void_p, ctypes.c_int, u64])):
        getattr(lib, "poolkeeper_" + name).argtypes = args
    lib.poolkeeper_malloc.restype = ctypes.c_void_p
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--nbytes", type=int, default=4096)
    ap.add_argument("--n", type=int, default=300_000)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    rows = []
    empty = best_ns(loop_empty, args.n, args.reps)
    two = best_ns(loop_two_empty, args.n, args.reps)
    rows.append(("empty Python call", empty, None))
    rows.append(("two empty Python calls", two, None))
    for name, cls in (("arena", pk.ArenaPool), ("size_class", pk.SizeClassPool)):
        pool = cls(pk.upstream.Host())
        pool.deallocate(pool.allocate(args.nbytes))
        pair = best_ns(loop_pair(pool, args.nbytes), args.n, args.reps)
        rows.append((f"{name}: allocate+deallocate (Python)", pair, pair / two))
        if name == "arena":
            slow = best_ns(loop_pair_nanobind(pool, args.nbytes), args.n, args.reps)
            rows.append((f"{name}: same through nanobind's dispatcher", slow, slow / two))
        _core.registry_set(-1, pool)
        try:
            capi = min(_core.capi_bench_pair(-1, args.nbytes, args.n * 10) for _ in range(args.reps))
        finally:
            _core.registry_set(-1, None)
        rows.append((f"{name}: poolkeeper_malloc+free (C ABI, native loop)", capi, None))
        # The same on a device index that has had a CUDA-graph capture: from then on every C ABI call
        # also pins the device's GraphPools (a per-thread hazard) and asks whether a scope is open.
        # And with a graph alive (one captured block kept), as in a server whose decode step is a
        # CUDA graph: its frees must tell the graph's blocks from the device pool's.
        _core.registry_set(0, pool)
        try:
            _core.graph_pools(0)
            graph = min(_core.capi_bench_pair(0, args.nbytes, args.n * 10) for _ in range(args.reps))
            lib = capi_lib()
            stream = 12345  # the capture's stream; the timed pairs run on the default stream
            assert lib.poolkeeper_graph_begin(0, 1, 0, stream) == 0
            block = lib.poolkeeper_malloc(args.nbytes, 0, stream)
            assert block and lib.poolkeeper_graph_end(0, 1, 0) == 0
            live = min(_core.capi_bench_pair(0, args.nbytes, args.n * 10) for _ in range(args.reps))
            assert lib.poolkeeper_free(block, 0, stream) == 0 and lib.poolkeeper_graph_release(0, 1, 0) == 0
        finally:
            _core.registry_clear()
        rows.append((f"{name}: the same, device with graph pools", graph, None))
        rows.append((f"{name}: the same, a graph's block alive", live, None))
        pool.validate()
        pool.close()
    print(f"hot path, {args.nbytes} B pool hits, min of {args.reps} x {args.n} ({machine_info()['cpu']})")
    print(f"{'':52s} {'ns/op':>8s}  {'x two empty calls':>17s}")
    for label, ns, ratio in rows:
        print(f"{label:52s} {ns:8.1f}  {'' if ratio is None else f'{ratio:17.2f}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "nbytes": args.nbytes, "n": args.n, "reps": args.reps,
                       "rows": [{"what": l, "ns": ns, "ratio_two_empty": r} for l, ns, r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
