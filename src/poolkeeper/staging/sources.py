"""Where an upload's bytes come from, and how a chunk of them gets into a staging buffer.

- Memory (``bytes``, ``bytearray``, ``memoryview``, numpy arrays, anything C-contiguous with the
  buffer protocol): the chunk is split across the fill threads, each a ``ctypes.memmove`` (which
  releases the GIL), because one core's memcpy is slower than a PCIe/NVLink H2D copy.
- A path (``str`` / ``os.PathLike``): parallel ``os.preadv`` at absolute offsets (also GIL-free).
- A binary file object (has ``readinto``): sequential ``readinto`` from its current position.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import os
from typing import Any, Optional

from poolkeeper.errors import InvalidArgumentError
from poolkeeper.staging._hostmem import BorrowedBuffer
from poolkeeper.staging.buffer import StagingBuffer

# Below this, splitting a fill across threads costs more in hand-offs than it saves.
MIN_PART = 1 << 20


def _parts(n: int, threads: int) -> list[tuple[int, int]]:
    k = max(1, min(threads, n // MIN_PART))
    step = -(-n // k)
    step = (step + 4095) // 4096 * 4096  # page-aligned part boundaries
    return [(o, min(step, n - o)) for o in range(0, n, step)]


class Source:
    """A readable byte source of known length for the uploader."""

    nbytes: int

    def fill(self, buf: StagingBuffer, offset: int, n: int, pool: Optional[cf.Executor], threads: int = 1) -> None:
        """Put source bytes ``[offset, offset + n)`` at the start of ``buf``, using up to ``threads``
        threads of ``pool`` (the calling thread included) where the source allows."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemorySource(Source):
    def __init__(self, obj: Any) -> None:
        self._held = BorrowedBuffer(obj, what="source")
        self.nbytes = self._held.nbytes

    def fill(self, buf: StagingBuffer, offset: int, n: int, pool: Optional[cf.Executor], threads: int = 1) -> None:
        src, dst = self._held.address + offset, buf.ptr
        parts = _parts(n, threads if pool is not None else 1)
        if pool is None or len(parts) == 1:
            ctypes.memmove(dst, src, n)
            return
        # The calling thread does the last part itself instead of idling.
        futs = [pool.submit(ctypes.memmove, dst + o, src + o, m) for o, m in parts[:-1]]
        o, m = parts[-1]
        ctypes.memmove(dst + o, src + o, m)
        for f in futs:
            f.result()

    def close(self) -> None:
        self._held.release()


class PathSource(Source):
    def __init__(self, path: Any) -> None:
        self._fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_BINARY", 0))
        self.nbytes = os.fstat(self._fd).st_size

    def _read_at(self, buf: StagingBuffer, at: int, file_off: int, m: int) -> None:
        with buf.view(at, m) as mv:
            got = 0
            while got < m:
                r = os.preadv(self._fd, [mv[got:]], file_off + got) if hasattr(os, "preadv") else self._pread(mv, got, file_off)
                if r <= 0:
                    raise InvalidArgumentError(f"source file ended at byte {file_off + got}; expected {self.nbytes}")
                got += r

    def _pread(self, mv: memoryview, got: int, file_off: int) -> int:
        data = os.pread(self._fd, len(mv) - got, file_off + got)
        mv[got : got + len(data)] = data
        return len(data)

    def fill(self, buf: StagingBuffer, offset: int, n: int, pool: Optional[cf.Executor], threads: int = 1) -> None:
        parts = _parts(n, threads if pool is not None else 1)
        if pool is None or len(parts) == 1:
            self._read_at(buf, 0, offset, n)
            return
        futs = [pool.submit(self._read_at, buf, o, offset + o, m) for o, m in parts]
        for f in futs:
            f.result()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FileObjectSource(Source):
    def __init__(self, f: Any, nbytes: Optional[int]) -> None:
        self._f = f
        if nbytes is None:
            try:
                here = f.tell()
                end = f.seek(0, os.SEEK_END)
                f.seek(here)
                nbytes = end - here
            except (OSError, AttributeError, ValueError):
                raise InvalidArgumentError("nbytes is required for a file object that cannot seek") from None
        self.nbytes = nbytes

    def fill(self, buf: StagingBuffer, offset: int, n: int, pool: Optional[cf.Executor], threads: int = 1) -> None:
        with buf.view(0, n) as mv:
            got = 0
            while got < n:
                r = self._f.readinto(mv[got:])
                if not r:
                    raise InvalidArgumentError(f"source file ended after {offset + got} bytes; expected {self.nbytes}")
                got += r


def open_source(src: Any, nbytes: Optional[int] = None) -> Source:
    """Wrap ``src`` as a :class:`Source` (the caller closes it)."""
    if isinstance(src, Source):
        return src
    if isinstance(src, (str, os.PathLike)):
        s: Source = PathSource(src)
    elif hasattr(src, "readinto"):
        s = FileObjectSource(src, nbytes)
    else:
        s = MemorySource(src)
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0 or nbytes > s.nbytes:
            s.close()
            raise InvalidArgumentError(f"nbytes must be an int in [0, {s.nbytes}] for this source; got {nbytes!r}")
        s.nbytes = nbytes
    return s

__all__ = ["Source", "MemorySource", "PathSource", "FileObjectSource", "open_source"]
