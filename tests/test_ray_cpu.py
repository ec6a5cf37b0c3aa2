"""poolkeeper.integrations.ray: the runtime_env helper and setup hook in-process (always), and on
a local Ray cluster with Host/Simulated upstreams (when ray is installed; it is not in the test
extra: about 80 MB and 90 s to install)."""
from __future__ import annotations

import json
import os

import pytest

from poolkeeper.bench.replay import replay_log
from poolkeeper.errors import InvalidArgumentError
from poolkeeper.integrations import ray as pkr
from poolkeeper.integrations._common import IntegrationError

MiB = 1 << 20


@pytest.fixture
def fresh(monkeypatch):
    """The module's per-process state, reset around an in-process test."""
    monkeypatch.setattr(pkr, "_SPEC", None)
    monkeypatch.setattr(pkr, "_STATE", None)
    monkeypatch.setattr(pkr, "_ATEXIT", True)  # no exit handler for the test process
    yield
    pkr.close_worker_pool()


def test_runtime_env_checks_options_in_the_driver():
    with pytest.raises(InvalidArgumentError, match="unknown option 'no_such_option'"):
        pkr.runtime_env("arena", upstream="host", no_such_option=1)
    with pytest.raises(InvalidArgumentError, match="unknown upstream"):
        pkr.runtime_env("arena", upstream="tpu")
    with pytest.raises(InvalidArgumentError, match="device upstream"):
        pkr.runtime_env("arena", upstream="simulated", torch=True)
    with pytest.raises(InvalidArgumentError, match="release_threshold"):
        pkr.runtime_env("arena", upstream="device", release_threshold=0)
    with pytest.raises(IntegrationError, match="already has a worker_process_setup_hook"):
        pkr.runtime_env("arena", upstream="host", base={"worker_process_setup_hook": "mine.hook"})


def test_runtime_env_keeps_the_base_and_carries_the_settings():
    env = pkr.runtime_env("size_class", upstream="host", limit=64 * MiB, classes_per_doubling=2,
                          base={"env_vars": {"A": "1"}, "pip": ["x"]})
    assert env["worker_process_setup_hook"] == pkr.HOOK and env["pip"] == ["x"] and env["env_vars"]["A"] == "1"
    args = json.loads(env["env_vars"][pkr.ENV_VAR])
    assert args["pool"] == "size_class" and args["limit"] == 64 * MiB and args["classes_per_doubling"] == 2


def test_setup_hook_in_process(fresh, monkeypatch, tmp_path):
    env = pkr.runtime_env("arena", upstream="simulated", log_directory=str(tmp_path), max_backing=16 * MiB)
    monkeypatch.setenv(pkr.ENV_VAR, env["env_vars"][pkr.ENV_VAR])
    state = pkr.setup_worker()
    assert state is not None and pkr.worker_pool() is state.pool
    pool = pkr.worker_pool()
    pool.deallocate(pool.allocate(3 * MiB))
    st = pkr.worker_stats()
    assert st["pool"] == "Logging(ArenaPool)" and st["pid"] == os.getpid() and st["log_events"] == 2
    report = pkr.close_worker_pool()
    assert report["closed"] and report["live_bytes"] == 0
    r = replay_log(st["log_path"], ["arena"], "host")["pools"]["arena"]
    assert r["counts"]["allocations"] == 1 and r["peak_live_bytes"] == 3 * MiB


def test_device_upstream_waits_for_the_first_worker_pool_call(fresh, monkeypatch):
    env = pkr.runtime_env("arena", upstream="device")
    monkeypatch.setenv(pkr.ENV_VAR, env["env_vars"][pkr.ENV_VAR])
    assert pkr.setup_worker() is None and pkr._STATE is None  # no GPU assigned yet
    if _has_cuda():
        pytest.skip("this machine has a CUDA driver")
    with pytest.raises(IntegrationError, match="cannot host a poolkeeper pool over the 'device' upstream"):
        pkr.worker_pool()


def _has_cuda():
    import poolkeeper as pk

    try:
        pk.upstream.CudaDevice(0)
        return True
    except pk.PoolkeeperError:
        return False


def test_worker_pool_outside_a_configured_process(fresh, monkeypatch):
    monkeypatch.delenv(pkr.ENV_VAR, raising=False)
    with pytest.raises(IntegrationError, match="runtime_env"):
        pkr.worker_pool()


# -- on a local Ray cluster -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    logs = tmp_path_factory.mktemp("raylogs")
    env = pkr.runtime_env("arena", upstream="simulated", log_directory=str(logs))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=env, logging_level="ERROR",
             log_to_driver=False, configure_logging=False)
    try:
        yield ray, logs
    finally:
        ray.shutdown()


