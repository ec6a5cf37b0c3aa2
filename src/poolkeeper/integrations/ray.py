"""poolkeeper in every Ray worker process.

Ray runs a ``worker_process_setup_hook`` (a ``runtime_env`` field) in each worker process it
starts. :func:`runtime_env` returns that field, with the pool's settings carried in an
environment variable, for ``ray.init(runtime_env=...)``, ``@ray.remote(runtime_env=...)`` or
``.options(runtime_env=...)``:

    import ray
    from poolkeeper.integrations import ray as pkr

    ray.init(runtime_env=pkr.runtime_env("arena", upstream="device", torch=True, limit=60 << 30))

    @ray.remote(num_gpus=1)
    class Server:
        def __init__(self):
            pkr.worker_pool()          # first thing: builds the pool, installs the torch allocator
            import torch
            self.model = ...           # every CUDA tensor now comes from the worker's pool
        def stats(self):
            return pkr.worker_stats()

The settings are checked by :func:`runtime_env`, in the driver, with the same checks the pools
make: a bad option raises a typed :mod:`poolkeeper.errors` error before any worker starts.

When the pool is built: with ``upstream="host"`` or ``"simulated"``, in the hook. With a device
upstream, on the first :func:`worker_pool` call, because Ray assigns a GPU to a task or actor
(and sets ``CUDA_VISIBLE_DEVICES`` for it) after the worker process has started and run its hook;
the pool goes on device 0 of what is then visible, the worker's own GPU. For ``torch=True`` that
first call must come before the actor or task initializes CUDA (else
:class:`~poolkeeper.integrations._common.AllocatorInitializedError`).

The pool is closed (and its log completed) when the worker process exits normally. Importing this
module does not import ray.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Mapping
from typing import Any, Dict, Optional

from poolkeeper.errors import InvalidArgumentError, brief
from poolkeeper.integrations._common import IntegrationError
from poolkeeper.integrations._worker import CUDA_UPSTREAMS, WorkerPoolSpec, WorkerPoolState

ENV_VAR = "POOLKEEPER_RAY_WORKER_POOL"
HOOK = "poolkeeper.integrations.ray.setup_worker"

_LOCK = threading.Lock()
_SPEC: Optional[WorkerPoolSpec] = None
_STATE: Optional[WorkerPoolState] = None
_ATEXIT = False


def runtime_env(
    pool: str = "arena", upstream: Optional[str] = None, *, base: Optional[Dict[str, Any]] = None, **settings: Any
) -> Dict[str, Any]:
    """A Ray ``runtime_env`` whose workers each build one poolkeeper pool.

    Arguments as :class:`~poolkeeper.integrations._worker.WorkerPoolSpec` (and
    :class:`poolkeeper.integrations.dask.PoolkeeperSetup`); ``base``: a runtime_env to extend
    (its ``env_vars`` are kept; a ``worker_process_setup_hook`` of its own is refused: Ray runs
    only one).

    Raises :class:`~poolkeeper.errors.InvalidArgumentError` for a bad kind, upstream, size or
    pool option, and :class:`IntegrationError` when ``base`` has a setup hook already.
    """
    if isinstance(settings.get("log_directory"), os.PathLike):  # anything else: the spec's own check
        settings["log_directory"] = os.fspath(settings["log_directory"])
    args = dict(pool=pool, upstream=upstream, **settings)
    WorkerPoolSpec(**args)  # the pools' own checks, now, in the driver
    # A list or a string as base (or as its env_vars) raised dict()'s bare TypeError/ValueError.
    if base is not None and not isinstance(base, Mapping):
        raise InvalidArgumentError(f"base must be a runtime_env dict or None; got {brief(base)}")
    if base is not None and base.get("env_vars") is not None and not isinstance(base["env_vars"], Mapping):
        raise InvalidArgumentError(f"base['env_vars'] must be a dict of variables; got {brief(base['env_vars'])}")
    env = dict(base or {})
    if env.get("worker_process_setup_hook") not in (None, HOOK):
        raise IntegrationError(
            "the runtime_env already has a worker_process_setup_hook; Ray runs one per worker: call "
            f"{HOOK}() from yours instead (with the {ENV_VAR} variable from this function's env_vars)"
        )
    env["worker_process_setup_hook"] = HOOK
    try:
        text = json.dumps(args)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"pool options must be plain numbers, strings or booleans to reach Ray workers: {e}") from None
    env["env_vars"] = {**dict(env.get("env_vars") or {}), ENV_VAR: text}
    return env


def setup_worker() -> Optional[WorkerPoolState]:
    """The setup hook: read the settings from the environment, build the pool now when it needs
    no GPU (later, on first :func:`worker_pool`, otherwise). Returns the state when built."""
    global _SPEC
    text = os.environ.get(ENV_VAR)
    if not text:
        raise IntegrationError(f"{HOOK} needs {ENV_VAR} (use poolkeeper.integrations.ray.runtime_env())")
    spec = _spec_from_env(text)
    with _LOCK:
        _SPEC = spec
    _register_exit()
    if spec.upstream in CUDA_UPSTREAMS:
        return None
    return _build()


def _spec_from_env(text: str) -> WorkerPoolSpec:
    # The variable is runtime_env()'s JSON, but anyone can set it: text that is not a JSON object
    # of settings raised json's ValueError or a bare TypeError in every worker.
    try:
        args = json.loads(text)
    except ValueError as e:
        raise IntegrationError(f"{ENV_VAR} does not hold runtime_env()'s settings: not JSON ({e})") from None
    if not isinstance(args, dict):
        raise IntegrationError(f"{ENV_VAR} does not hold runtime_env()'s settings: a JSON object is needed, got {brief(args)}")
    return WorkerPoolSpec(**args)


def _register_exit() -> None:
    global _ATEXIT
    with _LOCK:
        if not _ATEXIT:
            atexit.register(close_worker_pool)
            _ATEXIT = True


def _build() -> WorkerPoolState:
    global _STATE
    with _LOCK:
        if _STATE is not None:
            return _STATE
        spec = _SPEC
        if spec is None:
            if os.environ.get(ENV_VAR):
                spec = _spec_from_env(os.environ[ENV_VAR])
            else:
                raise IntegrationError(
                    "this process has no poolkeeper worker pool: start the workers with "
                    "runtime_env=poolkeeper.integrations.ray.runtime_env(...)"
                )
        _STATE = spec.build(f"ray-{os.getpid()}", where=f"Ray worker process {os.getpid()}")
    _register_exit()
    return _STATE


def worker_pool() -> Any:
    """This worker process's pool, built on the first call when the upstream is a device.
    Raises :class:`IntegrationError` in a process not started with :func:`runtime_env`."""
    st = _STATE
    return st.pool if st is not None else _build().pool


def worker_stats() -> Dict[str, Any]:
    """This worker's pool stats, plus ``pool``, ``upstream``, ``device``, ``pid``, ``log_path``."""
    st = _STATE if _STATE is not None else _build()
    return st.stats()


def close_worker_pool() -> Optional[Dict[str, Any]]:
    """Close this process's pool (runs at exit; returns what :meth:`WorkerPoolState.close`
    found, or None without a pool). Blocks still live are reported, never freed."""
    global _STATE
    with _LOCK:
        st, _STATE = _STATE, None
    return st.close() if st is not None else None


__all__ = ["runtime_env", "setup_worker", "worker_pool", "worker_stats", "close_worker_pool", "ENV_VAR", "HOOK"]
