"""``StagingBuffer``: one lease of a staging buffer from a :class:`PinnedStagingPool`.

Lifecycle: ``acquire`` -> fill (``view()``, ``numpy()``, ``fill()``) -> copy -> ``retire(witness)``.
``retire`` is the only way back into the pool. ``close()`` and garbage collection free the memory
instead (the safe direction: the pool cannot know whether a copy still reads it, so it never
recycles it; the cost shows in the pool's ``dropped_without_retire`` / ``closed_without_retire``
and ``pinned_alloc_calls`` counters).

Views are plain ``memoryview`` objects over the buffer's memory: ``buf.view()``, ``memoryview(buf)``,
``numpy.frombuffer(buf)`` (the buffer protocol is implemented natively, so all of these work on
every supported Python). Each keeps the buffer object alive, so the memory cannot be freed under a
live view; ``retire`` refuses while views are alive (:class:`BufferInUseError`: they could write
into the next user's data), ``close`` frees once the last view is released, and every access path
refuses after retire or close.
"""
from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Optional

from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError
from poolkeeper.staging import witness as _witness
from poolkeeper.staging._errors import BufferInUseError, BufferStateError
from poolkeeper.staging._hostmem import BorrowedBuffer

if TYPE_CHECKING:  # pragma: no cover
    from poolkeeper.staging.pool import PinnedStagingPool

LIVE, RETIRED, CLOSED = "live", "retired", "closed"


class _Lease:
    """The memory of one lease and what must happen before it may be freed.

    Holds no reference to the StagingBuffer, so it can serve as the buffer's finalizer.
    """

    __slots__ = ("pool", "ptr", "capacity", "jobs", "closing")

    def __init__(self, pool: "PinnedStagingPool", ptr: int, capacity: int) -> None:
        self.pool = pool
        self.ptr = ptr
        self.capacity = capacity
        self.jobs: list = []  # copies issued from this lease not yet seen complete
        self.closing = False  # close() ran while views were alive; the finalizer frees later

    def wait_copies(self) -> bool:
        # Freeing memory a DMA still reads is as bad as recycling it: wait first. Host copies keep
        # their StagingBuffer alive until done, so in a finalizer only device copies can remain,
        # and waiting on them needs no Python thread (no deadlock from a GC on any thread).
        # Returns False if some copy's completion cannot be confirmed: then the memory must leak.
        confirmed = True
        for job in list(self.jobs):
            confirmed = job.wait_complete() and confirmed
        if confirmed:
            self.jobs.clear()
        return confirmed

    def end(self, how: str) -> None:
        """Free the memory without recycling it (``how``: "dropped" or "closed")."""
        if self.wait_copies():
            self.pool._free_unretired(self.ptr, self.capacity, how)
        else:
            self.pool._leak_unconfirmed(self.capacity)

    def finalize(self) -> None:
        """The StagingBuffer was collected without retire: free, never recycle."""
        self.end("closed" if self.closing else "dropped")


