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
- ``validate()``: raises :class:`~poolkeeper.errors.InvariantError` on any broken invariant.
- ``trim()``, ``process_pending()``, ``synchronize()``, ``snapshot()``, ``close()`` / ``with``.
- ``upstream``: the upstream, with its own call counters.

Thread-safe. Bad input raises a typed :mod:`poolkeeper.errors` exception and changes nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

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

    def buffer(self, nbytes: int, stream: Any = None):
        """An owning buffer of ``nbytes`` (see :mod:`poolkeeper.buffers`)."""
        from poolkeeper.buffers import PoolBuffer

        return PoolBuffer(self, nbytes, stream)

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
        limit: cap on reserved bytes (None: no cap).
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
        alignment: power of two (default 256).
        classes_per_doubling: 1, 2, 4 or 8 (default 4).
        max_cached_bytes: cap on cached free bytes; a release beyond it frees upstream (None: no cap).
        limit: cap on reserved bytes (None: no cap).
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
    (1.5), ``alignment`` (256), ``thread_cache_bytes`` (32 MiB; 0 disables the cache),
    ``thread_cache_max_block`` (2 MiB: a round of 2 MiB blocks stays off the pool lock),
    ``shrink_hysteresis`` (2), ``shrink_interval`` (4096;
    0 disables automatic scans), ``oversize_threshold`` (32 MiB, clamped to ``max_backing``;
    requests above it get an oversize backing of their own), ``limit`` (None).
    """

    def __init__(
        self,
        upstream: _core.Upstream,
        *,
        initial_backing: int = 2 * MiB,
        max_backing: int = 128 * MiB,
        growth_factor: float = 1.5,
        alignment: int = 256,
        thread_cache_bytes: int = 32 * MiB,
        thread_cache_max_block: int = 2 * MiB,
        shrink_hysteresis: int = 2,
        shrink_interval: int = 4096,
        oversize_threshold: int = 32 * MiB,
        limit: Optional[int] = None,
        **unknown: Any,
    ) -> None:
        super().__init__(
            _check_upstream(upstream),
            _opts(
                **unknown,
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


Pool = _core.Pool
POOL_KINDS = {"direct": Direct, "size_class": SizeClassPool, "arena": ArenaPool}


def make_pool(kind: str, upstream: _core.Upstream, **options: Any) -> _core.Pool:
    """Build a pool by name: ``"direct"``, ``"size_class"`` or ``"arena"``."""
    try:
        cls = POOL_KINDS[kind]
    except KeyError:
        from poolkeeper.errors import InvalidArgumentError

        raise InvalidArgumentError(f"unknown pool kind {kind!r} (valid: {', '.join(POOL_KINDS)})") from None
    return cls(upstream, **options)


__all__ = ["Pool", "Direct", "SizeClassPool", "ArenaPool", "POOL_KINDS", "make_pool"]
