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

from poolkeeper.errors import InvalidStreamError


class CudaStreamLike(Protocol):
    def __cuda_stream__(self) -> tuple[int, int]: ...


StreamLike = Union[None, int, CudaStreamLike, Any]


def as_handle(stream: StreamLike) -> Optional[int]:
    """The raw handle poolkeeper will use for ``stream`` (``None`` for no stream)."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise InvalidStreamError(f"stream must not be a bool; got {stream!r}")
    if isinstance(stream, int):
        if stream < 0 or stream >= 2**64 - 1:
            raise InvalidStreamError(f"stream {stream!r} is not a stream handle")
        return stream
    if hasattr(stream, "__cuda_stream__"):
        r = stream.__cuda_stream__()
        return as_handle(r[1])
    if hasattr(stream, "cuda_stream"):
        return as_handle(stream.cuda_stream)
    if hasattr(stream, "ptr"):
        return as_handle(stream.ptr)
    raise InvalidStreamError(
        "stream must be None, an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr;"
        f" got {type(stream).__name__}"
    )


__all__ = ["StreamLike", "as_handle"]
