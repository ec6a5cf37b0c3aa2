"""poolkeeper.integrations.dask on a 2-worker LocalCluster (processes), Host/Simulated upstreams.

One cluster for the module (starting one costs seconds); each test registers the plugin and
unregisters it (teardown) before the next.
"""
from __future__ import annotations

import os
import time

import pytest

distributed = pytest.importorskip("distributed")

import poolkeeper as pk  # noqa: E402
from poolkeeper.bench.replay import replay_log  # noqa: E402
from poolkeeper.errors import InvalidArgumentError  # noqa: E402
from poolkeeper.integrations._common import IntegrationError  # noqa: E402
from poolkeeper.integrations import dask as pkd  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(
        processes=True, n_workers=2, threads_per_worker=1, dashboard_address=None, worker_dashboard_address=None
    )
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()


@pytest.fixture
def registered(client):
    """Register a plugin (the test gives its arguments) and unregister it afterwards."""
    names = []

    def register(**kw):
        client.register_plugin(pkd.PoolkeeperSetup(**kw))
        names.append(pkd.PLUGIN_NAME)

    yield register
    for n in names:
        try:
            client.unregister_worker_plugin(n)
        except Exception:
            pass


def alloc_free(sizes):
    pool = pkd.worker_pool()
    ptrs = [pool.allocate(n) for n in sizes]
    live = pool.stats()["live_bytes"]
    for p in ptrs:
        pool.deallocate(p)
    return os.getpid(), pool.id, live


def test_bad_options_fail_in_the_client_with_typed_errors():
    with pytest.raises(InvalidArgumentError, match="unknown option 'no_such_option'"):
        pkd.PoolkeeperSetup("arena", upstream="host", no_such_option=1)
    with pytest.raises(InvalidArgumentError, match="unknown pool kind"):
        pkd.PoolkeeperSetup("nope", upstream="host")
    with pytest.raises(InvalidArgumentError, match="unknown upstream"):
        pkd.PoolkeeperSetup("arena", upstream="gpu")
    with pytest.raises(InvalidArgumentError, match="device upstream"):
        pkd.PoolkeeperSetup("arena", upstream="host", cupy=True)
    with pytest.raises(InvalidArgumentError, match="exceeds limit"):
        pkd.PoolkeeperSetup("arena", upstream="host", initial=2 * MiB, limit=MiB)
    with pytest.raises(InvalidArgumentError, match="growth_factor"):
        pkd.PoolkeeperSetup("arena", upstream="host", growth_factor="fast")
    with pytest.raises(InvalidArgumentError, match="resident"):
        pkd.PoolkeeperSetup("size_class", upstream="host", initial=MiB)
    with pytest.raises(InvalidArgumentError, match="release_threshold"):
        pkd.PoolkeeperSetup("arena", upstream="device", release_threshold=MiB)
    with pytest.raises(InvalidArgumentError, match="cannot read 'lots' as a size"):
        pkd.PoolkeeperSetup("arena", upstream="host", limit="lots")
    # dask-cuda style sizes are read as Dask reads them
    assert pkd.PoolkeeperSetup("arena", upstream="host", limit="2GiB", initial="64MiB").spec.describe()["limit"] == 2 << 30


def test_a_worker_that_cannot_host_the_pool_fails_register_plugin(client):
    if _has_cuda():
        pytest.skip("this machine has a CUDA driver: every worker can host a device pool")
    with pytest.raises(IntegrationError, match="cannot host a poolkeeper pool over the 'device' upstream"):
        client.register_plugin(pkd.PoolkeeperSetup("arena", upstream="device"))
    client.unregister_worker_plugin(pkd.PLUGIN_NAME)
    assert set(pkd.cluster_stats(client).values()) == {None}


def _has_cuda():
    try:
        pk.upstream.CudaDevice(0)
        return True
    except pk.PoolkeeperError:
        return False


