"""``PinnedStagingPool``: a small, bounded cache of page-locked host buffers.

Page-locking is one of the most expensive calls in CUDA (on the H200 host a 32 MiB
``cudaHostAlloc`` + ``cudaFreeHost`` pair costs 23.5 ms, measured by a native C++ loop on an H200 host), so a path
that pins a fresh staging buffer per transfer spends its time in the driver. This pool keeps up to
``max_buffers`` buffers / ``max_bytes`` bytes and hands out the smallest retained one that fits.

Rules:

- ``acquire(n)``: the smallest retained buffer whose capacity is >= ``n`` (rounded up to
  ``granularity``); if none fits, a new one from the upstream.
- A buffer comes back only through ``StagingBuffer.retire(witness)``. If retaining it would exceed
  either bound, it is freed instead (never an unbounded trade of host RAM for speed).
- A buffer closed or garbage-collected without retire is freed, never recycled.
- Upstream calls (``allocate``/``deallocate``, milliseconds for pinned memory) run outside the
  pool's lock, so a slow pin does not stall other threads' reuses. Each is counted as *in transit*
  from the locked step that decides it to the locked step that books it; ``stats()`` waits until
  nothing is in transit (new upstream calls wait while a ``stats()`` is waiting, so it is never
  starved), which makes every ``stats()`` one consistent observation of the pool *and* its
  upstream's counters, under any traffic.
- An upstream free that fails (the upstream refuses it) never raises out of the pool and never
  leaves its books: it is counted in ``upstream_free_failures`` and the buffer is *held*
  (``refused_buffers``), still the pool's, never handed out again, and retried by the next
  ``trim()`` / ``close()`` and by the pool's finalizer (the way the device pools re-adopt a refused
  free). A free cut short by Ctrl-C is not retried: it most likely happened, and a second free
  could free memory handed out since; it is counted in ``frees_interrupted`` and leaves the books.
  So ``pinned_alloc_calls == frees + retained + live + leaked_unconfirmed + refused +
  frees_interrupted`` holds after every refusal and every interruption.
"""
from __future__ import annotations

import bisect
import collections
import threading
import weakref
from typing import Any, Optional

from poolkeeper.errors import InvalidArgumentError, PoolClosedError
from poolkeeper.staging._lease import TERMINAL, Lease
from poolkeeper.staging.buffer import StagingBuffer

MiB = 1 << 20
_COUNTERS = (
    "pinned_alloc_calls",  # upstream.allocate calls that succeeded
    "failed_allocs",  # upstream.allocate calls that raised
    "reuses",  # acquires served from a retained buffer
    "frees",  # upstream.deallocate calls, for any reason
    "acquires",
    "retires",
    "freed_over_bounds",  # retired but freed: retaining would breach max_buffers / max_bytes
    "freed_after_close",  # retired after pool.close()
    "freed_by_trim",  # retained buffers freed by trim() / close() / OOM recovery
    "dropped_without_retire",  # garbage-collected while live: freed, not recycled
    "closed_without_retire",  # buf.close() while live: freed, not recycled
    "leaked_unconfirmed",  # ended while a device copy's completion could not be tracked: not freed
    "upstream_free_failures",  # upstream.deallocate calls that raised (the buffer is held, see _hold)
    # upstream.deallocate calls cut short by a BaseException (Ctrl-C): CPython raises a pending
    # KeyboardInterrupt as the call returns, so the free most likely happened; whether it did is
    # unknown, so the buffer leaves the books and is never freed again (a second free could free
    # memory the upstream has handed out since).
    "frees_interrupted",
)


def _default_upstream() -> Any:
    from poolkeeper import _core

    if _core.cuda_is_available():
        from poolkeeper.upstream import CudaPinned

        return CudaPinned()
    from poolkeeper.upstream import Host

    return Host()


def _free_all(upstream: Any, *lists: list) -> None:
    # Finalizer of a pool collected without close(): its retained and held buffers go back to the
    # upstream. Nobody is left to report a refusal to and no later trim will come, so a refused
    # buffer stays with the upstream (its outstanding bytes show it) and the rest are still freed;
    # raising would stop at the first refusal and print "Exception ignored" at exit.
    for blocks in lists:
        while blocks:
            cap, ptr = blocks.pop()
            try:
                upstream.deallocate(ptr, cap)
            except Exception:
                pass


