"""PoolkeeperSetup on real GPUs: CuPy (and PyTorch) arrays in Dask tasks come from each worker's
pool, one pool per worker, figures per worker.

With two GPUs: one worker per GPU (dask-cuda's LocalCUDACluster when installed, else
poolkeeper.integrations.dask.local_gpu_cluster, the same CUDA_VISIBLE_DEVICES arrangement), each
pool on its own device. With one GPU: two worker processes share it. Each case runs in its own interpreter (the
cluster's workers are fresh processes anyway; the driver must not have touched CUDA through
torch before the torch case).
"""
from __future__ import annotations

import importlib.util

import pytest

from isolated import run_isolated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("distributed") is None, reason="needs dask/distributed"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs cupy"),
]

PRELUDE = """
import os, gc
from distributed import Client, LocalCluster
import poolkeeper as pk
from poolkeeper.integrations import dask as pkd

def make_cluster():
    try:
        import dask_cuda
    except ImportError:
        dask_cuda = None
    n = _count()
    if n >= 2:
        if dask_cuda is not None:
            return dask_cuda.LocalCUDACluster(CUDA_VISIBLE_DEVICES="0,1", threads_per_worker=1, dashboard_address=None), True
        return pkd.local_gpu_cluster(gpus=[0, 1]), True
    return LocalCluster(processes=True, n_workers=2, threads_per_worker=1, dashboard_address=None), False

def _count():
    import cupy
    return cupy.cuda.runtime.getDeviceCount()

def cupy_task(n):
    import cupy
    pool = pkd.worker_pool()
    a = cupy.arange(n, dtype=cupy.float32)
    owned = pool.owns(a.data.ptr)
    live = pool.stats()["live_bytes"]
    s = float(a.sum())
    bus = cupy.cuda.runtime.deviceGetPCIBusId(cupy.cuda.runtime.getDevice())
    del a
    return dict(pid=os.getpid(), owned=owned, live=live, sum=s, bus=bus,
                visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
"""


def test_cupy_arrays_come_from_each_workers_pool():
    out = run_isolated(
        PRELUDE
        + """
cluster, per_gpu = make_cluster()
with cluster, Client(cluster) as client:
    client.register_plugin(pkd.PoolkeeperSetup("arena", upstream="device", cupy=True, limit=8 << 30))
    n = 1 << 20
    res = client.gather(client.map(cupy_task, [n] * 16, pure=False))
    assert all(r["owned"] for r in res), res
    assert all(r["live"] >= 4 * n for r in res), res
    assert all(r["sum"] == float(n * (n - 1) // 2) for r in res), res
    pids = {r["pid"] for r in res}
    assert len(pids) == 2, res
    stats = pkd.cluster_stats(client)
    assert len(stats) == 2 and all(s is not None for s in stats.values())
    for s in stats.values():
        assert s["pool"] == "ArenaPool" and s["upstream"] == "device" and s["device"]["device"] == 0
        assert s["peak_live_bytes"] >= 4 * n and s["upstream_allocations"] >= 1
    buses = {r["pid"]: r["bus"] for r in res}
    if per_gpu:  # LocalCUDACluster: one GPU per worker, each pool on its own device
        assert len(set(buses.values())) == 2, buses
        assert len({s["device"]["physical"] for s in stats.values()}) == 2, stats
    import time
    t0 = time.time()
    while time.time() - t0 < 15:
        m = pkd.cluster_metrics(client)
        if len(m) == 2 and all(v.get("peak_live_bytes", 0) >= 4 * n for v in m.values()):
            break
        time.sleep(0.3)
    assert len(m) == 2 and all(v["peak_live_bytes"] >= 4 * n for v in m.values()), m
    client.unregister_worker_plugin(pkd.PLUGIN_NAME)
    reports = client.run(pkd._teardown_report)
    assert all(r["closed"] and r["live_bytes"] == 0 for r in reports.values()), reports
    print("PER_GPU", per_gpu, "BUSES", sorted(set(buses.values())))
    for a, s in stats.items():
        print("WORKER", a, s["device"], "reserved", s["reserved_bytes"], "peak_live", s["peak_live_bytes"],
              "upstream_allocations", s["upstream_allocations"])
""",
        timeout=300,
    )
    print(out)


def test_torch_tensors_in_tasks_come_from_the_workers_pool():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    out = run_isolated(
        PRELUDE
        + """
def torch_task(n):
    import torch
    pool = pkd.worker_pool()
    t = torch.ones(n, device="cuda")
    owned = pool.owns(t.data_ptr())
    s = float(t.sum())
    del t
    return owned, s, os.getpid()

cluster, per_gpu = make_cluster()
with cluster, Client(cluster) as client:
    client.register_plugin(pkd.PoolkeeperSetup("arena", upstream="device", torch=True, cupy=True))
    res = client.gather(client.map(torch_task, [1 << 20] * 8, pure=False))
    assert all(o for o, _, _ in res) and all(s == float(1 << 20) for _, s, _ in res), res
    assert all(r["owned"] for r in client.gather(client.map(cupy_task, [1 << 16] * 4, pure=False)))
    stats = pkd.cluster_stats(client)
    assert all(s["peak_live_bytes"] >= 4 << 20 for s in stats.values()), stats
    client.unregister_worker_plugin(pkd.PLUGIN_NAME)
    reports = client.run(pkd._teardown_report)
    # PyTorch keeps its allocator for the life of the process: the pool is reported, not closed
    assert all(not r["closed"] and "torch" in r["notes"] for r in reports.values()), reports
    print("OK torch", {a: s["peak_live_bytes"] for a, s in stats.items()})
""",
        timeout=300,
    )
    print(out)


def test_torch_after_cuda_init_fails_register_plugin_clearly():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    run_isolated(
        PRELUDE
        + """
from poolkeeper.integrations._common import AllocatorInitializedError

def init_cuda(dask_worker=None):
    import torch
    torch.zeros(1, device="cuda")
    return True

cluster, _ = make_cluster()
with cluster, Client(cluster) as client:
    client.run(init_cuda)
    try:
        client.register_plugin(pkd.PoolkeeperSetup("arena", upstream="device", torch=True))
    except AllocatorInitializedError as e:
        assert "before CUDA is initialized" in str(e), e
    else:
        raise AssertionError("expected AllocatorInitializedError")
""",
        timeout=300,
    )
