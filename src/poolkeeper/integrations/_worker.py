"""One poolkeeper pool per worker process: what the Dask and Ray integrations share.

:class:`WorkerPoolSpec` holds the user's choices, validated when it is made (so a bad option
fails in the driver, before any worker sees it); :meth:`WorkerPoolSpec.build` makes the pool in
the worker process and routes CuPy / PyTorch to it; :class:`WorkerPoolState.close` undoes that.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from poolkeeper.errors import InvalidArgumentError, LiveBlocksError, PoolkeeperError, brief
from poolkeeper.integrations._common import IntegrationError
from poolkeeper.upstream import CUDA_UPSTREAMS

log = logging.getLogger("poolkeeper.integrations")

# The stats a worker reports as metrics (a small dict: it travels with every heartbeat).
METRIC_KEYS = (
    "reserved_bytes",
    "live_bytes",
    "free_bytes",
    "pending_bytes",
    "peak_reserved_bytes",
    "peak_live_bytes",
    "live_blocks",
    "upstream_allocations",
    "upstream_deallocations",
)


def _size(name: str, v: Any) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        # brief(), not repr(): -10**5000 made the message itself raise ValueError (int digit limit)
        raise InvalidArgumentError(f"{name} must be a positive number of bytes or None; got {brief(v)}")
    return v


def visible_device() -> Dict[str, Any]:
    """The worker's device as CUDA sees it: index 0 within ``CUDA_VISIBLE_DEVICES``, which
    dask-cuda (and Ray, for GPU workers) sets per worker with the worker's own GPU first."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = vis.split(",")[0].strip() if vis else "0"
    return {"device": 0, "cuda_visible_devices": vis, "physical": physical}


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "worker"


@dataclass
class WorkerPoolState:
    """What a worker process set up: its pool, where it logs, what it routed."""

    pool: Any
    upstream: str
    device: Dict[str, Any]
    log_path: Optional[str] = None
    cupy: bool = False
    torch: bool = False
    closed: bool = False
    notes: Dict[str, Any] = field(default_factory=dict)

    def stats(self) -> Dict[str, Any]:
        st = dict(self.pool.stats())
        st["pool"] = self.pool.name
        st["upstream"] = self.upstream
        st["device"] = self.device
        st["pid"] = os.getpid()
        st["log_path"] = self.log_path
        return st

    def metrics(self) -> Dict[str, int]:
        st = self.pool.stats()
        return {k: int(st.get(k) or 0) for k in METRIC_KEYS}

    def close(self) -> Dict[str, Any]:
        """Undo the routing and close the pool. Returns what was found: ``closed``, and the live
        bytes/blocks when blocks were still live (then the pool stays open, reported, never freed
        under a framework that may still use them)."""
        report: Dict[str, Any] = {"closed": False, "live_bytes": 0, "live_blocks": 0, "pid": os.getpid()}
        if self.closed:
            report["closed"] = True
            return report
        if self.cupy:
            from poolkeeper.integrations import cupy as pkc

            pkc.uninstall()
            self.cupy = False
            try:  # blocks CuPy dropped but has not collected yet
                import gc

                gc.collect()
            except Exception:  # pragma: no cover
                pass
        if self.torch:
            # PyTorch cannot swap its allocator back; the pool must outlive the process.
            report["notes"] = "torch: PyTorch keeps using the pool until the process exits"
            st = self.pool.stats()
            report.update(live_bytes=st["live_bytes"], live_blocks=st["live_blocks"])
            if hasattr(self.pool, "flush"):
                self.pool.flush()
            return report
        try:
            self.pool.close()
        except LiveBlocksError as e:
            report.update(live_bytes=getattr(e, "bytes", 0), live_blocks=getattr(e, "blocks", 0), error=str(e))
            log.warning("poolkeeper: worker pool not closed, blocks still live: %s", e)
            return report
        self.closed = True
        report["closed"] = True
        return report


