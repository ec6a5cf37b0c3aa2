"""A Dask array workload with CuPy on every worker, each worker's CuPy memory from its own
poolkeeper pool.

    python examples/dask_cupy.py            # two workers; with 2 GPUs: one per GPU

Every CuPy allocation in a task goes to the worker's pool (an ArenaPool over cuMemAlloc on the
worker's GPU); the pools' figures come back per worker, and as the "poolkeeper" worker metric on
the scheduler (what the dashboard's worker table shows). With log_directory set, each worker also
writes its calls as an RMM CSV log that `poolkeeper replay` replays offline.
"""
from __future__ import annotations

import sys
import tempfile


def make_cluster():
    import cupy
    from distributed import LocalCluster

    from poolkeeper.integrations.dask import local_gpu_cluster

    if cupy.cuda.runtime.getDeviceCount() >= 2:
        # One worker per GPU, each seeing its own GPU first in CUDA_VISIBLE_DEVICES: the plugin
        # builds each pool on device 0 of what the worker sees, i.e. its own GPU.
        try:
            import dask_cuda

            return dask_cuda.LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", threads_per_worker=1)
        except ImportError:
            return local_gpu_cluster(gpus=[0, 1])
    return LocalCluster(n_workers=2, threads_per_worker=1, processes=True)


def main() -> int:
    import cupy
    import dask.array as da
    from distributed import Client

    from poolkeeper.integrations.dask import PoolkeeperSetup, cluster_metrics, cluster_stats

    logs = tempfile.mkdtemp(prefix="poolkeeper-logs-")
    with make_cluster() as cluster, Client(cluster) as client:
        # rmm_pool_size=2GB, rmm_maximum_pool_size=40GB, rmm_log_directory=logs, in poolkeeper terms:
        client.register_plugin(
            PoolkeeperSetup("arena", upstream="device", cupy=True, initial=2 << 30, limit=40 << 30, log_directory=logs)
        )
        rs = da.random.RandomState(0, RandomState=cupy.random.RandomState)
        x = rs.random_sample((12288, 12288), chunks=(2048, 2048)).astype("float32")
        total = float((x @ x.T).sum().compute())
        print(f"sum(x @ x.T) = {total:.6g}")
        for addr, s in sorted(cluster_stats(client).items()):
            print(f"{addr}: GPU {s['device']['physical']}  reserved {s['reserved_bytes'] / 2**30:.2f} GiB  "
                  f"peak live {s['peak_live_bytes'] / 2**30:.2f} GiB  upstream calls {s['upstream_allocations']}  "
                  f"log {s['log_path']}")
        print("metrics on the scheduler:", cluster_metrics(client))
    print(f"replay a worker's log: poolkeeper replay {logs}/poolkeeper_<worker>_<pid>.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
