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

from poolkeeper import _core
from poolkeeper.errors import InvalidStreamError  # noqa: F401  (what as_handle raises)


class CudaStreamLike(Protocol):
    def __cuda_stream__(self) -> tuple[int, int]: ...


StreamLike = Union[None, int, CudaStreamLike, Any]


# How many wrapper objects deep a stream may be (a torch stream wrapping a CUDA-protocol object
# wrapping an int is 2): an object that returns itself, or a cycle, must not recurse forever.
# The limit is the C++ reader's (kMaxStreamNesting in cpp/bindings/convert.cpp).
MAX_UNWRAP = 8


def as_handle(stream: StreamLike) -> Optional[int]:
    """The raw handle poolkeeper will use for ``stream`` (``None`` for no stream).

    Raises :class:`~poolkeeper.errors.InvalidStreamError` for anything that is not a stream,
    including a wrapper whose ``__cuda_stream__()`` / ``.cuda_stream`` / ``.ptr`` returns itself
    (unwrapping stops after ``MAX_UNWRAP`` levels), a protocol tuple that is not
    ``(version, handle)``, and a wrapper whose attribute raises (chained as ``__cause__``)."""
    # The pools' own reading (C++), so what as_handle accepts is exactly what a pool accepts.
    return _core.stream_handle(stream)


__all__ = ["StreamLike", "as_handle"]
