"""A Dask array workload with CuPy chunks on two workers: poolkeeper vs CuPy's default pool vs a
stream-ordered (cudaMallocAsync) pool, and RMM's async resource when rmm is installed.

    python benchmarks/dask_cupy_bench.py [--n 12288] [--chunk 2048] [--reps 3] [--rounds 2] [--arms ...] [--json PATH]

Every arm gets a fresh cluster (two worker processes, one thread each; with two GPUs one worker per GPU --
dask-cuda's LocalCUDACluster, or poolkeeper's local_gpu_cluster without dask-cuda -- else both
workers on GPU 0), so no allocator state
carries over. The workload: a random (n, n) float32 matrix in (chunk, chunk) blocks, then
``(x + x.T).sum()``, ``(x @ x.T).sum()`` and ``x.std(axis=0).sum()``, computed ``--reps`` times.

Figures per arm: wall time of each rep (the first includes warm-up), and per worker the peak
reserved device memory:

- ``poolkeeper``: the arena pool's own ``peak_reserved_bytes`` (exact).
- ``cupy_default``: CuPy's MemoryPool ``total_bytes()``, sampled every millisecond by a thread on
  the worker (a sampled peak: it can miss a spike shorter than the interval).
- ``cupy_async``: CuPy's MemoryAsyncPool (``cudaMallocAsync`` on the device's default pool); the
  pool's ``CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`` (exact). Release threshold left at CUDA's default.
- ``rmm_async`` (only with rmm): ``rmm.mr.CudaAsyncMemoryResource`` as CuPy's allocator, under a
  statistics adaptor: its peak is the peak of *live* bytes (RMM's async resource does not report
  what its pool reserves), so it is a lower bound of reserved.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Dict, List

ARMS = ("poolkeeper", "cupy_default", "cupy_async", "rmm_async")


def _worker_plugin_base():
    from distributed import WorkerPlugin

    return WorkerPlugin


def make_plugin(arm: str, limit: int):
    WorkerPlugin = _worker_plugin_base()
    if arm == "poolkeeper":
        from poolkeeper.integrations.dask import PoolkeeperSetup

        return PoolkeeperSetup("arena", upstream="device", cupy=True, limit=limit or None)

    class ArmSetup(WorkerPlugin):
        name = "bench_allocator"

        def __init__(self, arm: str) -> None:
            self.arm = arm

        def setup(self, worker: Any) -> None:
            import cupy

            state: Dict[str, Any] = {"arm": self.arm}
            if self.arm == "cupy_default":
                pool = cupy.get_default_memory_pool()
                state["peak"] = 0
                state["stop"] = False

                def sample() -> None:
                    while not state["stop"]:
                        state["peak"] = max(state["peak"], pool.total_bytes())
                        time.sleep(0.001)

                t = threading.Thread(target=sample, daemon=True)
                t.start()
                state["thread"] = t
            elif self.arm == "cupy_async":
                cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
                import poolkeeper.cuda.warm as warm

                warm.reset_high_watermarks(0)
            elif self.arm == "rmm_async":
                import rmm
                from rmm.allocators.cupy import rmm_cupy_allocator

                stats = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaAsyncMemoryResource())
                rmm.mr.set_current_device_resource(stats)
                cupy.cuda.set_allocator(rmm_cupy_allocator)
                state["stats"] = stats
            worker._bench_state = state

    return ArmSetup(arm)


def peak_reserved(dask_worker: Any) -> Dict[str, Any]:
    import os as _os

    st = getattr(dask_worker, "_bench_state", None)
    out: Dict[str, Any] = {"pid": _os.getpid(), "visible": _os.environ.get("CUDA_VISIBLE_DEVICES")}
    if st is None:  # poolkeeper arm
        from poolkeeper.integrations.dask import worker_stats

        s = worker_stats(dask_worker)
        out.update(peak_reserved_bytes=s["peak_reserved_bytes"], peak_live_bytes=s["peak_live_bytes"],
                   upstream_allocations=s["upstream_allocations"], how="pool stats (exact)")
    elif st["arm"] == "cupy_default":
        import cupy

        out.update(peak_reserved_bytes=max(st["peak"], cupy.get_default_memory_pool().total_bytes()),
                   how="sampled every 1 ms")
    elif st["arm"] == "cupy_async":
        import poolkeeper.cuda.warm as warm

        out.update(peak_reserved_bytes=warm.mempool_attribute(0, "reserved_mem_high"),
                   how="CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH (exact)")
    else:
        c = st["stats"].allocation_counts
        peak = c["peak_bytes"] if isinstance(c, dict) else getattr(c, "peak_bytes", None)
        out.update(peak_reserved_bytes=peak, how="rmm statistics: peak live bytes (lower bound)")
    return out


def workload(n: int, chunk: int, seed: int) -> float:
    import cupy
    import dask.array as da

    rs = da.random.RandomState(seed, RandomState=cupy.random.RandomState)
    x = rs.random_sample((n, n), chunks=(chunk, chunk)).astype("float32")
    x = x.persist()
    a = (x + x.T).sum()
    b = (x @ x.T).sum()
    c = x.std(axis=0).sum()
    out = da.compute(a, b, c)
    del x
    return float(sum(float(v) for v in out))


def make_cluster():
    from distributed import LocalCluster

    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        gpus = 1
    try:
        import dask_cuda
    except ImportError:
        dask_cuda = None
    if gpus >= 2:
        if dask_cuda is not None:
            return (dask_cuda.LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", threads_per_worker=1, dashboard_address=None),
                    "LocalCUDACluster, one GPU per worker")
        from poolkeeper.integrations.dask import local_gpu_cluster

        return local_gpu_cluster(gpus=[0, 1]), "local_gpu_cluster, one GPU per worker"
    return LocalCluster(processes=True, n_workers=2, threads_per_worker=1, dashboard_address=None), "LocalCluster, two workers sharing GPU 0"


def run_arm(arm: str, args: argparse.Namespace) -> Dict[str, Any]:
    from distributed import Client

    cluster, kind = make_cluster()
    with cluster, Client(cluster) as client:
        client.register_plugin(make_plugin(arm, args.limit))
        walls: List[float] = []
        for r in range(args.reps):
            t0 = time.perf_counter()
            workload(args.n, args.chunk, seed=r)
            walls.append(time.perf_counter() - t0)
        peaks = client.run(peak_reserved)
    return {"arm": arm, "cluster": kind, "wall_s": walls, "wall_median_s": statistics.median(walls),
            "wall_best_s": min(walls), "workers": peaks}


def available(arm: str) -> str:
    """'' when the arm can run here, else why not."""
    import importlib.util

    if arm == "rmm_async" and importlib.util.find_spec("rmm") is None:
        return "rmm is not installed"
    if arm == "cupy_async":
        try:
            import cupy

            cupy.cuda.MemoryAsyncPool  # noqa: B018
        except Exception as e:
            return f"CuPy has no MemoryAsyncPool ({e})"
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=12288)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="fresh clusters per arm, arms interleaved")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the uncounted run that fills CuPy's kernel cache")
    ap.add_argument("--limit", type=int, default=0, help="poolkeeper arm: pool limit in bytes (0: none)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    arms, skipped = [], {}
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        why = available(arm)
        if why:
            skipped[arm] = why
            print(f"{arm}: skipped ({why})")
        else:
            arms.append(arm)
    if args.warmup and arms:
        # CuPy compiles each kernel on first use and caches it on disk: without this, whichever arm
        # ran first paid every compilation (on the H200: 9.5 s first rep against 4 s for the rest).
        t0 = time.perf_counter()
        run_arm("cupy_default", argparse.Namespace(**{**vars(args), "reps": 1}))
        print(f"warm-up (CuPy's kernel cache, not counted): {time.perf_counter() - t0:.1f} s")
    runs: Dict[str, List[Dict[str, Any]]] = {a: [] for a in arms}
    for rnd in range(args.rounds):
        # Rotate the order every round so drift on the host (clocks, other tenants) is shared out.
        for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:
            if arm in skipped:
                continue
            try:
                runs[arm].append(run_arm(arm, args))
            except Exception as e:  # one arm failing must not lose the others
                skipped[arm] = f"failed: {type(e).__name__}: {e}"
                print(f"{arm}: FAILED {type(e).__name__}: {e}")
    results = []
    for arm in arms:
        if arm in skipped or not runs[arm]:
            continue
        # The first rep of each fresh cluster includes the workers' CUDA start and pool growth;
        # the steady figure is the median of the other reps over all rounds.
        firsts = [r["wall_s"][0] for r in runs[arm]]
        steady = [w for r in runs[arm] for w in r["wall_s"][1:]] or firsts
        res = {"arm": arm, "cluster": runs[arm][0]["cluster"], "rounds": runs[arm],
               "first_rep_s": firsts, "steady_median_s": statistics.median(steady),
               "steady_best_s": min(steady), "workers": runs[arm][-1]["workers"]}
        results.append(res)
        print(f"{arm:14s} steady median {res['steady_median_s']:6.2f} s best {res['steady_best_s']:6.2f} s  "
              f"first reps {['%.2f' % w for w in firsts]}  ({res['cluster']})")
        for addr, w in sorted(res["workers"].items()):
            pr = w.get("peak_reserved_bytes")
            print(f"    {addr:28s} pid {w['pid']:>7}  peak reserved {pr / 2**30 if pr else float('nan'):7.2f} GiB  ({w['how']})")
    base = next((r for r in results if r["arm"] == "cupy_default"), None)
    if base is not None:
        for r in results:
            print(f"  {r['arm']:14s} steady wall ÷ cupy_default: {r['steady_median_s'] / base['steady_median_s']:.3f}")
    doc = {"n": args.n, "chunk": args.chunk, "reps": args.reps, "rounds": args.rounds, "results": results, "skipped": skipped,
           "python": sys.version.split()[0], "pid": os.getpid()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
