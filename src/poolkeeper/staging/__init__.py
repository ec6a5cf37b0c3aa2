"""Pinned host staging: a bounded buffer pool, a copy-completion witness, and a streaming uploader.

- :class:`PinnedStagingPool`: reuses page-locked buffers (pinning costs milliseconds per call).
- :class:`StagingBuffer`: one lease; writable (``view()``, ``numpy()``, ``fill()``).
- :func:`copy` / :func:`copy_async` + :class:`PendingCopy`: the copy path, the only minter of
  :class:`CopyCompleted`, which ``StagingBuffer.retire`` requires.
- :class:`Uploader`: streams a large host source to the device with fill/copy overlap.

See ``docs/staging.md``.
"""
from __future__ import annotations

from poolkeeper.staging._engine import PendingCopy, copy, copy_async
from poolkeeper.staging._errors import BufferInUseError, BufferStateError
from poolkeeper.staging.buffer import StagingBuffer
from poolkeeper.staging.pool import PinnedStagingPool
from poolkeeper.staging.uploader import UploadHandle, Uploader, UploadReport
from poolkeeper.staging.witness import CopyCompleted

__all__ = [
    "PinnedStagingPool",
    "StagingBuffer",
    "CopyCompleted",
    "PendingCopy",
    "copy",
    "copy_async",
    "Uploader",
    "UploadHandle",
    "UploadReport",
    "BufferStateError",
    "BufferInUseError",
]
