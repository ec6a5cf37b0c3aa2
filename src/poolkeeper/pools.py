"""The pools. Each is the native class itself (a Python subclass adding docs and conveniences),
so ``allocate``/``deallocate`` go straight to C++: a pool hit costs tens of nanoseconds from Python.

Common API (every pool):

- ``allocate(nbytes, stream=None) -> int``: an address aligned to the pool's alignment.
- ``deallocate(ptr, stream=None)``: see :mod:`poolkeeper.streams` for the stream contract.
- ``record_stream(ptr, stream)``: the block is used on ``stream`` too; its release waits for it.
- ``stats() -> dict``: ``reserved_bytes, live_bytes, free_bytes, pending_bytes, overhead_bytes``
  (``reserved == live + free + pending + overhead``), ``thread_cached_bytes`` (part of free),
  ``largest_free_block``, ``fragmentation`` (1 - largest_free / free), peaks, upstream calls, and
  per-pool extras.
- ``reset_peaks()``: peaks restart from the current reserved and live bytes (PyTorch's
  ``reset_peak_memory_stats``); ``stats()["ooms"]`` counts the OutOfMemory errors raised.
- ``validate()``: raises :class:`~poolkeeper.errors.InvariantError` on any broken invariant.
- ``trim()``, ``process_pending()``, ``synchronize()``, ``snapshot()``, ``close()`` / ``with``.
- ``upstream``: the upstream, with its own call counters.

Thread-safe. Bad input raises a typed :mod:`poolkeeper.errors` exception and changes nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from poolkeeper import _core
from poolkeeper.errors import LiveBlocksError

if TYPE_CHECKING:  # pragma: no cover
    from poolkeeper.accounting import Snapshot

MiB = 1 << 20


class _PoolAPI:
    """Python conveniences shared by every pool (mixed into the native classes)."""

    def snapshot(self) -> "Snapshot":
        """Backings -> chunks with state, sizes, streams and pending events (see accounting)."""
        from poolkeeper.accounting import Snapshot

        return Snapshot.from_dict(self._snapshot_dict())

    # buffer(nbytes, stream=None) -> PoolBuffer is native, on every pool (cpp/bindings/buffer_core.cpp):
    # one call makes the buffer object and allocates, with no Python frame or type call per buffer.

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an error: close if we can, but never mask the original exception.
        try:
            self.close()
        except LiveBlocksError:
            pass

    def __repr__(self) -> str:
        try:
            st = self.stats()
            tail = f" reserved={st['reserved_bytes']} live={st['live_bytes']}"
        except Exception:  # closed or broken: still printable
            tail = ""
        return f"<{type(self).__name__} #{self.id} over {self.upstream.name}{tail}>"


def _check_upstream(upstream: Any) -> Any:
    if not isinstance(upstream, _core.Upstream):
        from poolkeeper.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"upstream must be a poolkeeper upstream (e.g. poolkeeper.upstream.Host()); got {type(upstream).__name__}"
        )
    return upstream


def _opts(**kw: Any) -> dict:
    # Unknown keywords travel on to the core, which refuses them by name with an
    # InvalidArgumentError listing the valid options (a typo must not pass silently).
    return {k: v for k, v in kw.items() if v is not None}


class Direct(_PoolAPI, _core.DirectPool):
    """The pass-through arm: one upstream call per allocate and per deallocate.

    Args:
        upstream: where memory comes from.
        alignment: power of two (default 256).
        limit: cap on reserved bytes (None: no cap; 0 is refused, since it would allow nothing).
    """

    def __init__(
        self, upstream: _core.Upstream, *, alignment: int = 256, limit: Optional[int] = None, **unknown: Any
    ) -> None:
        super().__init__(_check_upstream(upstream), _opts(alignment=alignment, limit=limit, **unknown))


class SizeClassPool(_PoolAPI, _core.SizeClassPool):
    """Size classes with bounded rounding waste and per-class free lists.

    A request is rounded up to its class: ``classes_per_doubling`` classes between consecutive
    powers of two (default 4: waste below 25%). A free block is cached on its class's free list and
    reused only at that class. Live blocks live in an open-addressing pointer table.

    Args:
        upstream: where memory comes from.
        alignment: power of two, at most 1 GiB (default 256).
        classes_per_doubling: 1, 2, 4 or 8 (default 4).
        max_cached_bytes: cap on cached free bytes; a release beyond it frees upstream (None: no cap;
            0: cache nothing, every release goes upstream).
        limit: cap on reserved bytes (None: no cap; 0 is refused, since it would allow nothing).
        shards: independent parts, each with its own lock, free lists and stream order; a thread
            works in its own shard and a miss borrows free blocks from the others before asking
            the upstream (None: one per hardware thread, at least 8, at most 64; rounded up to a
            power of two; docs/threads.md).

    ``release_cached()`` returns every cached block to the upstream (detached under the locks,
    freed outside them); ``trim()`` is the same.
    """

    def __init__(
        self,
        upstream: _core.Upstream,
        *,
        alignment: int = 256,
        classes_per_doubling: int = 4,
        max_cached_bytes: Optional[int] = None,
        limit: Optional[int] = None,
        shards: Optional[int] = None,
        **unknown: Any,
    ) -> None:
        super().__init__(
            _check_upstream(upstream),
            _opts(
                **unknown,
                alignment=alignment,
                classes_per_doubling=classes_per_doubling,
                max_cached_bytes=max_cached_bytes,
                limit=limit,
                shards=shards,
            ),
        )


class ArenaPool(_PoolAPI, _core.ArenaPool):
    """Large backings sliced into chunks: upstream calls scale with the high-water footprint, not
    with the number of allocations.

    - Backings grow on a ramp: ``initial_backing`` x ``growth_factor``^k up to ``max_backing``,
      then more backings of ``max_backing``. A request above ``max_backing`` gets its own oversize
      backing. The first non-oversize backing is resident (never shrunk).
    - Each backing is an address-ordered chunk list; split and coalesce make a free chunk reusable
      at any size. Coalescing is deferred to one pass when a request cannot be served.
    - Free index: 128 exact-size fast bins (multiples of ``alignment``) with an occupancy bitmap,
      plus a (size, address) tree for best fit.
    - A per-thread cache of exact-size blocks sits in front (a hit takes no lock), bounded by
      ``thread_cache_bytes`` per thread and ``thread_cache_max_block`` per block.
    - Shrink: every ``shrink_interval`` locked releases a scan runs; a wholly free non-resident
      backing is returned after ``shrink_hysteresis`` consecutive scans (freeing device memory
      synchronizes the device, so thrashing it costs more than holding it one more round).

    Args (all keyword): ``initial_backing`` (2 MiB), ``max_backing`` (128 MiB), ``growth_factor``
    (1.5), ``alignment`` (256), ``thread_cache_bytes`` (64 MiB; 0 disables the cache),
    ``thread_cache_max_block`` (2 MiB: a round of 2 MiB blocks stays off the pool lock),
    ``shrink_hysteresis`` (2), ``shrink_interval`` (4096;
    0 disables automatic scans), ``oversize_threshold`` (32 MiB, clamped to ``max_backing``;
    requests above it get an oversize backing of their own), ``limit`` (None: no cap; 0 is refused),
    ``shards`` (0: one per hardware thread, at most 16; requests above ``thread_cache_max_block``
    are served by the calling thread's home shard, each with its own lock and backings, see
    docs/threads.md; 1 with a ``limit``, without a thread cache or with ``single_stream``),
    ``single_stream`` (False; docs/stream_order.md, "One stream": while every allocation names
    one stream, a release on it is free at once, as in PyTorch's allocator; the first allocation
    on another stream, or without one, waits once for that stream and ends the mode).
    With ``expandable=True`` (docs/expandable.md) also ``va_bytes``, ``step_fraction`` and
    ``max_step``; given without it they are an ``InvalidArgumentError``.
    """

    def __init__(
        self,
        upstream: _core.Upstream,
        *,
        initial_backing: int = 2 * MiB,
        max_backing: int = 128 * MiB,
        growth_factor: float = 1.5,
        alignment: int = 256,
        thread_cache_bytes: int = 64 * MiB,
        thread_cache_max_block: int = 2 * MiB,
        shrink_hysteresis: int = 2,
        shrink_interval: int = 4096,
        oversize_threshold: int = 32 * MiB,
        limit: Optional[int] = None,
        shards: int = 0,
        single_stream: bool = False,
        **unknown: Any,
    ) -> None:
        super().__init__(
            _check_upstream(upstream),
            _opts(
                **unknown,
                shards=shards,
                single_stream=single_stream,
                initial_backing=initial_backing,
                max_backing=max_backing,
                growth_factor=growth_factor,
                alignment=alignment,
                thread_cache_bytes=thread_cache_bytes,
                thread_cache_max_block=thread_cache_max_block,
                shrink_hysteresis=shrink_hysteresis,
                shrink_interval=shrink_interval,
                oversize_threshold=oversize_threshold,
                limit=limit,
            ),
        )


class LoggingPool(_PoolAPI, _core.LoggingPool):
    """Records every allocate and deallocate made through it as RMM's ``logging_resource_adaptor``
    CSV (``Thread,Time,Action,Pointer,Size,Stream``), then forwards it to ``inner``.

    The log replays with ``poolkeeper replay PATH`` (and RMM's replay benchmark). It is written
    in C++, so allocations reaching ``inner`` through the C ABI (PyTorch's pluggable allocator,
    when the registry holds this pool) are logged too.

    Args:
        inner: the pool that serves the requests (owned from now on: allocate through the
            adaptor, not through ``inner``, or those blocks go unlogged).
        path: the CSV file, created or truncated now.
        buffer_bytes: lines are buffered in memory and written in chunks of this size (default
            1 MiB, at most 1 GiB: the buffer is reserved whole now); also on :meth:`flush`,
            :meth:`close`, when the adaptor is destroyed, and at process exit.

    ``stats()`` is the inner pool's, plus ``log_events``, ``log_bytes_written`` and
    ``log_write_errors``. ``close()`` closes the inner pool, then the file.

    Raises :class:`~poolkeeper.errors.InvalidArgumentError` when the file cannot be created, when
    ``path`` has a NUL byte (the C library would cut the name there) or ``buffer_bytes`` is above
    1 GiB; no file is created then.
    """

    def __init__(self, inner: _core.Pool, path: "str | os.PathLike[str]", *, buffer_bytes: Optional[int] = None) -> None:
        from poolkeeper.errors import InvalidArgumentError

        if not isinstance(inner, _core.Pool):
            raise InvalidArgumentError(f"inner must be a poolkeeper pool; got {type(inner).__name__}")
        try:
            # The native side takes a UTF-8 str: bytes, an int or an undecodable name raised
            # nanobind's or os.fspath's bare TypeError.
            name = os.fsencode(path).decode()
        except (TypeError, UnicodeDecodeError):
            raise InvalidArgumentError(f"path must be a str or os.PathLike naming a UTF-8 path; got {type(path).__name__}") from None
        super().__init__(inner, name, buffer_bytes)


Pool = _core.Pool

# Pools made in C++ (the C ABI registry's factory: PyTorch's per-device pools) reach Python as the
# native classes, without the mixin: give them its conveniences too, so pkt.pools()[0].buffer(n)
# and .snapshot() work on whatever pool a user is handed.
for _name in ("snapshot", "buffer"):
    if not hasattr(_core.Pool, _name):
        setattr(_core.Pool, _name, getattr(_PoolAPI, _name))
@dataclass(frozen=True)
class PoolKind:
    """One pool kind, as every entry point spells it: ``make_pool``, ``make_device_pool``,
    ``integrations.torch.install`` (and its C ABI factory), ``integrations.cupy.install``, the Dask
    and Ray worker pools, ``poolkeeper bench`` arms, ``poolkeeper replay --pool`` and the tests.
    :data:`KINDS` is the one table of them: a new kind is one row there.

    ``cls``: the pool class. ``fixed``: options the kind sets itself (an ``arena_expandable`` is
    an ``ArenaPool`` with ``expandable=True``); asking for another value is refused.
    ``needs_virtual``: the kind maps memory into a reserved range, so it runs only over an
    upstream with the virtual-memory interface (``"virtual"`` on a GPU, the simulated device in
    tests), and per-device pools of it default to ``"virtual"``. ``extra_options``: options the
    kind accepts beyond ``cls``'s keyword arguments (read by ``poolkeeper bench``/``replay`` to
    route ``-o KEY=VALUE``).
    """

    name: str
    cls: type
    fixed: Dict[str, Any] = field(default_factory=dict)
    needs_virtual: bool = False
    extra_options: Tuple[str, ...] = ()
    description: str = ""

    @property
    def base(self) -> str:
        """The kind that builds the same class without fixed options (``"arena"`` for
        ``"arena_expandable"``): the name the C ABI factory is given, with :attr:`fixed`."""
        return next(k.name for k in KINDS.values() if k.cls is self.cls and not k.fixed)

    @property
    def cuda_upstream(self) -> str:
        """The CUDA upstream a per-device pool of this kind draws from when none is named."""
        return "virtual" if self.needs_virtual else "device"

    @property
    def cuda_upstreams(self) -> Tuple[str, ...]:
        """The CUDA upstream names this kind can run over."""
        from poolkeeper.upstream import CUDA_UPSTREAMS

        return ("virtual",) if self.needs_virtual else CUDA_UPSTREAMS


KINDS: Dict[str, PoolKind] = {
    "direct": PoolKind("direct", Direct, description="the upstream itself: one upstream call per allocate and per deallocate"),
    "size_class": PoolKind("size_class", SizeClassPool, description="SizeClassPool: size classes with per-class free lists"),
    "arena": PoolKind("arena", ArenaPool, description="ArenaPool: large backings sliced with split/coalesce, per-thread cache"),
    "arena_expandable": PoolKind(
        "arena_expandable",
        ArenaPool,
        {"expandable": True},
        needs_virtual=True,
        extra_options=tuple(_core.EXPANDABLE_OPTIONS),  # the list the C++ reader refuses without expandable
        description="ArenaPool(expandable=True): one virtual range, physical pieces mapped at its end",
    ),
}

# Pool class by kind name (kept for callers that want only the class).
POOL_KINDS: Dict[str, type] = {name: k.cls for name, k in KINDS.items()}


def pool_kind(kind: str) -> PoolKind:
    """The :class:`PoolKind` named ``kind``; :class:`~poolkeeper.errors.InvalidArgumentError` if none."""
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        from poolkeeper.errors import InvalidArgumentError, brief

        raise InvalidArgumentError(f"unknown pool kind {brief(kind)} (valid: {', '.join(KINDS)})") from None


def resolve_upstream(kind: str, upstream: Optional[str]) -> str:
    """The upstream name a pool of ``kind`` uses: ``upstream``, or the kind's CUDA default when
    None. Raises :class:`~poolkeeper.errors.InvalidArgumentError` for an unknown name or a pair
    that cannot work (a kind that needs virtual memory over ``"device"``, ``"async"`` or
    ``"host"``; ``"simulated"`` has every interface)."""
    from poolkeeper.errors import InvalidArgumentError, brief
    from poolkeeper.upstream import UPSTREAMS

    k = pool_kind(kind)
    if upstream is None:
        return k.cuda_upstream
    if not isinstance(upstream, str) or upstream not in UPSTREAMS:  # a list was unhashable: TypeError
        raise InvalidArgumentError(f"unknown upstream {brief(upstream)} (valid: {', '.join(UPSTREAMS)})")
    if upstream != "simulated" and k.needs_virtual and upstream != "virtual":
        raise InvalidArgumentError(
            f"pool kind {kind!r} cannot run over upstream {upstream!r}: it maps memory into a reserved range "
            "(valid for it: virtual, simulated)"
        )
    return upstream


def resolve_cuda_upstream(kind: str, upstream: Optional[str]) -> str:
    """As :func:`resolve_upstream`, for the per-device entry points (PyTorch, CuPy), which take
    the CUDA names and ``"simulated"`` (for tests)."""
    from poolkeeper.errors import InvalidArgumentError
    from poolkeeper.upstream import CUDA_UPSTREAMS

    if upstream is not None and upstream != "simulated" and (not isinstance(upstream, str) or upstream not in CUDA_UPSTREAMS):
        from poolkeeper.errors import brief

        raise InvalidArgumentError(f"unknown upstream {brief(upstream)} (valid: {', '.join(CUDA_UPSTREAMS)})")
    return resolve_upstream(kind, upstream)


# Stitching (docs/expandable.md, "Stitching moves on" and "Top-ups and homecomings"): pieces of
# one granule, up to 256 of them in one stitch, for requests of 4 MiB or more; from 64 MiB a
# request may take the free run at the growth's edge too; free pieces that fall short of a request
# are topped up with fresh memory instead of growing beside them. Chosen on the committed traces
# and the real-model runs, at more driver calls (benchmarks/results/expandable_holes.txt,
# real_models_h200.md).
WIDE_STITCH: Dict[str, Any] = {"map_piece": 2 << 20, "stitch_max_parts": 256, "stitch_from": 4 << 20,
                               "stitch_edge_from": 64 << 20, "stitch_top_up": True, "stitch_fragments": True}

# What PyTorch's install() makes when no pool is named, chosen from the real-model benchmark
# (docs/integrations.md, "Which pool by default"): the expandable arena in single-stream mode, with
# wide stitching. It needs virtual memory on every device it may serve; where that is missing, or
# another upstream is named, the fallback.
DEFAULT_DEVICE_POOL: Tuple[str, Dict[str, Any]] = ("arena_expandable", {"single_stream": True, **WIDE_STITCH})
FALLBACK_DEVICE_POOL: Tuple[str, Dict[str, Any]] = ("arena", {"single_stream": True})


def default_device_pool(upstream: Optional[str], virtual_memory: Callable[[], bool]) -> Tuple[str, Dict[str, Any]]:
    """The pool kind and options a per-device entry point makes when none is named:
    :data:`DEFAULT_DEVICE_POOL`, or :data:`FALLBACK_DEVICE_POOL` when the default needs virtual
    memory and ``upstream`` names another (``"device"``, ``"async"``), or names none and
    ``virtual_memory()`` (asked only then) says some device lacks it. ``"virtual"`` and
    ``"simulated"`` keep the default (an upstream named ``"virtual"`` on a device without virtual
    memory fails as it would under any kind)."""
    kind, options = DEFAULT_DEVICE_POOL
    if pool_kind(kind).needs_virtual:
        if upstream not in (None, "virtual", "simulated") or (upstream is None and not virtual_memory()):
            kind, options = FALLBACK_DEVICE_POOL
    return kind, dict(options)


def _with_fixed(k: PoolKind, options: Dict[str, Any]) -> Dict[str, Any]:
    for key, value in k.fixed.items():
        if key in options and options[key] != value:
            from poolkeeper.errors import InvalidArgumentError

            raise InvalidArgumentError(f"pool kind {k.name!r} fixes {key}={value!r}; got {key}={options[key]!r}")
    return {**options, **k.fixed}


def set_device_factory(kind: str, options: Optional[Dict[str, Any]], upstream: str) -> None:
    """Have the C ABI registry make each device's pool lazily, on its first request, as a pool
    of ``kind`` with ``options`` over the CUDA upstream named ``upstream`` (resolved first with
    :func:`resolve_cuda_upstream`). The C++ factory is given the kind's class (:attr:`PoolKind.base`)
    and its fixed options, so a kind is known from :data:`KINDS` alone. Options are validated
    now; a bad one raises and changes nothing."""
    k = pool_kind(kind)
    _core.registry_set_factory(k.base, _with_fixed(k, dict(options or {})), upstream)


def make_device_pool(kind: str, device: int, upstream: Optional[str] = None, **options: Any) -> _core.Pool:
    """A pool of ``kind`` over a CUDA upstream of ``device`` (``upstream``: ``"device"``,
    ``"async"``, ``"virtual"``; None: the kind's default)."""
    from poolkeeper.upstream import make_upstream

    return make_pool(kind, make_upstream(resolve_cuda_upstream(kind, upstream), device), **options)


def make_pool(kind: str, upstream: _core.Upstream, *, log: "Optional[str | os.PathLike[str]]" = None,
              **options: Any) -> _core.Pool:
    """Build a pool by name: ``"arena"``, ``"arena_expandable"``, ``"size_class"`` or ``"direct"``.

    ``log``: a path; the pool is then wrapped in a :class:`LoggingPool` writing that file.
    """
    k = pool_kind(kind)
    if log is not None and not isinstance(log, (str, os.PathLike)):
        from poolkeeper.errors import InvalidArgumentError

        raise InvalidArgumentError(f"log must be a path (str or os.PathLike); got {type(log).__name__}")
    pool = k.cls(upstream, **_with_fixed(k, options))
    if log is not None:
        try:
            return LoggingPool(pool, log)
        except BaseException:
            pool.close()
            raise
    return pool


__all__ = [
    "Pool",
    "Direct",
    "SizeClassPool",
    "ArenaPool",
    "LoggingPool",
    "POOL_KINDS",
    "KINDS",
    "PoolKind",
    "pool_kind",
    "resolve_upstream",
    "resolve_cuda_upstream",
    "make_device_pool",
    "set_device_factory",
    "make_pool",
]