class PinnedStagingPool:
    """A bounded, thread-safe pool of staging buffers.

    Args:
        upstream: where buffers come from: ``CudaPinned()`` (page-locked, default when CUDA is
            available) or ``Host()`` (default otherwise; copies are memmoves, for tests and CPU
            paths). Must be of kind ``"pinned"`` or ``"host"``: the pool writes into its memory.
        max_buffers: most buffers retained at once (default 8).
        max_bytes: most bytes retained at once (default 512 MiB).
        granularity: capacities are rounded up to a multiple of this (default 4096: page-locking
            works in whole pages, and rounding lets slightly different sizes share buffers).
    """

    def __init__(
        self,
        upstream: Any = None,
        max_buffers: int = 8,
        max_bytes: int = 512 * MiB,
        granularity: int = 4096,
    ) -> None:
        for name, v in (("max_buffers", max_buffers), ("max_bytes", max_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative int; got {v!r}")
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0 or granularity & (granularity - 1):
            raise InvalidArgumentError(f"granularity must be a positive power of two; got {granularity!r}")
        if upstream is None:
            upstream = _default_upstream()
        kind = getattr(upstream, "kind", None)
        if kind not in ("pinned", "host"):
            raise InvalidArgumentError(
                f"a staging pool needs host-accessible memory (an upstream of kind 'pinned' or 'host'); "
                f"{getattr(upstream, 'name', type(upstream).__name__)} is of kind {kind!r}"
            )
        self._upstream = upstream
        self._max_buffers = max_buffers
        self._max_bytes = max_bytes
        self._gran = granularity
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._transit = 0  # upstream calls decided under the lock and not booked yet
        self._readers = 0  # stats() calls waiting for a quiet moment
        self._fin_open = 0  # finalizer frees begun and not finished (see _free_unretired)
        self._retained: list[tuple[int, int]] = []  # (capacity, ptr), sorted: smallest fit by bisect
        self._retained_bytes = 0
        # Buffers whose upstream free was refused: still the pool's, never handed out, retried by
        # the next trim (see _hold). Kept apart from _retained so the bounds keep holding.
        self._refused: list[tuple[int, int]] = []
        self._refused_bytes = 0
        self._peak_retained_bytes = 0
        self._live_buffers = 0
        self._live_bytes = 0
        self._closed = False
        self._c = dict.fromkeys(_COUNTERS, 0)
        # Every lease handed out and not yet collected (for validate(); weak: a lease belongs to
        # its buffer, and a dropped buffer must stay collectable).
        self._leases: "weakref.WeakSet[Lease]" = weakref.WeakSet()
        # Finalizers of dropped buffers may run inside a GC triggered anywhere, even while this
        # thread holds self._lock; they free at once (the upstream is thread-safe) and leave their
        # bookkeeping here (deque appends are atomic), folded in under the lock by _drain().
        self._events: collections.deque = collections.deque()
        self._finalizer = weakref.finalize(self, _free_all, upstream, self._retained, self._refused)

    # -- public API ------------------------------------------------------------------------------
    @property
    def upstream(self) -> Any:
        return self._upstream

    @property
    def max_buffers(self) -> int:
        return self._max_buffers

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    def capacity_for(self, nbytes: int) -> int:
        """The capacity a request of ``nbytes`` is served with (``nbytes`` rounded up)."""
        g = self._gran
        return max(g, (nbytes + g - 1) // g * g)

    def acquire(self, nbytes: int) -> StagingBuffer:
        """A staging buffer of at least ``nbytes`` bytes: the smallest retained one that fits, or a
        new one from the upstream (counted in ``pinned_alloc_calls``)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgumentError(f"nbytes must be a positive int; got {nbytes!r}")
        cap = self.capacity_for(nbytes)
        with self._lock:
            self._drain()
            if self._closed:
                raise PoolClosedError("this PinnedStagingPool was closed")
            i = bisect.bisect_left(self._retained, (cap, 0))
            if i < len(self._retained):
                cap, ptr = self._retained.pop(i)
                self._retained_bytes -= cap
                self._c["reuses"] += 1
                lease = self._lease_out(ptr, cap, nbytes)
                return StagingBuffer._new(lease)
            self._wait_readers()  # nothing changed since _drain(): waiting here is safe
            self._begin_transit()
        try:
            ptr = self._allocate(cap)
        except BaseException:
            with self._lock:
                self._end_transit()
            raise
        with self._lock:
            self._c["pinned_alloc_calls"] += 1
            lease = self._lease_out(ptr, cap, nbytes)
            self._end_transit()
        return StagingBuffer._new(lease)

    def stats(self) -> dict:
        """Counters and current state: one consistent observation, also while other threads use
        the pool. ``upstream_allocations``, ``upstream_deallocations`` and
        ``upstream_outstanding_bytes`` are the upstream's counters at the same moment (when the
        upstream has ``counters()``). ``refused_buffers`` / ``refused_bytes``: buffers whose
        upstream free was refused, held for the next ``trim()``."""
        counters = getattr(self._upstream, "counters", None)
        with self._lock:
            while True:
                self._quiesce()
                s: dict[str, Any] = dict(self._c)
                s.update(
                    retained_buffers=len(self._retained),
                    retained_bytes=self._retained_bytes,
                    retained_capacities=[c for c, _ in self._retained],
                    peak_retained_bytes=self._peak_retained_bytes,
                    refused_buffers=len(self._refused),
                    refused_bytes=self._refused_bytes,
                    live_buffers=self._live_buffers,
                    live_bytes=self._live_bytes,
                    max_buffers=self._max_buffers,
                    max_bytes=self._max_bytes,
                    upstream=getattr(self._upstream, "name", type(self._upstream).__name__),
                    upstream_kind=self._upstream.kind,
                    closed=self._closed,
                )
                c = counters() if counters is not None else None
                # A finalizer may have freed a dropped buffer since _quiesce() (a GC triggered by
                # the allocations above runs it on this very thread): its events are then queued,
                # and the upstream's counters may include a free this snapshot lacks. Retry.
                if not self._events:
                    break
            if c is not None:
                s.update(upstream_allocations=c["allocations"], upstream_deallocations=c["deallocations"],
                         upstream_outstanding_bytes=c["outstanding_bytes"])
            return s

    def validate(self) -> None:
        """Check the pool's invariants and those of every lease it has handed out that still
        exists; raises AssertionError naming the broken one. Safe under traffic (one consistent
        observation, as :meth:`stats`); meant for tests and debugging.

        Invariants: the retained list is sorted, within both bounds, and its byte total is
        ``retained_bytes``; every acquire was a pin or a reuse; every acquire is live, retired or
        ended without retire (dropped, closed, leaked); every pin is freed, retained, live, leaked
        held after a refused free, or its free interrupted; at most ``live_buffers`` leases are not yet ended (a lease
        ends before the pool books it); each lease passes ``Lease.validate``.
        """
        with self._lock:
            self._quiesce()
            c, ret = self._c, self._retained
            assert ret == sorted(ret), "retained buffers out of order"
            assert self._retained_bytes == sum(cap for cap, _ in ret), "retained_bytes is not the retained total"
            assert self._refused_bytes == sum(cap for cap, _ in self._refused), "refused_bytes is not the held total"
            assert len(ret) <= self._max_buffers and self._retained_bytes <= self._max_bytes, "retained beyond bounds"
            assert self._live_buffers >= 0 and self._live_bytes >= 0, "negative live count"
            assert (self._live_buffers == 0) == (self._live_bytes == 0), "live buffers and live bytes disagree"
            assert c["acquires"] == c["pinned_alloc_calls"] + c["reuses"], "an acquire neither pinned nor reused"
            ended = c["retires"] + c["dropped_without_retire"] + c["closed_without_retire"] + c["leaked_unconfirmed"]
            assert c["acquires"] == ended + self._live_buffers, "acquires != ended leases + live buffers"
            held = len(self._refused)
            accounted = c["frees"] + len(ret) + self._live_buffers + c["leaked_unconfirmed"] + held + c["frees_interrupted"]
            assert c["pinned_alloc_calls"] == accounted, "pins != frees + retained + live + leaked + refused + interrupted"
            leases = [lease for lease in list(self._leases) if lease.pool is self]
            open_leases = sum(1 for lease in leases if lease.state not in TERMINAL)
            assert open_leases <= self._live_buffers, f"{open_leases} open leases, {self._live_buffers} live buffers"
        for lease in leases:
            lease.validate()

    def trim(self) -> int:
        """Free every retained buffer, and retry every buffer whose earlier free was refused;
        returns the bytes freed.

        A free the upstream refuses does not raise and does not stop the trim (each free is its
        own call; one refusal says nothing about the next): it is counted in
        ``upstream_free_failures`` and the buffer is held (``refused_buffers``) for the next trim.
        """
        return self._trim(nested=False)

    def _trim(self, nested: bool) -> int:
        # nested: the calling thread already has an upstream call in transit (OOM recovery), so it
        # must not wait for a stats() that waits for that very call.
        with self._lock:
            self._wait_readers(nested)
            self._drain()
            blocks = self._retained + self._refused
            self._retained[:], self._refused[:] = [], []
            self._retained_bytes = self._refused_bytes = 0
            if not blocks:
                return 0
            self._begin_transit()
        # Per block: "" not tried, then "inflight" until the call returned "freed" or raised
        # "refused". One store each, so a Ctrl-C leaves every block in a state that is true.
        state = [""] * len(blocks)
        try:
            for k, (cap, ptr) in enumerate(blocks):
                state[k] = "inflight"
                try:
                    self._upstream.deallocate(ptr, cap)
                    state[k] = "freed"
                except Exception:
                    state[k] = "refused"
        finally:
            with self._lock:
                freed = [cap for (cap, _), st in zip(blocks, state) if st == "freed"]
                self._c["frees"] += len(freed)
                self._c["freed_by_trim"] += len(freed)
                self._c["upstream_free_failures"] += state.count("refused")
                self._c["frees_interrupted"] += state.count("inflight")
                # Refused, or never tried (a Ctrl-C ended the loop first): still the pool's.
                self._hold([b for b, st in zip(blocks, state) if st in ("refused", "")])
                self._end_transit()
        return sum(freed)

    def close(self) -> None:
        """Free retained buffers and refuse new acquires. Live buffers stay valid; retiring them
        afterwards frees them. Idempotent."""
        with self._lock:
            self._closed = True
        self.trim()

    def __enter__(self) -> "PinnedStagingPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<PinnedStagingPool on {s['upstream']}: {s['retained_buffers']}/{self._max_buffers} retained "
            f"({s['retained_bytes']} / {self._max_bytes} bytes), {s['live_buffers']} live>"
        )

    # -- internals -------------------------------------------------------------------------------
    def _lease_out(self, ptr: int, cap: int, nbytes: int) -> Lease:
        # Under self._lock: the lease is booked live before anyone can end it.
        self._c["acquires"] += 1
        self._live_buffers += 1
        self._live_bytes += cap
        lease = Lease(self, ptr, cap, nbytes)
        self._leases.add(lease)
        return lease

    def _allocate(self, cap: int) -> int:
        try:
            return self._upstream.allocate(cap)
        except Exception as e:
            # Every refusal counts (failed_allocs: "upstream allocations that raised"); only a
            # lack of memory is worth a retry: retained buffers are pinned memory too, given back.
            with self._lock:
                self._c["failed_allocs"] += 1
            if not isinstance(e, MemoryError) or not self._trim(nested=True):
                raise
        try:
            return self._upstream.allocate(cap)
        except Exception:
            with self._lock:
                self._c["failed_allocs"] += 1
            raise

    # -- the lease hooks: the only calls a Lease makes into its pool, each after its own lock is
    # released, each once per lease (the lease's terminal transition decides which) ---------------
    def _take_back(self, ptr: int, cap: int) -> None:
        """A retire (witness already checked and consumed): retain within bounds, else free."""
        with self._lock:
            self._wait_readers()
            self._drain()
            self._live_buffers -= 1
            self._live_bytes -= cap
            self._c["retires"] += 1
            if self._closed:
                reason = "freed_after_close"
            elif len(self._retained) + 1 > self._max_buffers or self._retained_bytes + cap > self._max_bytes:
                reason = "freed_over_bounds"
            else:
                bisect.insort(self._retained, (cap, ptr))
                self._retained_bytes += cap
                self._peak_retained_bytes = max(self._peak_retained_bytes, self._retained_bytes)
                return
            self._begin_transit()
        outcome = "unfreed"  # a Ctrl-C before the call: not freed, held
        try:
            outcome = "inflight"  # a Ctrl-C from here on: unknown (see frees_interrupted)
            self._upstream.deallocate(ptr, cap)
            outcome = "freed"
        except Exception:
            # The lease is already retired (witness consumed): raising would report an error the
            # caller can do nothing about, and retire promises that nothing changed when it raises.
            outcome = "refused"
        finally:
            with self._lock:
                if outcome == "freed":
                    self._c["frees"] += 1
                    self._c[reason] += 1
                elif outcome == "inflight":
                    self._c["frees_interrupted"] += 1
                else:
                    self._c["upstream_free_failures"] += outcome == "refused"
                    self._hold([(cap, ptr)])
                self._end_transit()

    def _free_unretired(self, ptr: int, cap: int, how: str) -> None:
        """A lease ended without retire (``how``: "dropped" or "closed"). May run in a finalizer:
        takes no lock. The "begin" event lets stats() wait for the free to be booked. A refused
        free ends the lease all the same and holds the buffer (see _hold); it does not raise: the
        lease is already closed, and a finalizer has nobody to raise to."""
        # Until the call: a Ctrl-C leaves the buffer unfreed (held); during it, unknown
        # (frees_interrupted). The end is recorded whatever happens, or stats() would wait for it
        # forever, and the lease would stay live.
        end = ("unfreed " + how, cap, ptr)
        try:
            self._events.append(("begin", 0, 0))
            try:
                end = ("interrupted " + how, cap, 0)
                self._upstream.deallocate(ptr, cap)
                end = (how, cap, 0)
            except Exception:
                end = ("refused " + how, cap, ptr)
        finally:
            self._events.append(end)

    def _hold(self, blocks: list) -> None:
        # Under self._lock: buffers whose free did not happen stay on the books, apart from the
        # retained ones (bounds and reuse are about buffers the pool chose to keep), for the next
        # trim() or the finalizer to free.
        for cap, ptr in blocks:
            bisect.insort(self._refused, (cap, ptr))
            self._refused_bytes += cap

    def _leak_unconfirmed(self, cap: int) -> None:
        """A lease ended while a copy's completion could not be confirmed: never free under a
        possible DMA; count it instead."""
        self._events.append(("leaked", cap, 0))

    def _wait_readers(self, nested: bool = False) -> None:
        # Under self._lock, before any change that an upstream call made outside the lock will
        # complete: a waiting stats() goes first (waiting after the change would let it observe
        # the change without the call).
        while self._readers and not nested:
            self._cv.wait()

    def _begin_transit(self) -> None:
        # Under self._lock, after _wait_readers() and with no wait since: the call is in transit.
        self._transit += 1

    def _end_transit(self) -> None:
        # Under self._lock, once the call is booked.
        self._transit -= 1
        if not self._transit:
            self._cv.notify_all()

    def _quiesce(self) -> None:
        # Under self._lock: wait until every upstream call is booked, finalizers' frees included.
        self._readers += 1
        try:
            while True:
                self._drain()
                if not self._transit and not self._fin_open:
                    return
                # Finalizers cannot notify (they take no lock): poll for their "end" events.
                self._cv.wait(0.001 if self._fin_open else None)
        finally:
            self._readers -= 1
            if not self._readers:
                self._cv.notify_all()

    def _drain(self) -> None:
        # Under self._lock: fold in what finalizers recorded.
        ev = self._events
        while ev:
            how, cap, ptr = ev.popleft()
            if how == "begin":
                self._fin_open += 1
                continue
            self._live_buffers -= 1
            self._live_bytes -= cap
            if how == "leaked":
                self._c["leaked_unconfirmed"] += 1
                continue
            self._fin_open -= 1
            outcome, _, how = how.rpartition(" ")
            if outcome in ("refused", "unfreed"):
                self._c["upstream_free_failures"] += outcome == "refused"
                self._hold([(cap, ptr)])
            elif outcome == "interrupted":
                self._c["frees_interrupted"] += 1
            else:
                self._c["frees"] += 1
            self._c["dropped_without_retire" if how == "dropped" else "closed_without_retire"] += 1


__all__ = ["PinnedStagingPool"]