class WorkerPoolSpec:
    """Validated choices for one pool per worker process.

    Args:
        pool: pool kind (:data:`poolkeeper.pools.KINDS`: ``"arena"``, default, ``"arena_expandable"``,
            ``"size_class"``, ``"direct"``).
        upstream: ``"device"`` (``cuMemAlloc`` on the worker's GPU), ``"async"``
            (``cuMemAllocAsync``), ``"virtual"`` (``CudaVirtual``), or, without a GPU, ``"host"`` /
            ``"simulated"``. None (default): the kind's own default, ``"virtual"`` for
            ``arena_expandable`` and ``"device"`` for the others.
        limit: cap on the pool's reserved bytes (dask-cuda's ``rmm_maximum_pool_size``).
        initial: bytes reserved at setup as the arena's resident first backing
            (``rmm_pool_size``).
        torch: make poolkeeper PyTorch's CUDA allocator on the worker (must happen before CUDA
            is initialized in the worker process; otherwise building fails with
            :class:`~poolkeeper.integrations._common.AllocatorInitializedError`).
        cupy: make poolkeeper CuPy's device allocator on the worker.
        log_directory: write each worker's calls as RMM CSV (``poolkeeper_<worker>_<pid>.csv``),
            replayable with ``poolkeeper replay`` (``rmm_log_directory``).
        release_threshold: with ``upstream="async"``, the CUDA pool's release threshold
            (``rmm_release_threshold``).
        **options: the pool's own options (``max_backing=``, ``thread_cache_bytes=``...).

    Raises :class:`~poolkeeper.errors.InvalidArgumentError` for a bad kind, upstream, size or
    pool option.
    """

    def __init__(
        self,
        pool: str = "arena",
        upstream: Optional[str] = None,
        limit: Optional[int] = None,
        initial: Optional[int] = None,
        torch: bool = False,
        cupy: bool = False,
        log_directory: Optional[str] = None,
        release_threshold: Optional[int] = None,
        **options: Any,
    ) -> None:
        from poolkeeper.pools import make_pool, resolve_upstream
        from poolkeeper.upstream import make_upstream

        upstream = resolve_upstream(pool, upstream)  # the kind, the name and the pair
        for flag, v in (("torch", torch), ("cupy", cupy)):
            if not isinstance(v, bool):
                raise InvalidArgumentError(f"{flag} must be True or False; got {brief(v)}")
            if v and upstream not in CUDA_UPSTREAMS:
                raise InvalidArgumentError(
                    f"{flag}=True routes CUDA allocations, so it needs a device upstream "
                    f"({', '.join(map(repr, CUDA_UPSTREAMS))}), not {upstream!r}"
                )
        self.limit = _size("limit", limit)
        self.initial = _size("initial", initial)
        self.release_threshold = None
        if release_threshold is not None:
            if upstream != "async":
                raise InvalidArgumentError("release_threshold applies to upstream='async' (CUDA's stream-ordered pool)")
            # Below 2^64, the driver's attribute: 2**64 passed here and failed in every worker, as
            # nanobind's bare TypeError from setting it.
            if isinstance(release_threshold, bool) or not isinstance(release_threshold, int) \
                    or not 0 <= release_threshold < 1 << 64:
                raise InvalidArgumentError(f"release_threshold must be a byte count in [0, 2^64); got {brief(release_threshold)}")
            self.release_threshold = release_threshold
        if self.initial is not None and self.limit is not None and self.initial > self.limit:
            raise InvalidArgumentError(f"initial ({self.initial}) exceeds limit ({self.limit})")
        if log_directory is not None and not isinstance(log_directory, (str, os.PathLike)):
            raise InvalidArgumentError(f"log_directory must be a path or None; got {brief(log_directory)}")
        self.kind, self.upstream, self.torch, self.cupy = pool, upstream, torch, cupy
        self.log_directory = os.fspath(log_directory) if log_directory is not None else None
        self.options = dict(options)
        # The pools' own option checks, now: a pool over a simulated device costs nothing until
        # it allocates, and refuses an unknown or bad option by name.
        probe = make_pool(pool, make_upstream("simulated", latency_us=0), **self.pool_options())
        probe.close()

    def pool_options(self) -> Dict[str, Any]:
        opts = dict(self.options)
        if self.limit is not None:
            opts["limit"] = self.limit
        if self.initial is not None:
            if self.kind != "arena":
                raise InvalidArgumentError(
                    f"initial= pre-reserves the arena pool's first (resident) backing; pool {self.kind!r} has none"
                )
            # The first backing is the resident one (never shrunk): make it `initial` bytes.
            opts["initial_backing"] = self.initial
            opts["max_backing"] = max(self.initial, opts.get("max_backing") or 128 << 20)
        return opts

    def describe(self) -> Dict[str, Any]:
        return {
            "pool": self.kind,
            "upstream": self.upstream,
            "limit": self.limit,
            "initial": self.initial,
            "torch": self.torch,
            "cupy": self.cupy,
            "log_directory": self.log_directory,
            "release_threshold": self.release_threshold,
            "options": self.options,
        }

    def _make_upstream(self, device: int) -> Any:
        from poolkeeper.upstream import make_upstream

        if self.upstream == "simulated":
            return make_upstream("simulated", latency_us=0)
        if self.release_threshold is not None:  # "async" only (checked when made)
            from poolkeeper.cuda import warm

            u = make_upstream("async", device, warm=False)
            warm.set_release_threshold(device, self.release_threshold)
            return u
        return make_upstream(self.upstream, device)

    def build(self, worker_name: str, where: Optional[str] = None) -> WorkerPoolState:
        """Make this process's pool (and route the frameworks to it). Raises
        :class:`IntegrationError` naming the worker when it cannot host the pool."""
        from poolkeeper.pools import make_pool

        where = where or f"worker {worker_name}"
        dev = visible_device() if self.upstream in CUDA_UPSTREAMS else {"device": -1}
        try:
            upstream = self._make_upstream(dev["device"])
        except PoolkeeperError as e:
            raise IntegrationError(
                f"{where} cannot host a poolkeeper pool over the {self.upstream!r} upstream: {e}"
            ) from e
        log_path = None
        if self.log_directory is not None:
            try:
                os.makedirs(self.log_directory, exist_ok=True)
            except OSError as e:  # a file in the way, no permission: was a bare OSError from setup
                raise IntegrationError(f"{where} cannot write its log under {self.log_directory!r}: {e}") from e
            log_path = os.path.join(self.log_directory, f"poolkeeper_{_safe(worker_name)}_{os.getpid()}.csv")
        pool = make_pool(self.kind, upstream, log=log_path, **self.pool_options())
        state = WorkerPoolState(pool=pool, upstream=self.upstream, device=dev, log_path=log_path)
        try:
            if self.initial is not None:
                # Reserve the resident backing now, as RMM's initial pool size does.
                pool.deallocate(pool.allocate(pool.alignment))
                # A device that cannot give that much refuses the ramp backing and the arena asks
                # again for just the request: `initial` beyond the device was a pool of 256 bytes,
                # silently (RMM refuses such a pool size).
                reserved = pool.stats()["reserved_bytes"]
                if reserved < self.initial:
                    raise IntegrationError(
                        f"{where} cannot reserve initial={self.initial} bytes on the {self.upstream!r} upstream "
                        f"(it gave {reserved}): lower initial= (rmm_pool_size)"
                    )
            if self.cupy:
                from poolkeeper.integrations import cupy as pkc

                pkc.install(pool, pinned=False)
                state.cupy = True
            if self.torch:
                from poolkeeper.integrations import torch as pkt

                pkt.install(pool)  # AllocatorInitializedError when CUDA already started here
                state.torch = True
        except BaseException:
            state.close()
            raise
        return state


__all__ = ["CUDA_UPSTREAMS", "WorkerPoolSpec", "WorkerPoolState", "visible_device", "METRIC_KEYS"]
