"""Owning buffers over pool memory that other libraries consume without a copy.

``pool.buffer(nbytes, stream=None)`` returns a :class:`PoolBuffer`: ``nbytes`` bytes from the
pool, returned to it (on the buffer's stream, so stream-ordered) by ``release()``, by leaving a
``with`` block, or when the buffer is garbage collected. A second ``release()`` does nothing.

What it speaks depends on the pool's upstream kind:

======================  =======================================  ==========================
upstream kind           array protocol                           DLPack device
======================  =======================================  ==========================
``"device"``            ``__cuda_array_interface__`` (v3)        ``(kDLCUDA, device)``
``"pinned"``            buffer protocol / ``__array__``          ``(kDLCUDAHost, 0)``
``"host"``              buffer protocol / ``__array__``          ``(kDLCPU, 0)``
======================  =======================================  ==========================

All of them expose ``__dlpack__`` / ``__dlpack_device__`` (``torch.from_dlpack``,
``cupy.from_dlpack``, ``np.from_dlpack``). The array is one-dimensional ``uint8`` of ``nbytes``.

Lifetime. Every view handed out by DLPack, the buffer protocol (``memoryview(buf)`` on Python
3.12+, ``buf.memoryview()`` everywhere) or ``np.asarray(buf)`` holds a claim on the memory: after
``release()`` the memory goes back to the pool only once the last such view is gone. A
``__cuda_array_interface__`` consumer (CuPy, Numba) keeps the buffer object itself alive, so the
memory lives as long as that consumer -- unless you call ``release()`` while it still uses it,
which, like ``pool.deallocate``, is your promise that it no longer does.

Streams. ``stream=None`` means no stream: the buffer's memory is reusable by anyone once released
(the caller guarantees its device work has finished). With a stream, the release is ordered on
it. A DLPack consumer on another stream (``__dlpack__(stream=s)``) gets the data safely: the
producer waits for the buffer's stream first, and the consumer's stream is recorded on the block
(``record_stream``), so the memory is not reused until the consumer's work has finished too.
"""
from __future__ import annotations

import ctypes
import operator
import sys
import weakref
from typing import Any, Optional, Tuple

from poolkeeper import _core, _dlpack
from poolkeeper.errors import InvalidArgumentError, PoolkeeperError, brief

# DLPack / CUDA-array-interface stream numbers (the CUDA driver's CU_STREAM_LEGACY and
# CU_STREAM_PER_THREAD have the same values). poolkeeper, like PyTorch, names the legacy default
# stream 0.
_LEGACY = 1
_PER_THREAD = 2
_NO_SYNC = -1


class BufferReleasedError(PoolkeeperError, ValueError):
    """The buffer was released: its memory may already belong to someone else."""


class BufferExportError(PoolkeeperError, BufferError):
    """A view cannot be exported as asked (wrong protocol for the memory kind, a copy was
    requested, a device the memory is not on, a stream number DLPack disallows)."""


def _is_real_cuda(upstream: Any) -> bool:
    base = getattr(_core, "CudaDeviceUpstreamBase", None)
    return base is not None and isinstance(upstream, base)


def _stream_from_protocol(s: Optional[int]) -> Optional[int]:
    """A DLPack/CAI stream number -> a poolkeeper stream handle (None: do not synchronize)."""
    if s is None:
        return 0
    # Type first: `s == -1` on a numpy array is an array, whose truth value raises.
    if not isinstance(s, int) or isinstance(s, bool) or not -1 <= s < 1 << 64:
        raise BufferExportError(f"stream must be None, -1 or a stream handle; got {brief(s)}")
    if s == _NO_SYNC:
        return None
    if s == _LEGACY or s == 0:
        # DLPack disallows 0 as ambiguous; a consumer that sends it anyway means the null stream,
        # which is the legacy default stream unless it was built for per-thread default streams.
        return 0
    return s


def _int_pair(value: Any, name: str) -> Optional[Tuple[int, int]]:
    """DLPack's ``max_version`` / ``dl_device``: None, or a tuple of two integers (as numpy's
    producer requires); anything else is a malformed request, not an export that cannot be made."""
    if value is None:
        return None
    if isinstance(value, tuple) and len(value) == 2:
        try:
            return (operator.index(value[0]), operator.index(value[1]))
        except Exception:  # an __index__ that raises; KeyboardInterrupt and the like propagate
            pass
    what = f"a tuple of length {len(value)}" if isinstance(value, tuple) else type(value).__name__
    raise InvalidArgumentError(f"{name} must be None or a tuple of two integers; got {what}")


def _optional_bool(value: Any, name: str) -> Optional[bool]:
    # `if copy:` on a numpy array raised numpy's own ValueError ("truth value ... ambiguous").
    if value is None or isinstance(value, bool):
        return value
    raise InvalidArgumentError(f"{name} must be None, True or False; got {type(value).__name__}")


