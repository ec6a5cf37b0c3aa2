"""Typed errors of poolkeeper. Each carries the figures that explain it as attributes.

Every error derives from :class:`PoolkeeperError` and also from the builtin a caller would
naturally catch (``MemoryError``, ``ValueError``, ``TypeError``, ``RuntimeError``).
A call that raises one of these leaves its pool exactly as it was (``pool.validate()`` passes).
"""
from __future__ import annotations

from typing import Any


class PoolkeeperError(Exception):
    """Base of every poolkeeper error. Keyword figures become attributes."""

    def __init__(self, message: str = "", **figures: Any) -> None:
        super().__init__(message)
        self.message = message
        for k, v in figures.items():
            setattr(self, k, v)

    def __reduce__(self):  # picklable across processes with its figures
        figs = {k: v for k, v in self.__dict__.items() if k != "message"}
        return (_rebuild, (type(self), self.message, figs))


def _rebuild(cls, message, figures):
    return cls(message, **figures)


def brief(v: Any) -> str:
    """A bounded description of a value for an error message. Not ``repr(v)`` as such: an int of
    more than 4,300 digits cannot be printed (``ValueError``, which escaped untyped from the very
    checks meant to report it), and a value nested thousands deep, or with a hostile
    ``__repr__``, raises or takes seconds."""
    if isinstance(v, (dict, list, tuple)):
        return f"a {type(v).__name__} of {len(v)} items"
    if isinstance(v, int) and not isinstance(v, bool):  # above 256 bits as the core's messages say
        return f"an int of {v.bit_length()} bits" if v.bit_length() > 256 else str(v)
    if isinstance(v, (str, bytes)):
        return repr(v[:40]) + ("..." if len(v) > 40 else "")
    try:
        return f"{type(v).__name__} {v!r}"[:80]
    except Exception:
        return f"a {type(v).__name__}"


class InvalidArgumentError(PoolkeeperError, ValueError):
    """A bad size, alignment or option (zero/negative/absurd sizes, non power-of-two alignment)."""


class InvalidStreamError(InvalidArgumentError, TypeError):
    """An object that is not a stream: not None, an int, or something with ``__cuda_stream__``,
    ``.cuda_stream`` (torch) or ``.ptr`` (CuPy)."""


class InvalidPointerError(PoolkeeperError, ValueError):
    """A pointer the pool cannot take back.

    Attributes: ``ptr`` and ``reason``: ``"null"``, ``"unknown"``, ``"double_free"``,
    ``"interior"`` (points inside a block) or ``"other_pool"`` (the message names the owner).
    """

    ptr: int
    reason: str


class OutOfMemoryError(PoolkeeperError, MemoryError):
    """Out of memory after the pool's own recovery (drain completed pending releases, flush the
    thread cache, trim free backings, retry once).

    Attributes: ``requested``, ``reserved``, ``live``, ``free``, ``largest_free``, ``free_chunks``,
    ``pending``, ``pending_by_stream`` ({stream: bytes}), ``thread_cached``, ``limit`` (or None),
    ``cause`` (``"fragmentation"``, ``"pending"``, ``"thread_cache"``, ``"limit"`` or ``"upstream"``), ``pool``,
    ``upstream``, ``upstream_error``. ``str(err)`` is the one-line diagnosis.
    """

    @property
    def diagnosis(self) -> str:
        return self.message


class UpstreamError(PoolkeeperError, RuntimeError):
    """An upstream call failed. Attributes: ``upstream``, ``error_name`` (e.g. the CUDA error's
    name), ``code``."""


class UpstreamOutOfMemoryError(OutOfMemoryError, UpstreamError):
    """A raw upstream call (``upstream.allocate``, ``map``, ...) ran out of memory: the Host heap's
    ENOMEM, ``CUDA_ERROR_OUT_OF_MEMORY``, a Simulated device's capacity, an injected OOM.

    Both an :class:`OutOfMemoryError` (so ``except MemoryError`` recovery runs) and an
    :class:`UpstreamError`. Attributes: ``upstream``, ``error_name``, ``code``,
    ``cause`` (``"upstream"``), ``upstream_error``; the pool figures (``requested``, ``reserved``,
    ...) are None: no pool was involved. (A pool whose upstream runs out raises a plain
    ``OutOfMemoryError`` with ``cause="upstream"`` after its own recovery.)
    """

    requested = reserved = live = free = largest_free = free_chunks = None
    pending = pending_by_stream = thread_cached = limit = pool = None


class CudaUnavailableError(PoolkeeperError, RuntimeError):
    """No CUDA driver (libcuda.so.1) or no device."""


class PoolClosedError(PoolkeeperError, RuntimeError):
    """The pool was closed (use after close)."""


class LiveBlocksError(PoolkeeperError, RuntimeError):
    """``close()`` found live blocks. They are reported, never freed under the user; the pool stays
    open. Attributes: ``blocks``, ``bytes``, ``sample`` (a few live addresses)."""


class InvariantError(PoolkeeperError, AssertionError):
    """``validate()`` found a broken invariant. A correct pool never raises this."""


class WitnessError(PoolkeeperError, RuntimeError):
    """A copy-completion witness was forged, reused, or presented for the wrong buffer."""


class ReentrancyError(PoolkeeperError, RuntimeError):
    """A call that would deadlock on itself: e.g. ``Uploader.upload()`` / ``start()`` from inside
    a progress callback of an upload running on the same uploader."""


__all__ = [
    "PoolkeeperError",
    "InvalidArgumentError",
    "InvalidStreamError",
    "InvalidPointerError",
    "OutOfMemoryError",
    "UpstreamError",
    "UpstreamOutOfMemoryError",
    "CudaUnavailableError",
    "PoolClosedError",
    "LiveBlocksError",
    "InvariantError",
    "WitnessError",
    "ReentrancyError",
]
