"""Streams as poolkeeper sees them.

A stream argument is one of:

- ``None``: no stream. The caller guarantees all device work on the block has completed; a block
  released this way is reusable by every stream at once.
- an ``int``: a raw stream handle (a ``CUstream``/``cudaStream_t`` value, or a simulated stream id
  from ``Simulated.stream()``). ``0`` is the legacy default stream: a real stream.
- an object exposing ``__cuda_stream__()`` (the CUDA stream protocol, returning
  ``(version, handle)``), ``.cuda_stream`` (``torch.cuda.Stream``) or ``.ptr``
  (``cupy.cuda.Stream``).

Anything else raises :class:`poolkeeper.errors.InvalidStreamError`.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Union


class CudaStreamLike(Protocol):
    def __cuda_stream__(self) -> tuple[int, int]: ...


StreamLike = Union[None, int, CudaStreamLike, Any]


# Stream objects wrap a handle a few levels deep at most (a framework stream around a driver
# stream); the same bound as the native parser, so an object that answers with itself is refused
# instead of recursing until RecursionError (or, natively, a stack overflow).
_MAX_NESTING = 8


def as_handle(stream: StreamLike) -> Optional[int]:
    """The raw handle poolkeeper will use for ``stream`` (``None`` for no stream).

    Raises:
        InvalidStreamError: not a stream: a bool, a negative or too large int, an object whose
        handle is ``None`` or nests more than 8 levels deep, or an object of another kind.
    """
    return _unwrap(stream, 0)


def _unwrap(stream: Any, depth: int) -> Optional[int]:
    from poolkeeper.errors import InvalidStreamError

    if stream is None:
        if depth == 0:
            return None
        raise InvalidStreamError("stream object gave None as its handle: not a stream")
    if isinstance(stream, bool):
        raise InvalidStreamError(f"stream must not be a bool; got {stream!r}")
    if isinstance(stream, int):
        if stream < 0 or stream >= 2**64 - 1:
            raise InvalidStreamError(f"stream {stream!r} is not a stream handle")
        return stream
    if depth >= _MAX_NESTING:
        raise InvalidStreamError(
            f"stream object nests more than {_MAX_NESTING} levels deep"
            " (does .cuda_stream, .ptr or __cuda_stream__() return the object itself?)"
        )
    if hasattr(stream, "__cuda_stream__"):
        r = stream.__cuda_stream__()
        if not isinstance(r, tuple) or len(r) != 2:
            raise InvalidStreamError("__cuda_stream__() must return (version, handle)")
        return _unwrap(r[1], depth + 1)
    if hasattr(stream, "cuda_stream"):
        return _unwrap(stream.cuda_stream, depth + 1)
    if hasattr(stream, "ptr"):
        return _unwrap(stream.ptr, depth + 1)
    raise InvalidStreamError(
        "stream must be None, an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr;"
        f" got {type(stream).__name__}"
    )


__all__ = ["StreamLike", "as_handle"]