class PoolBuffer(_core.BufferCore):
    """``nbytes`` bytes from ``pool``, owned by this object (see the module docstring).

    Attributes: ``ptr`` (address), ``nbytes``, ``kind`` (``"device"``, ``"pinned"``, ``"host"``),
    ``device`` (device index, -1 for host memory), ``stream`` (the handle it is ordered on, or
    ``None``), ``pool``, ``released``.

    The owning part is native (``_core.BufferCore``): construction allocates in one call and the
    block goes back to the pool in the C++ destructor when the buffer is collected, with no Python
    finalizer (a Python class with ``__init__`` and ``__del__`` cost microseconds per buffer against
    ~100 ns for the pool pair). ``release()``, claims by views and the stream the release is ordered
    on live there too; the protocols below are Python.
    """

    __slots__ = ()

    # -- lifetime ---------------------------------------------------------------------------------
    def _claim(self) -> None:
        if not self._try_claim():
            raise BufferReleasedError(f"buffer at {self.ptr:#x} was released")

    def __enter__(self) -> "PoolBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _check_live(self) -> None:
        if self.released:
            raise BufferReleasedError(f"buffer at {self.ptr:#x} was released")

    # -- CUDA array interface (device memory) -------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        if self.kind != "device":
            raise AttributeError(f"__cuda_array_interface__: {self.kind} memory is not device memory")
        self._check_live()
        if self.stream is None:
            stream = None  # no stream: nothing to synchronize on
        elif self.stream == 0:
            stream = _LEGACY  # CAI v3 forbids 0; the legacy default stream is 1
        else:
            stream = self.stream
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": stream,
        }

    # -- host memory: buffer protocol and numpy --------------------------------------------------
    def _refuse_export_(self) -> None:
        # The native buffer slot (BufferCore) takes and drops a view's claim itself, with no Python
        # in between for a Ctrl-C to land in; it calls this only to raise the typed refusal.
        if self.kind == "device":
            raise BufferExportError(
                "device memory is not CPU-addressable, so it has no buffer protocol: use "
                "__cuda_array_interface__ or DLPack (torch/cupy.from_dlpack)"
            )
        self._check_live()

    def memoryview(self) -> memoryview:
        """A writable ``memoryview`` (format ``'B'``) over host or pinned memory, holding a claim
        on it while alive (the same as ``memoryview(buf)``)."""
        return memoryview(self)

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None):
        """``np.asarray(buf)``: a uint8 array over the memory, without a copy (host/pinned).

        ``copy=False`` with another ``dtype`` raises
        :class:`~poolkeeper.errors.InvalidArgumentError` (a ``ValueError``, as numpy's protocol
        asks when a copy cannot be avoided); so does a ``copy`` that is not None or a bool.
        """
        import numpy as np

        copy = _optional_bool(copy, "copy")
        arr = np.frombuffer(memoryview(self), dtype=np.uint8)
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise InvalidArgumentError(f"a conversion to {np.dtype(dtype)} needs a copy, and copy=False was asked")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    # -- DLPack -----------------------------------------------------------------------------------
    def __dlpack_device__(self) -> Tuple[int, int]:
        if self.kind == "device":
            return (_dlpack.KDL_CUDA, max(self.device, 0))
        if self.kind == "pinned":
            return (_dlpack.KDL_CUDA_HOST, 0)
        return (_dlpack.KDL_CPU, 0)

    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ):
        """A DLPack capsule (versioned when the consumer's ``max_version`` allows DLPack 1.x; a
        consumer of DLPack 0.x gets the legacy capsule).

        ``stream`` (device memory): the consumer's stream (None or 1: legacy default, 2:
        per-thread default, -1: no synchronization, else a handle). Work on the buffer's own
        stream is waited for first, and the consumer's stream is recorded on the block so its
        release also waits for the consumer's work. Host memory (``kDLCPU``) has no streams:
        there only None is accepted, as the array API standard says.

        Raises :class:`BufferExportError` for a request that cannot be served (``copy=True``,
        another device, a stream not None, -1 or an int in [0, 2**64): 0, which DLPack disallows,
        is taken as CUDA's handle of the legacy default stream) and
        :class:`~poolkeeper.errors.InvalidArgumentError` for a malformed one (``max_version`` or
        ``dl_device`` not None or a tuple of two integers, ``copy`` not None or a bool).
        """
        self._check_live()
        version = _int_pair(max_version, "max_version")
        device = _int_pair(dl_device, "dl_device")
        if _optional_bool(copy, "copy"):
            raise BufferExportError("poolkeeper buffers export without copying (copy=True asked)")
        if device is not None and device != self.__dlpack_device__():
            raise BufferExportError(f"memory is on {self.__dlpack_device__()}, not {device}")
        versioned = version is not None and version[0] >= 1
        # Claimed before the consumer's stream is recorded on the block: a release on another
        # thread (or from an __index__ above) between the check and the recording had freed the
        # block, and the consumer's stream went onto whichever allocation got the address next.
        self._claim()
        try:
            if self.kind == "device":
                self._order_for_consumer(_stream_from_protocol(stream))
            elif self.kind == "host" and stream is not None:
                raise BufferExportError(f"host memory (kDLCPU) has no streams: stream must be None; got {type(stream).__name__}")
            else:
                _stream_from_protocol(stream)  # pinned memory: checked, not ordered on (as before)
            return _dlpack.make_capsule(self.ptr, self.nbytes, self.__dlpack_device__(), self._unclaim, versioned)
        except BaseException:
            self._unclaim()
            raise

    def _order_for_consumer(self, consumer: Optional[int]) -> None:
        if consumer is None or consumer == self.stream:
            return
        if self.stream is not None and _is_real_cuda(self.pool.upstream):
            # Data made on our stream must be complete before the consumer's stream reads it.
            from poolkeeper.cuda.driver import Event

            ev = Event.record(self.stream)
            try:
                ev.synchronize()
            finally:
                ev.close()
        self.pool.record_stream(self.ptr, consumer)
        self._add_consumer_stream(consumer)

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return f"<PoolBuffer {self.nbytes} bytes of {self.kind} memory at {self.ptr:#x} ({state})>"


_core._set_buffer_class(PoolBuffer)  # what pool.buffer() makes, natively

__all__ = ["PoolBuffer", "BufferReleasedError", "BufferExportError"]
