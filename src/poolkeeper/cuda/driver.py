"""Thin helpers over the CUDA driver: streams, events, copies and memset on raw pointers.

Pointers and handles are plain ints. Each call runs in the right context and leaves the calling
thread's current context as it was: an operation on a stream runs in the stream's context; one
without a stream in the thread's current context, or device 0's primary context when the thread
has none (the CUDA runtime's rule). Calls that can block release the GIL. Errors raise
:class:`~poolkeeper.errors.UpstreamError` (with ``error_name``) or, without a driver,
:class:`~poolkeeper.errors.CudaUnavailableError`.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from poolkeeper import _core


def memcpy_htod(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from host address ``src`` to device address ``dst``; returns once done."""
    _core.cuda_memcpy_htod(dst, src, nbytes)


def memcpy_htod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Enqueue a host-to-device copy on ``stream``. ``src`` must stay valid (and, to be truly
    asynchronous, be pinned) until the copy has completed."""
    _core.cuda_memcpy_htod_async(dst, src, nbytes, stream)


def memcpy_dtoh(dst_host: int, src_dev: int, nbytes: int) -> None:
    """Copy ``nbytes`` from device address ``src_dev`` to host address ``dst_host``; returns once
    done (ordered after prior work on the legacy default stream)."""
    _core.cuda_memcpy_dtoh(dst_host, src_dev, nbytes)


def memcpy_dtoh_async(dst_host: int, src_dev: int, nbytes: int, stream: int) -> None:
    """Enqueue a device-to-host copy on ``stream``."""
    _core.cuda_memcpy_dtoh_async(dst_host, src_dev, nbytes, stream)


def memset_d8(dst: int, value: int, nbytes: int, stream: Any = None) -> None:
    """Set ``nbytes`` bytes at device address ``dst`` to ``value`` (0..255). Without ``stream`` it
    is ordered on the legacy default stream and may return before it completes; with one it is
    enqueued on that stream."""
    _core.cuda_memset_d8(dst, value, nbytes, stream)


def device_synchronize(device: int = 0) -> None:
    """Wait for all work on ``device``."""
    _core.cuda_device_synchronize(device)


def mem_get_info(device: int = 0) -> Tuple[int, int]:
    """``(free, total)`` bytes of device memory."""
    free, total = _core.cuda_mem_get_info(device)
    return int(free), int(total)


def set_device(device: int) -> None:
    """Make ``device``'s primary context current on the calling thread (like ``cudaSetDevice``)."""
    _core.cuda_set_device(device)


def current_device() -> int:
    """The device of the calling thread's current context; 0 when none is current (the CUDA
    runtime's default)."""
    d = _core.cuda_current_device()
    return 0 if d < 0 else int(d)


class Stream:
    """A CUDA stream (non-blocking by default) on ``device``'s primary context.

    ``handle`` is the raw ``CUstream``; the object speaks the CUDA stream protocol
    (``__cuda_stream__``), so pools and other libraries accept it directly. ``close()`` (or leaving
    a ``with`` block, or garbage collection) destroys it.
    """

    def __init__(self, device: int = 0, *, non_blocking: bool = True) -> None:
        self.device = device
        self._handle: Optional[int] = _core.cuda_stream_create(device, non_blocking)

    @property
    def handle(self) -> int:
        if self._handle is None:
            from poolkeeper.errors import InvalidArgumentError

            raise InvalidArgumentError("stream is closed")
        return self._handle

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.handle)

    def synchronize(self) -> None:
        """Wait for all work enqueued on this stream."""
        h = self._handle
        if h is None:
            self.handle  # raises: closed
        _core.cuda_stream_synchronize(h)

    def close(self) -> None:
        """Destroy the stream (idempotent). Work already enqueued still completes."""
        h, self._handle = self._handle, None
        if h is not None:
            _core.cuda_stream_destroy(h)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __int__(self) -> int:
        return self.handle

    def __repr__(self) -> str:
        h = "closed" if self._handle is None else f"{self._handle:#x}"
        return f"Stream(device={self.device}, handle={h})"


class Event:
    """A CUDA event (timing disabled) recorded on a stream. Make one with :meth:`Event.record`."""

    def __init__(self, handle: int) -> None:
        self._handle: Optional[int] = handle

    @classmethod
    def record(cls, stream_handle: Any = 0) -> "Event":
        """A new event recorded on ``stream_handle`` (an int, a stream object, or ``None``/0 for
        the legacy default stream), covering all work enqueued there so far."""
        return cls(_core.cuda_event_record_new(stream_handle))

    @property
    def handle(self) -> int:
        if self._handle is None:
            from poolkeeper.errors import InvalidArgumentError

            raise InvalidArgumentError("event is closed")
        return self._handle

    def query(self) -> bool:
        """Has the recorded work completed? (Never blocks; "not ready" is ``False``, not an error.)"""
        return bool(_core.cuda_event_query(self.handle))

    def synchronize(self) -> None:
        """Wait until the recorded work has completed."""
        _core.cuda_event_synchronize(self.handle)

    def close(self) -> None:
        h, self._handle = self._handle, None
        if h is not None:
            _core.cuda_event_destroy(h)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        h = "closed" if self._handle is None else f"{self._handle:#x}"
        return f"Event(handle={h})"


__all__ = [
    "memcpy_htod",
    "memcpy_htod_async",
    "memcpy_dtoh",
    "memcpy_dtoh_async",
    "memset_d8",
    "device_synchronize",
    "mem_get_info",
    "set_device",
    "current_device",
    "Stream",
    "Event",
]
