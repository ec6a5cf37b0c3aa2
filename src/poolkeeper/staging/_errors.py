"""Errors specific to staging buffers.

They derive from :class:`poolkeeper.errors.PoolkeeperError` (so ``except PoolkeeperError`` catches
them) and from the builtin a caller would naturally catch. Witness problems raise
:class:`poolkeeper.errors.WitnessError`.
"""
from __future__ import annotations

from poolkeeper.errors import PoolkeeperError


class BufferStateError(PoolkeeperError, RuntimeError):
    """The staging buffer was already retired or closed (use after retire), or its memory is being
    read by a copy still in flight. Attributes: ``state``."""


class BufferInUseError(PoolkeeperError, BufferError):
    """``retire`` was refused because memory views of the buffer are still alive: recycling the
    memory would let them write into somebody else's data. Release the views (``del`` them, or use
    ``with buf.view() as mv:``) and retire again. Attributes: ``views``."""


__all__ = ["BufferStateError", "BufferInUseError"]