def test_one_pool_per_worker_tasks_stats_metrics_and_teardown(client, registered):
    registered(pool="arena", upstream="simulated", limit=512 * MiB, max_backing=64 * MiB)
    futures = client.map(alloc_free, [[MiB, 3 * MiB]] * 8, pure=False)
    results = client.gather(futures)
    pids = {pid for pid, _, _ in results}
    assert len(pids) == 2  # both workers ran tasks
    assert {live for _, _, live in results} == {4 * MiB}
    # one pool per worker process: every task on one worker saw the same pool
    by_pid = {}
    for pid, pool_id, _ in results:
        by_pid.setdefault(pid, set()).add(pool_id)
    assert all(len(ids) == 1 for ids in by_pid.values())

    stats = pkd.cluster_stats(client)
    assert len(stats) == 2
    assert {s["pid"] for s in stats.values()} == pids
    for s in stats.values():
        assert s["pool"] == "ArenaPool" and s["upstream"] == "simulated" and s["limit_bytes"] == 512 * MiB
        assert s["live_bytes"] == 0 and s["peak_live_bytes"] == 4 * MiB
        assert s["reserved_bytes"] == s["live_bytes"] + s["free_bytes"] + s["pending_bytes"] + s["overhead_bytes"]

    # the pool's figures travel to the scheduler as the worker metric "poolkeeper"
    deadline = time.monotonic() + 15
    metrics = {}
    while time.monotonic() < deadline:
        metrics = pkd.cluster_metrics(client)
        if len(metrics) == 2 and all(m.get("peak_live_bytes") == 4 * MiB for m in metrics.values()):
            break
        time.sleep(0.2)
    assert set(metrics) == set(stats)
    for addr, m in metrics.items():
        assert m["reserved_bytes"] == stats[addr]["reserved_bytes"]
        assert set(m) == set(pkd.METRIC_KEYS)

    client.unregister_worker_plugin(pkd.PLUGIN_NAME)
    reports = client.run(pkd._teardown_report)
    assert len(reports) == 2
    for r in reports.values():
        assert r["closed"] is True and r["live_bytes"] == 0 and "error" not in r
    assert set(pkd.cluster_stats(client).values()) == {None}
    assert not any(client.run(pkd._has_metric).values())


def keep_a_block(n):
    import poolkeeper.integrations.dask as mod

    mod._test_leak = pkd.worker_pool().allocate(n)
    return True


def test_teardown_reports_blocks_still_live_and_keeps_the_pool(client, registered):
    registered(pool="size_class", upstream="host")
    assert all(client.run(keep_a_block, 5000).values())
    client.unregister_worker_plugin(pkd.PLUGIN_NAME)
    for r in client.run(pkd._teardown_report).values():
        assert r["closed"] is False and r["live_blocks"] == 1 and r["live_bytes"] >= 5000


def test_worker_restart_rebuilds_the_pool(client, registered):
    registered(pool="arena", upstream="host")
    before = pkd.cluster_stats(client)
    client.run(alloc_free, [MiB])
    client.restart()
    after = pkd.cluster_stats(client)
    assert len(after) == 2 and all(s is not None for s in after.values())
    assert {s["pid"] for s in after.values()}.isdisjoint({s["pid"] for s in before.values()})
    assert all(s["peak_live_bytes"] == 0 and s["pool"] == "ArenaPool" for s in after.values())
    assert {r[2] for r in client.run(alloc_free, [MiB]).values()} == {MiB}


def test_log_directory_writes_one_replayable_log_per_worker(client, registered, tmp_path):
    registered(pool="arena", upstream="simulated", log_directory=str(tmp_path))
    client.gather(client.map(alloc_free, [[MiB, 2 * MiB, 300]] * 6, pure=False))
    stats = pkd.cluster_stats(client)
    paths = {s["log_path"] for s in stats.values()}
    assert len(paths) == 2 and all(os.path.dirname(p) == str(tmp_path) for p in paths)
    client.unregister_worker_plugin(pkd.PLUGIN_NAME)  # closes the pools: the logs are complete
    total = 0
    for s in stats.values():
        r = replay_log(s["log_path"], ["arena"], "host")["pools"]["arena"]
        assert r["counts"]["allocations"] == r["counts"]["frees"] == s["log_events"] // 2
        assert r["peak_live_bytes"] == s["peak_live_bytes"]
        total += r["counts"]["allocations"]
    assert total == 6 * 3


def test_worker_pool_outside_a_worker_is_an_integration_error(client):
    with pytest.raises(IntegrationError, match="must run inside a Dask task"):
        pkd.worker_pool()
    # a task on a worker without the plugin
    fut = client.submit(pkd.worker_pool, pure=False)
    with pytest.raises(IntegrationError, match="register PoolkeeperSetup"):
        fut.result()


def test_local_gpu_cluster_gives_each_worker_its_own_device_first(monkeypatch):
    from poolkeeper.integrations._worker import visible_device

    with pkd.local_gpu_cluster(gpus=["0", "1"]) as cluster, distributed.Client(cluster) as c:
        seen = c.run(visible_device)
    assert sorted(v["cuda_visible_devices"] for v in seen.values()) == ["0,1", "1,0"]
    assert sorted(v["physical"] for v in seen.values()) == ["0", "1"]
    assert all(v["device"] == 0 for v in seen.values())
    if not _has_cuda():
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        with pytest.raises(IntegrationError, match="no GPU"):
            pkd.local_gpu_cluster()


@pytest.mark.parametrize("text", ["", " ", "1e400", "1e400 GB"])
def test_regression_a_size_string_without_a_number_was_one_byte_and_one_past_float_range_an_overflow_error(text):
    # Found by hostile probing: Dask reads a size without a number as one unit, so limit="" (an
    # unset environment variable passed on) was a 1-byte limit that refused every allocation;
    # "1e400" is a float infinity, and int() of it raised a bare OverflowError.
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        pkd.PoolkeeperSetup("arena", upstream="host", limit=text)
