"""poolkeeper on every Dask worker.

:class:`PoolkeeperSetup` is a ``distributed`` worker plugin: registered once from the client, it
builds one pool per worker process, on the worker's device (index 0 within
``CUDA_VISIBLE_DEVICES``, which dask-cuda's ``LocalCUDACluster`` sets per worker), routes CuPy and/or
PyTorch to it when asked, reports the pool's figures as worker metrics, and closes it on teardown.

    from distributed import Client, LocalCluster
    from poolkeeper.integrations.dask import PoolkeeperSetup, worker_pool, cluster_stats

    client = Client(LocalCluster(n_workers=2, threads_per_worker=1))
    client.register_plugin(PoolkeeperSetup("arena", upstream="device", cupy=True, limit=40 << 30))
    ...                                   # CuPy arrays in tasks now come from each worker's pool
    cluster_stats(client)                 # {worker address: stats}

Options are checked when the plugin is made, with the same checks the pools make, so a bad one
raises a typed :mod:`poolkeeper.errors` error in the client before any worker sees it. A worker
that cannot host the pool (no CUDA driver for ``upstream="device"``, CUDA already initialized for
``torch=True``) makes ``register_plugin`` raise :class:`~poolkeeper.integrations._common.IntegrationError`
(or :class:`~poolkeeper.integrations._common.AllocatorInitializedError`) naming the worker.

Importing this module imports ``distributed``; importing poolkeeper does not.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional, Sequence

from poolkeeper.integrations._common import IntegrationError, import_optional
from poolkeeper.integrations._worker import METRIC_KEYS, WorkerPoolSpec, WorkerPoolState

distributed = import_optional("distributed", "poolkeeper.integrations.dask", "dask")

PLUGIN_NAME = "poolkeeper"
METRIC_NAME = "poolkeeper"

_LOCK = threading.Lock()
_STATES: Dict[str, WorkerPoolState] = {}  # worker address -> its pool (one per worker)
_TEARDOWNS: Dict[str, Dict[str, Any]] = {}  # worker address -> what teardown found


class PoolkeeperSetup(distributed.WorkerPlugin):
    """Build one poolkeeper pool per Dask worker.

    Args: as :class:`~poolkeeper.integrations._worker.WorkerPoolSpec`: ``pool`` (a kind of
    :data:`poolkeeper.pools.KINDS`, default ``"arena"``), ``upstream`` (``"device"``, ``"async"``,
    ``"virtual"``, or, without a GPU, ``"host"`` / ``"simulated"``; None: the kind's default),
    ``limit`` (``rmm_maximum_pool_size``), ``initial`` (``rmm_pool_size``), ``torch``, ``cupy``,
    ``log_directory`` (``rmm_log_directory``), ``release_threshold`` (``rmm_release_threshold``)
    and the pool's own options. Sizes may also be strings Dask parses (``"40GB"``, ``"512MiB"``),
    as dask-cuda's are.

    Raises (here, in the client): :class:`~poolkeeper.errors.InvalidArgumentError` for a bad
    kind, upstream, size or pool option.
    """

    idempotent = False
    name = PLUGIN_NAME

    def __init__(self, pool: str = "arena", upstream: Optional[str] = None, **settings: Any) -> None:
        for key in _SIZES:
            if key in settings:
                settings[key] = _bytes(key, settings[key])
        self.spec = WorkerPoolSpec(pool=pool, upstream=upstream, **settings)

    def __repr__(self) -> str:
        return f"PoolkeeperSetup({self.spec.describe()})"

    def setup(self, worker: Any) -> None:
        addr = worker.address
        with _LOCK:
            old = _STATES.pop(addr, None)
        if old is not None:  # re-registered: replace the previous pool
            old.close()
        state = self.spec.build(str(worker.name), where=f"Dask worker {worker.name} ({addr})")
        with _LOCK:
            _STATES[addr] = state
            _TEARDOWNS.pop(addr, None)
        worker.metrics[METRIC_NAME] = _metric(addr)

    def teardown(self, worker: Any) -> None:
        addr = worker.address
        worker.metrics.pop(METRIC_NAME, None)
        with _LOCK:
            state = _STATES.pop(addr, None)
        if state is not None:
            _TEARDOWNS[addr] = state.close()


_SIZES = ("limit", "initial", "release_threshold")  # settings given in bytes


def _bytes(name: str, v: Any) -> Any:
    if not isinstance(v, str):
        return v
    from dask.utils import parse_bytes

    from poolkeeper.errors import InvalidArgumentError, brief

    # Dask reads a size without a number as one unit: "" (an unset environment variable passed
    # on) was a limit of 1 byte, which refused every allocation.
    if not any(c.isdigit() for c in v):
        raise InvalidArgumentError(f"{name}: cannot read {brief(v)} as a size (no number in it)")
    try:
        return int(parse_bytes(v))
    except (ValueError, TypeError, OverflowError) as e:  # OverflowError: "1e400" is a float infinity
        raise InvalidArgumentError(f"{name}: cannot read {brief(v)} as a size ({e})") from None


def _metric(addr: str):
    # A callable of the worker, as distributed's Worker.metrics wants; it reads the pool's
    # counters (exact, lock-free) on every heartbeat.
    def poolkeeper_metric(worker: Any) -> Dict[str, int]:
        st = _STATES.get(addr)
        return st.metrics() if st is not None else {}

    return poolkeeper_metric


def _state_for(worker: Any) -> WorkerPoolState:
    st = _STATES.get(worker.address)
    if st is None:
        raise IntegrationError(
            f"Dask worker {worker.address} has no poolkeeper pool: register PoolkeeperSetup first "
            "(client.register_plugin(PoolkeeperSetup(...)))"
        )
    return st


def worker_pool(dask_worker: Any = None) -> Any:
    """The pool of the worker running the current task (or of ``dask_worker``, which
    ``client.run`` passes). Outside a task (``client.run``, a thread a task started), the pool of
    the one worker in this process. Raises :class:`IntegrationError` outside any worker or on a
    worker without :class:`PoolkeeperSetup`."""
    worker = dask_worker
    if worker is None:
        try:
            worker = distributed.get_worker()
        except ValueError:
            with _LOCK:
                states = list(_STATES.values())
            if len(states) == 1:
                return states[0].pool
            raise IntegrationError(
                "worker_pool() must run inside a Dask task on a worker with PoolkeeperSetup registered"
                + (f" ({len(states)} workers in this process: pass dask_worker)" if states else "")
            ) from None
    return _state_for(worker).pool


def worker_stats(dask_worker: Any = None) -> Dict[str, Any]:
    """This worker's pool stats (for ``client.run(worker_stats)``)."""
    worker = dask_worker if dask_worker is not None else distributed.get_worker()
    return _state_for(worker).stats()


def _stats_or_none(dask_worker: Any) -> Optional[Dict[str, Any]]:
    st = _STATES.get(dask_worker.address)
    return st.stats() if st is not None else None


def _has_metric(dask_worker: Any) -> bool:
    return METRIC_NAME in dask_worker.metrics


def _teardown_report(dask_worker: Any) -> Optional[Dict[str, Any]]:
    return _TEARDOWNS.get(dask_worker.address)


def cluster_stats(client: Any) -> Dict[str, Optional[Dict[str, Any]]]:
    """Every worker's pool stats: ``{worker address: stats}`` (None for a worker without a
    pool). Each entry has the pool's figures plus ``pool``, ``upstream``, ``device``, ``pid`` and
    ``log_path``."""
    return client.run(_stats_or_none)


def cluster_metrics(client: Any) -> Dict[str, Dict[str, int]]:
    """The figures the workers last sent the scheduler as the ``poolkeeper`` metric (what the
    dashboard's worker table shows)."""
    info = client.scheduler_info(n_workers=-1) if "n_workers" in _params(client.scheduler_info) else client.scheduler_info()
    return {addr: w.get("metrics", {}).get(METRIC_NAME, {}) for addr, w in info["workers"].items()}


def local_gpu_cluster(gpus: Optional[Sequence[Any]] = None, threads_per_worker: int = 1,
                      dashboard_address: Optional[str] = None) -> Any:
    """A local cluster with one worker process per GPU, each worker seeing its own GPU first in
    ``CUDA_VISIBLE_DEVICES`` -- the arrangement dask-cuda's ``LocalCUDACluster`` makes, for hosts
    without dask-cuda. With :class:`PoolkeeperSetup`, each worker's pool lands on its own GPU.

    ``gpus``: the devices (indices or UUIDs as ``CUDA_VISIBLE_DEVICES`` takes them); default:
    those in ``CUDA_VISIBLE_DEVICES``, else ``0 .. device_count - 1``. Raises
    :class:`IntegrationError` when there is no GPU.
    """
    if gpus is None:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis:
            gpus = [g.strip() for g in vis.split(",") if g.strip()]
        else:
            try:
                from poolkeeper.cuda import device_count

                gpus = list(range(device_count()))
            except Exception as e:
                raise IntegrationError(f"local_gpu_cluster: cannot count the GPUs ({e})") from None
    ids = [str(g) for g in gpus]
    if not ids:
        raise IntegrationError("local_gpu_cluster: no GPU to put a worker on")
    workers = {
        f"gpu-{g}": {
            "cls": distributed.Nanny,
            "options": {"nthreads": threads_per_worker, "env": {"CUDA_VISIBLE_DEVICES": ",".join(ids[i:] + ids[:i])}},
        }
        for i, g in enumerate(ids)
    }
    return distributed.SpecCluster(
        scheduler={
            "cls": distributed.Scheduler,
            # None means no dashboard (as LocalCluster reads it), not the default port
            "options": {"dashboard": dashboard_address is not None, "dashboard_address": dashboard_address},
        },
        workers=workers,
    )


def _params(fn: Any) -> Any:
    import inspect

    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return {}


__all__ = [
    "PoolkeeperSetup",
    "worker_pool",
    "worker_stats",
    "cluster_stats",
    "cluster_metrics",
    "local_gpu_cluster",
    "PLUGIN_NAME",
    "METRIC_NAME",
    "METRIC_KEYS",
]