def test_ray_tasks_and_actors_get_their_worker_pool(ray_cluster):
    ray, logs = ray_cluster

    @ray.remote
    def task(n):
        built_by_hook = pkr._STATE is not None
        pool = pkr.worker_pool()
        p = pool.allocate(n)
        live = pool.stats()["live_bytes"]
        pool.deallocate(p)
        return os.getpid(), pool.id, built_by_hook, live

    results = ray.get([task.remote(MiB * (i + 1)) for i in range(6)])
    assert all(built for _, _, built, _ in results)
    assert sorted(live for *_, live in results) == [MiB * (i + 1) for i in range(6)]
    by_pid = {}
    for pid, pool_id, _, _ in results:
        by_pid.setdefault(pid, set()).add(pool_id)
    assert all(len(ids) == 1 for ids in by_pid.values())  # one pool per worker process

    @ray.remote
    class Holder:
        def __init__(self):
            self.pool = pkr.worker_pool()
            self.held = []

        def grab(self, n):
            self.held.append(self.pool.allocate(n))
            return pkr.worker_stats()["live_bytes"]

        def finish(self):
            for p in self.held:
                self.pool.deallocate(p)
            stats = pkr.worker_stats()
            return stats, pkr.close_worker_pool()

    h = Holder.remote()
    assert ray.get(h.grab.remote(2 * MiB)) == 2 * MiB
    assert ray.get(h.grab.remote(MiB)) == 3 * MiB
    stats, report = ray.get(h.finish.remote())
    assert report["closed"] and report["live_bytes"] == 0
    assert stats["peak_live_bytes"] == 3 * MiB and os.path.dirname(stats["log_path"]) == str(logs)
    r = replay_log(stats["log_path"], ["arena"], "host")["pools"]["arena"]
    assert r["counts"]["allocations"] == r["counts"]["frees"] == stats["log_events"] // 2
    assert r["peak_live_bytes"] == 3 * MiB


@pytest.mark.parametrize("text", ["{", "[1]", "null", "3", '"arena"'])
def test_regression_a_malformed_worker_settings_variable_raised_bare_json_or_type_errors(fresh, monkeypatch, text):
    # Found by hostile probing: the hook parsed the variable with json.loads(...) and ** without a
    # check, so text that is not a JSON object raised json's ValueError or a bare TypeError in
    # every worker.
    monkeypatch.setenv(pkr.ENV_VAR, text)
    with pytest.raises(IntegrationError, match=pkr.ENV_VAR):
        pkr.setup_worker()
    with pytest.raises(IntegrationError, match=pkr.ENV_VAR):
        pkr.worker_pool()


@pytest.mark.parametrize("kw", [dict(base=[("pip", "x")]), dict(base="x"), dict(base={"env_vars": [("A", "1")]}),
                                dict(log_directory=3)])
def test_regression_runtime_env_with_a_bad_base_or_log_directory_raised_bare_type_or_value_errors(kw):
    # Found by hostile probing: dict(base) and os.fspath(log_directory) ran before any check.
    with pytest.raises(InvalidArgumentError):
        pkr.runtime_env("arena", upstream="simulated", **kw)


def test_regression_a_log_directory_that_cannot_be_made_raised_a_bare_os_error(tmp_path):
    # Found by hostile probing: os.makedirs' FileExistsError (a file in the way) escaped from the
    # worker's setup; it is the IntegrationError naming the worker that build() documents.
    from poolkeeper.integrations._worker import WorkerPoolSpec

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spec = WorkerPoolSpec("arena", "simulated", log_directory=str(blocker))
    with pytest.raises(IntegrationError, match="worker w1 cannot write its log"):
        spec.build("w1")


def test_regression_initial_beyond_the_device_was_silently_a_pool_of_256_bytes():
    # Found by hostile probing: the arena asks again for just the request when the device refuses
    # a ramp backing, so initial= (rmm_pool_size) larger than the device reserved 256 bytes and
    # the worker started as if its pool were there. The simulated device holds 140 GiB.
    from poolkeeper.integrations._worker import WorkerPoolSpec

    with pytest.raises(IntegrationError, match="cannot reserve initial=1099511627776"):
        WorkerPoolSpec("arena", "simulated", initial=1 << 40).build("w1")
    state = WorkerPoolSpec("arena", "simulated", initial=64 * MiB).build("w2")
    assert state.pool.stats()["reserved_bytes"] == 64 * MiB
    assert state.close()["closed"]


class _UnprintableFlag:
    def __repr__(self):
        raise RuntimeError("repr refused")


@pytest.mark.parametrize("settings", [
    dict(limit=-10 ** 5000), dict(initial=-10 ** 5000),
    dict(upstream="async", release_threshold=-10 ** 5000), dict(upstream="async", release_threshold=1 << 64),
    dict(upstream="async", release_threshold=10 ** 5000),
    dict(torch=_UnprintableFlag()), dict(limit=_UnprintableFlag()), dict(log_directory=_UnprintableFlag()),
    dict(pool=_UnprintableFlag()),
], ids=["limit huge negative", "initial huge negative", "threshold huge negative", "threshold 2**64",
        "threshold huge", "torch unprintable", "limit unprintable", "log_directory unprintable", "pool unprintable"])
def test_regression_a_worker_setting_with_a_huge_or_unprintable_value_was_a_bare_error_or_passed(settings):
    # Found by review: the messages quoted the value with repr(), which raises for an int of more
    # than 4,300 digits (ValueError) and for an object whose __repr__ raises; release_threshold
    # 2**64 or more passed the driver's check and failed in every worker (nanobind's TypeError
    # setting the driver's attribute).
    from poolkeeper.errors import InvalidArgumentError
    from poolkeeper.integrations._worker import WorkerPoolSpec

    with pytest.raises(InvalidArgumentError):
        WorkerPoolSpec(**settings)