class StagingBuffer(_core.HostBufferExporter):
    """A writable host (or pinned) buffer leased from a :class:`PinnedStagingPool`.

    Attributes: ``ptr`` (address), ``nbytes`` (bytes requested), ``capacity`` (bytes held; at least
    ``nbytes``), ``pool``, ``state`` (``"live"``, ``"retired"`` or ``"closed"``), ``copies_in_flight``.

    Not meant to be shared between threads while being filled; the pool itself is thread-safe.
    """

    __slots__ = ("_lease", "_nbytes", "_state", "_lock", "_exports", "_tokens", "_seq", "_ended", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("StagingBuffer is created by PinnedStagingPool.acquire(nbytes)")

    @classmethod
    def _new(cls, pool: "PinnedStagingPool", ptr: int, capacity: int, nbytes: int) -> "StagingBuffer":
        self = object.__new__(cls)
        self._lease = _Lease(pool, ptr, capacity)
        self._nbytes = nbytes
        self._state = LIVE
        # Re-entrant: a buffer export can be released by the garbage collector on this thread while
        # it holds the lock (any allocation under the lock may collect a memoryview of this buffer),
        # and _release_buffer_ takes the lock.
        self._lock = threading.RLock()
        self._exports = 0  # buffer-protocol exports alive (memoryviews, numpy arrays over the memory)
        self._tokens: dict = {}  # witness token -> copy seq, for witnesses minted for this lease
        self._seq = 0
        self._ended = False  # the memory was handed back (retire) or freed (close): __del__ does nothing
        return self

    def __del__(self) -> None:
        # Dropped without retire: free, never recycle. (__del__, not weakref.finalize: it costs
        # nothing per lease, and this runs once per uploaded chunk.)
        if not getattr(self, "_ended", True):
            self._ended = True
            try:
                self._lease.finalize()
            except Exception:  # pragma: no cover - interpreter shutdown
                pass

    # -- read-only facts -------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        return self._lease.ptr

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def capacity(self) -> int:
        return self._lease.capacity

    @property
    def pool(self) -> "PinnedStagingPool":
        return self._lease.pool

    @property
    def state(self) -> str:
        return self._state

    @property
    def copies_in_flight(self) -> int:
        with self._lock:
            return self._inflight_locked()

    def __len__(self) -> int:
        return self._nbytes

    def __repr__(self) -> str:
        return (
            f"<StagingBuffer 0x{self.ptr:x} nbytes={self._nbytes} capacity={self.capacity} "
            f"{self._state} on {self.pool.upstream.kind}>"
        )

    # -- access ------------------------------------------------------------------------------------
    def view(self, offset: int = 0, nbytes: Optional[int] = None) -> memoryview:
        """A writable ``memoryview`` (format ``'B'``) of ``nbytes`` bytes from ``offset``.

        Raises :class:`BufferStateError` after retire/close or while a copy out of the buffer is in
        flight (writing now would change what lands on the device). Release the view before
        ``retire`` (``with buf.view() as mv: ...`` or ``del``).
        """
        offset, nbytes = self._range(offset, nbytes)
        if not nbytes:
            with self._lock:
                self._check_writable_locked("view")
            return memoryview(b"").cast("B")
        # A slice shares the export of the whole buffer: it is released when the last slice is.
        return memoryview(self)[offset : offset + nbytes]

    def numpy(self, dtype: Any = None) -> Any:
        """A writable numpy array over the buffer's ``nbytes`` bytes (``uint8`` unless ``dtype``)."""
        import numpy as np

        return np.frombuffer(self.view(), dtype=dtype if dtype is not None else np.uint8)

    def _export_buffer_(self, writable: bool) -> tuple:
        # Called by the native buffer slot (poolkeeper._core.HostBufferExporter) for every export
        # (memoryview(buf), numpy, view()); _release_buffer_ follows exactly once.
        with self._lock:
            self._check_writable_locked("view")
            self._exports += 1
        return (self._lease.ptr, self._nbytes, False)

    def _release_buffer_(self) -> None:
        with self._lock:
            self._exports -= 1

    def fill(self, data: Any, offset: int = 0) -> int:
        """Copy the bytes of ``data`` (any C-contiguous buffer) into the buffer at ``offset``; returns
        the number of bytes written."""
        with BorrowedBuffer(data, what="data") as src:
            self._range(offset, src.nbytes)
            with self._lock:
                self._check_writable_locked("fill")
                if src.nbytes:
                    ctypes.memmove(self._lease.ptr + offset, src.address, src.nbytes)
            return src.nbytes

    # -- the way back ----------------------------------------------------------------------------
    def retire(self, witness: "_witness.CopyCompleted") -> None:
        """Return the buffer to its pool, proven safe by the witness of its own completed copy.

        Raises :class:`~poolkeeper.errors.WitnessError` if the witness is forged, consumed, minted
        for another buffer, or another copy from this buffer is still in flight;
        :class:`BufferInUseError` if views are alive; :class:`BufferStateError` if already retired or
        closed. On any error nothing changes (the witness stays unused).
        """
        from poolkeeper.errors import WitnessError

        with self._lock:
            token = _witness._check(witness, self, self._tokens)
            if self._state != LIVE:
                raise BufferStateError(f"this staging buffer was already {self._state}", state=self._state)
            others = self._inflight_locked()
            if others:
                raise WitnessError(
                    f"{others} other copy(ies) from this buffer are still in flight; wait for them "
                    "before retiring (their memory reads are not covered by this witness)"
                )
            views = self._live_views_locked()
            if views:
                raise BufferInUseError(
                    f"{views} memory view(s) of this staging buffer are still alive; release them before "
                    "retire (they would write into the next user's data)",
                    views=views,
                )
            _witness._consume(witness, self._tokens, token)
            self._state = RETIRED
            self._ended = True
        self._lease.pool._take_back(self._lease.ptr, self._lease.capacity)

    def close(self) -> None:
        """Give the memory back to the upstream without recycling it (idempotent).

        Waits for copies still reading the buffer. If views are alive, the memory is freed when the
        last of them is released (never under them).
        """
        with self._lock:
            if self._state != LIVE:
                return
            self._state = CLOSED
            views = self._live_views_locked()
        if views:
            self._lease.closing = True  # the finalizer frees (and counts) once the views are gone
            return
        self._ended = True
        self._lease.end("closed")

    def __enter__(self) -> "StagingBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # no-op after retire

    # -- internals (copy path) -------------------------------------------------------------------
    def _range(self, offset: int, nbytes: Optional[int]) -> tuple[int, int]:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgumentError(f"offset must be a non-negative int; got {offset!r}")
        if nbytes is None:
            nbytes = self._nbytes - offset
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int; got {nbytes!r}")
        if offset + nbytes > self._nbytes:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) is outside this staging buffer of {self._nbytes} bytes",
                requested=offset + nbytes,
                nbytes=self._nbytes,
            )
        return offset, nbytes

    def _check_writable_locked(self, what: str) -> None:
        if self._state != LIVE:
            raise BufferStateError(f"cannot {what}: this staging buffer was {self._state}", state=self._state)
        if self._inflight_locked():
            raise BufferStateError(
                f"cannot {what}: a copy out of this staging buffer is still in flight", state=self._state
            )

    def _inflight_locked(self) -> int:
        jobs = self._lease.jobs
        if jobs:
            jobs[:] = [j for j in jobs if not j.query()]
        return len(jobs)

    def _live_views_locked(self) -> int:
        return self._exports

    def _begin_copy(self, job_factory: Any) -> Any:
        """Register a copy out of this buffer; ``job_factory(seq)`` builds the job (under the lock)."""
        with self._lock:
            if self._state != LIVE:
                raise BufferStateError(f"cannot copy from a staging buffer that was {self._state}", state=self._state)
            self._seq += 1
            job = job_factory(self._seq)
            self._lease.jobs.append(job)
            return job

    def _register_witness_token(self, token: object, seq: int) -> None:
        with self._lock:
            self._tokens[token] = seq


__all__ = ["StagingBuffer"]
