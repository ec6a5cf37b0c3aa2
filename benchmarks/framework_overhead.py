"""What the framework paths cost against what they replace (issue 14), in one run:

- ``pool.buffer(n)`` + drop (poolkeeper's owning buffer) against the bare ``allocate``+``deallocate``
  pair on the same pool, and against RMM's ``DeviceBuffer(size=n, mr=...)`` + drop and RMM's bare
  ``mr.allocate``+``mr.deallocate`` pair (when ``rmm`` is importable; ``ArenaMemoryResource`` and
  ``PoolMemoryResource`` over ``CudaMemoryResource``);
- ``cupy.empty(n, uint8)`` + drop with CuPy's own memory pool, with
  ``poolkeeper.integrations.cupy.install(kind)`` (the native path through CuPy's
  ``CFunctionAllocator``, and the Python allocator path, ``POOLKEEPER_CUPY_NATIVE=0``), and with
  RMM's ``rmm_cupy_allocator`` over RMM's arena and pool (when ``cupy`` -- and ``rmm`` -- are
  importable and a GPU is there); plus, for each, the allocator alone (``cupy.cuda.alloc(n)`` +
  drop: what CuPy's allocator costs without the ndarray around it).

    python benchmarks/framework_overhead.py [--backend simulated|host|cuda] [--sizes 4K,64K,1M,16M,64M]
        [--n 20000] [--reps 7] [--kinds arena,arena_expandable] [--json PATH]

Each figure is the minimum over ``--reps`` repetitions of a loop of ``--n`` operations (ns per
operation; every disturbance only adds time), after a warm-up that makes every timed operation a
pool hit. The backend only decides where the pools' memory comes from (simulated: no device at
all, what CI and the development machine can run; cuda: the GPU). CuPy and RMM rows need the GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import poolkeeper as pk


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def best_ns(run: Callable[[int], None], n: int, reps: int) -> float:
    run(min(n, 1000))  # warm: the pool holds the block, caches are filled
    out = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter_ns()
        run(n)
        out.append((time.perf_counter_ns() - t0) / n)
    return min(out)


def upstream_for(backend: str, kind: str) -> Any:
    from poolkeeper.pools import KINDS

    if backend == "simulated":
        return pk.upstream.Simulated(latency_us=0)
    if backend == "host":
        return pk.upstream.Host()
    name = {"device": "CudaDevice", "virtual": "CudaVirtual", "async": "CudaAsync"}[KINDS[kind].cuda_upstream]
    return getattr(pk.upstream, name)(0)


def poolkeeper_rows(backend: str, kinds: List[str], sizes: List[int], n: int, reps: int) -> List[Dict[str, Any]]:
    rows = []
    for kind in kinds:
        pool = pk.make_pool(kind, upstream_for(backend, kind))
        for size in sizes:
            a, d, buf = pool.allocate, pool.deallocate, pool.buffer

            def pair(k: int, a=a, d=d, size=size) -> None:
                for _ in range(k):
                    d(a(size))

            def buffer_drop(k: int, buf=buf, size=size) -> None:
                for _ in range(k):
                    buf(size)  # dropped at once: freed by the buffer's own lifetime

            rows.append({"what": f"{kind}: allocate+deallocate", "nbytes": size, "ns": best_ns(pair, n, reps)})
            rows.append({"what": f"{kind}: pool.buffer(n)+drop", "nbytes": size, "ns": best_ns(buffer_drop, n, reps)})
        pool.close()
    return rows


def _rmm_resources(rmm: Any) -> Dict[str, Callable[[], Any]]:
    cuda = rmm.mr.CudaMemoryResource()
    return {"rmm ArenaMemoryResource": lambda: rmm.mr.ArenaMemoryResource(cuda),
            "rmm PoolMemoryResource": lambda: rmm.mr.PoolMemoryResource(cuda, initial_pool_size=1 << 30)}


def _import_rmm() -> Any:
    import rmm
    import rmm.mr

    return rmm


def rmm_rows(sizes: List[int], n: int, reps: int) -> List[Dict[str, Any]]:
    try:
        rmm = _import_rmm()
    except Exception as e:
        return [{"what": "rmm", "skipped": f"rmm not importable ({type(e).__name__}: {e})"}]
    rows = []
    for name, make in _rmm_resources(rmm).items():
        try:
            mr = make()
        except Exception as e:
            rows.append({"what": name, "skipped": str(e)})
            continue
        for size in sizes:
            def drop(k: int, mr=mr, size=size) -> None:
                for _ in range(k):
                    rmm.DeviceBuffer(size=size, mr=mr)

            def pair(k: int, a=mr.allocate, d=mr.deallocate, size=size) -> None:
                for _ in range(k):
                    d(a(size), size)

            try:
                rows.append({"what": f"{name}: mr.allocate+deallocate", "nbytes": size, "ns": best_ns(pair, n, reps)})
            except Exception as e:  # an rmm without the Python-level pair
                rows.append({"what": f"{name}: mr.allocate+deallocate", "skipped": f"{type(e).__name__}: {e}"})
            rows.append({"what": f"{name}: DeviceBuffer(size=n, mr)+drop", "nbytes": size, "ns": best_ns(drop, n, reps)})
    return rows


def cupy_rows(kinds: List[str], sizes: List[int], n: int, reps: int) -> List[Dict[str, Any]]:
    try:
        import cupy
    except Exception as e:
        return [{"what": "cupy", "skipped": f"cupy not importable ({type(e).__name__}: {e})"}]
    import os

    from poolkeeper.integrations import cupy as pkc

    rows: List[Dict[str, Any]] = []

    def measure(label: str) -> None:
        for size in sizes:
            def empty_drop(k: int, size=size) -> None:
                e = cupy.empty
                for _ in range(k):
                    e(size, dtype=cupy.uint8)

            def alloc_drop(k: int, size=size) -> None:
                a = cupy.cuda.alloc
                for _ in range(k):
                    a(size)

            rows.append({"what": f"{label}: cupy.empty(n)+drop", "nbytes": size, "ns": best_ns(empty_drop, n, reps)})
            rows.append({"what": f"{label}: cupy.cuda.alloc(n)+drop", "nbytes": size, "ns": best_ns(alloc_drop, n, reps)})

    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    measure("cupy MemoryPool")
    for kind in kinds:
        for path, env in (("native", "1"), ("python", "0")):
            old = os.environ.get("POOLKEEPER_CUPY_NATIVE")
            os.environ["POOLKEEPER_CUPY_NATIVE"] = env
            try:
                inst = pkc.install(kind, pinned=False)
            finally:
                if old is None:
                    os.environ.pop("POOLKEEPER_CUPY_NATIVE", None)
                else:
                    os.environ["POOLKEEPER_CUPY_NATIVE"] = old
            try:
                if inst.path != path:
                    rows.append({"what": f"poolkeeper {kind} ({path})", "skipped": inst.notes.get("path", "")})
                    continue
                measure(f"poolkeeper {kind} ({path})")
                if inst.native is not None:
                    st = inst.native.stats()
                    rows.append({"what": f"poolkeeper {kind} ({path}): fast/slow allocations",
                                 "skipped": f"{st['fast_allocs']} fast, {st['slow_allocs']} slow; {inst.notes.get('path')}"})
            finally:
                pkc.uninstall()
    try:
        rmm = _import_rmm()
        from rmm.allocators.cupy import rmm_cupy_allocator
    except Exception as e:
        rows.append({"what": "rmm_cupy_allocator", "skipped": f"rmm not importable ({type(e).__name__}: {e})"})
    else:
        previous = rmm.mr.get_current_device_resource()
        for name, make in _rmm_resources(rmm).items():
            try:
                rmm.mr.set_current_device_resource(make())
                cupy.cuda.set_allocator(rmm_cupy_allocator)
                measure(f"{name} via rmm_cupy_allocator")
            except Exception as e:
                rows.append({"what": f"{name} via rmm_cupy_allocator", "skipped": f"{type(e).__name__}: {e}"})
            finally:
                cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
                rmm.mr.set_current_device_resource(previous)
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    w = max([58] + [len(r["what"]) + 2 for r in rows])
    out = [f"{'what':<{w}}{'nbytes':>12}{'ns/op':>12}"]
    for r in rows:
        if "skipped" in r:
            out.append(f"{r['what']:<{w}}{'':>12}  skipped: {r['skipped']}")
        else:
            out.append(f"{r['what']:<{w}}{r['nbytes']:>12}{r['ns']:>12.1f}")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="simulated", choices=("simulated", "host", "cuda"))
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--kinds", default="arena,arena_expandable")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    kinds = [k for k in args.kinds.split(",") if k]
    if args.backend == "host":
        kinds = [k for k in kinds if k != "arena_expandable"]  # no virtual memory interface
    rows = poolkeeper_rows(args.backend, kinds, sizes, args.n, args.reps)
    if args.backend == "cuda":
        rows += rmm_rows(sizes, args.n, args.reps)
        rows += cupy_rows(kinds, sizes, args.n, args.reps)
    print(table(rows))
    if args.json:
        doc = {"argv": sys.argv, "backend": args.backend, "python": sys.version.split()[0],
               "machine": platform.machine(), "processor": platform.processor(), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
