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


# How many wrapper objects deep a stream may be (a torch stream wrapping a CUDA-protocol object
# wrapping an int is 2): an object that returns itself, or a cycle, must not recurse forever.
MAX_UNWRAP = 8


def as_handle(stream: StreamLike) -> Optional[int]:
    """The raw handle poolkeeper will use for ``stream`` (``None`` for no stream).

    Raises :class:`~poolkeeper.errors.InvalidStreamError` for anything that is not a stream,
    including a wrapper whose ``__cuda_stream__()`` / ``.cuda_stream`` / ``.ptr`` returns itself
    (unwrapping stops after ``MAX_UNWRAP`` levels), a protocol tuple that is not
    ``(version, handle)``, and a wrapper whose attribute raises (chained as ``__cause__``)."""
    from poolkeeper.errors import InvalidStreamError

    outer = stream
    for _ in range(MAX_UNWRAP + 1):
        if stream is None:
            if outer is not None:
                raise InvalidStreamError(f"{type(outer).__name__} yields None as its stream handle")
            return None
        if isinstance(stream, bool):
            raise InvalidStreamError(f"stream must not be a bool; got {stream!r}")
        if isinstance(stream, int):
            if stream < 0 or stream >= 2**64 - 1:
                raise InvalidStreamError(f"stream {stream!r} is not a stream handle")
            return int(stream)
        try:
            if hasattr(stream, "__cuda_stream__"):
                r = stream.__cuda_stream__()
                if not isinstance(r, tuple) or len(r) != 2:
                    raise InvalidStreamError(
                        f"__cuda_stream__() must return (version, handle); got {type(r).__name__}"
                    )
                stream = r[1]
            elif hasattr(stream, "cuda_stream"):
                stream = stream.cuda_stream
            elif hasattr(stream, "ptr"):
                stream = stream.ptr
            else:
                raise InvalidStreamError(
                    "stream must be None, an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr;"
                    f" got {type(stream).__name__}"
                )
        except InvalidStreamError:
            raise
        except Exception as e:  # a wrapper whose attribute raises is not a stream (KeyboardInterrupt passes)
            raise InvalidStreamError(f"reading the stream handle of {type(stream).__name__} raised {e!r}") from e
    raise InvalidStreamError(
        f"{type(outer).__name__} nests more than {MAX_UNWRAP} levels without reaching a stream handle "
        "(does its __cuda_stream__ / .cuda_stream / .ptr return itself?)"
    )


__all__ = ["StreamLike", "as_handle"]
