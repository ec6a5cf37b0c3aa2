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

The buffer is a handle: its state and every transition (live, copying, closing, retired, closed,
dropped), its views, copies and witnesses belong to its :class:`~poolkeeper.staging._lease.Lease`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError
from poolkeeper.staging import witness as _witness
from poolkeeper.staging._hostmem import BorrowedBuffer
from poolkeeper.staging._lease import Lease

if TYPE_CHECKING:  # pragma: no cover
    from poolkeeper.staging.pool import PinnedStagingPool


class StagingBuffer(_core.HostBufferExporter):
    """A writable host (or pinned) buffer leased from a :class:`PinnedStagingPool`.

    Attributes: ``ptr`` (address), ``nbytes`` (bytes requested), ``capacity`` (bytes held; at least
    ``nbytes``), ``pool``, ``state`` (``"live"``, ``"retired"`` or ``"closed"``), ``copies_in_flight``.

    Not meant to be shared between threads while being filled; the pool itself is thread-safe.
    """

    # The handle only: every fact and rule of the lease lives in ``_lease`` (a
    # :class:`~poolkeeper.staging._lease.Lease`); ``_lock`` is that lease's lock.
    __slots__ = ("_lease", "_lock", "__weakref__")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("StagingBuffer is created by PinnedStagingPool.acquire(nbytes)")

    @classmethod
    def _new(cls, lease: Lease) -> "StagingBuffer":
        self = object.__new__(cls)
        self._lease = lease
        self._lock = lease.lock
        lease.bind(self)
        return self

    def __del__(self) -> None:
        # Dropped without retire: free, never recycle (the lease does nothing if it already
        # ended). __del__, not weakref.finalize: it costs nothing per lease, and this runs once
        # per uploaded chunk.
        lease = getattr(self, "_lease", None)
        if lease is not None:
            try:
                lease.dropped()
            except Exception:  # pragma: no cover - interpreter shutdown
                pass

    # -- read-only facts -------------------------------------------------------------------------
    @property
    def ptr(self) -> int:
        return self._lease.ptr

    @property
    def nbytes(self) -> int:
        return self._lease.nbytes

    @property
    def capacity(self) -> int:
        return self._lease.capacity

    @property
    def pool(self) -> "PinnedStagingPool":
        return self._lease.pool

    @property
    def state(self) -> str:
        return self._lease.public_state

    @property
    def copies_in_flight(self) -> int:
        return self._lease.copies_in_flight()

    @property
    def _exports(self) -> int:
        # Buffer-protocol exports alive (memoryviews, numpy arrays over the memory).
        return self._lease.views

    def __len__(self) -> int:
        return self._lease.nbytes

    def __repr__(self) -> str:
        return (
            f"<StagingBuffer 0x{self.ptr:x} nbytes={self.nbytes} capacity={self.capacity} "
            f"{self.state} on {self.pool.upstream.kind}>"
        )

    # -- access ------------------------------------------------------------------------------------
    def view(self, offset: int = 0, nbytes: Optional[int] = None) -> memoryview:
        """A writable ``memoryview`` (format ``'B'``) of ``nbytes`` bytes from ``offset``.

        Raises :class:`BufferStateError` after retire/close or while a copy out of the buffer is in
        flight (writing now would change what lands on the device). Release the view before
        ``retire`` (``with buf.view() as mv: ...`` or ``del``).
        """
        offset, nbytes = self._lease.check_range(offset, nbytes)
        if not nbytes:
            self._lease.check_writable("view")
            return memoryview(b"").cast("B")
        # A slice shares the export of the whole buffer: it is released when the last slice is.
        return memoryview(self)[offset : offset + nbytes]

    def numpy(self, dtype: Any = None) -> Any:
        """A writable numpy array over the buffer's ``nbytes`` bytes (``uint8`` unless ``dtype``).

        Raises :class:`~poolkeeper.errors.InvalidArgumentError` for a ``dtype`` that is not a numpy
        dtype, holds Python objects, or whose item size does not divide ``nbytes``.
        """
        import numpy as np

        # Checked before any view exists; numpy's own TypeError/ValueError would escape untyped.
        try:
            dt = np.dtype(dtype if dtype is not None else np.uint8)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"dtype {dtype!r} is not a numpy dtype ({e})") from None
        if dt.hasobject or not dt.itemsize or self.nbytes % dt.itemsize:
            raise InvalidArgumentError(
                f"dtype {dt} cannot view this staging buffer's {self.nbytes} bytes: it needs a "
                "non-zero item size that divides them, and no Python objects"
            )
        return np.frombuffer(self.view(), dtype=dt)

    def _export_buffer_(self, writable: bool, token: int) -> tuple:
        # Called by the native buffer slot (poolkeeper._core.HostBufferExporter) for every export
        # (memoryview(buf), numpy, view()); _release_buffer_(token) follows, maybe more than once.
        self._lease.export(token)
        return (self._lease.ptr, self._lease.nbytes, False)

    def _release_buffer_(self, token: int) -> None:
        # A view collected in the same garbage cycle as this buffer may be released after the
        # collector cleared the buffer's slots: the lease (if any) already counted it gone.
        lease = getattr(self, "_lease", None)
        if lease is not None:
            lease.unexport(token)

    def fill(self, data: Any, offset: int = 0) -> int:
        """Copy the bytes of ``data`` (any C-contiguous buffer) into the buffer at ``offset``; returns
        the number of bytes written."""
        with BorrowedBuffer(data, what="data") as src:
            self._lease.check_range(offset, src.nbytes)
            self._lease.write(offset, src.address, src.nbytes)
            return src.nbytes

    # -- the way back ----------------------------------------------------------------------------
    def retire(self, witness: "_witness.CopyCompleted") -> None:
        """Return the buffer to its pool, proven safe by the witness of its own completed copy.

        Raises :class:`~poolkeeper.errors.WitnessError` if the witness is forged, consumed, minted
        for another buffer, or another copy from this buffer is still in flight;
        :class:`BufferInUseError` if views are alive; :class:`BufferStateError` if already retired or
        closed. On any error nothing changes (the witness stays unused).
        """
        self._lease.retire(witness)

    def close(self) -> None:
        """Give the memory back to the upstream without recycling it (idempotent).

        Waits for copies still reading the buffer. If views are alive, the memory is freed when the
        last of them is released (never under them).
        """
        self._lease.close()

    def __enter__(self) -> "StagingBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()  # no-op after retire

    def _begin_copy(self, job_factory: Any) -> Any:
        """Register a copy out of this buffer (``Lease.begin_copy``); for tests that drive the copy
        path's jobs by hand."""
        return self._lease.begin_copy(job_factory)


__all__ = ["StagingBuffer"]
