"""Where an upload's bytes come from, and how one chunk of them gets into a staging buffer.

- Memory (``bytes``, ``bytearray``, ``memoryview``, numpy arrays, anything C-contiguous with the
  buffer protocol): one ``ctypes.memmove`` per chunk. It releases the GIL, so the uploader's
  workers fill different chunks at once (one core's memcpy, about 10 GB/s on the H200 host, is
  far slower than the link).
- A path (``str`` / ``os.PathLike``): ``os.preadv`` at the chunk's absolute offset (GIL-free, so
  also filled by several workers at once).
- A binary file object (has ``readinto``): sequential ``readinto`` from its current position, so
  only one worker reads it (``parallel`` is False), in order.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
from typing import Any, Optional

from poolkeeper.errors import InvalidArgumentError
from poolkeeper.staging._hostmem import BorrowedBuffer
from poolkeeper.staging.buffer import StagingBuffer


class Source:
    """A readable byte source of known length for the uploader."""

    nbytes: int
    parallel: bool = True  # may different chunks be filled concurrently, in any order?
    address: Optional[int] = None  # raw address of the bytes, if any: the native engine reads it

    def fill(self, buf: StagingBuffer, offset: int, n: int) -> None:
        """Put source bytes ``[offset, offset + n)`` at the start of ``buf``."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemorySource(Source):
    def __init__(self, obj: Any) -> None:
        self._held = BorrowedBuffer(obj, what="source")
        self.nbytes = self._held.nbytes

    @property
    def address(self) -> int:
        """Where the bytes are (valid until :meth:`close`): what the native engine reads."""
        return self._held.address

    def fill(self, buf: StagingBuffer, offset: int, n: int) -> None:
        ctypes.memmove(buf.ptr, self._held.address + offset, n)

    def close(self) -> None:
        self._held.release()


class PathSource(Source):
    def __init__(self, path: Any) -> None:
        try:
            self._fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_BINARY", 0))
        except ValueError as e:  # an embedded NUL: not a path at all (OSError stays OSError)
            raise InvalidArgumentError(f"source path {path!r} is not a valid path: {e}") from None
        st = os.fstat(self._fd)
        if stat.S_ISDIR(st.st_mode):
            # Linux opens a directory read-only; only the first read fails. Refuse it here, as an
            # OSError like a missing or unreadable path, before the upload has begun.
            os.close(self._fd)
            self._fd = -1
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        self.nbytes = st.st_size

    def fill(self, buf: StagingBuffer, offset: int, n: int) -> None:
        with buf.view(0, n) as mv:
            got = 0
            while got < n:
                if hasattr(os, "preadv"):
                    r = os.preadv(self._fd, [mv[got:]], offset + got)
                else:  # pragma: no cover - platforms without preadv
                    data = os.pread(self._fd, n - got, offset + got)
                    mv[got : got + len(data)] = data
                    r = len(data)
                if r <= 0:
                    raise InvalidArgumentError(f"source file ended at byte {offset + got}; expected {self.nbytes}")
                got += r

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FileObjectSource(Source):
    """A binary file object read from its current position. Without ``nbytes`` its length is
    measured by seeking to the end and back; a position at or past the end is an empty source (a
    read there returns nothing, as for any file)."""

    parallel = False

    def __init__(self, f: Any, nbytes: Optional[int]) -> None:
        self._f = f
        if nbytes is None:
            name = type(f).__name__
            try:
                here = f.tell()
                end = f.seek(0, os.SEEK_END)
                f.seek(here)
            except (OSError, AttributeError, ValueError):
                raise InvalidArgumentError("nbytes is required for a file object that cannot seek") from None
            except Exception as e:  # a broken tell/seek: its own error type would escape untyped
                raise InvalidArgumentError(
                    f"measuring the {name} source failed ({type(e).__name__}: {e}); pass nbytes"
                ) from None
            # A position is a non-negative int; anything else would reach the engine as a length
            # (a bare TypeError from nanobind, or a negative count).
            for what, v in (("tell()", here), ("seek(0, SEEK_END)", end)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise InvalidArgumentError(
                        f"{name}.{what} returned {v!r}; expected a non-negative int position (or pass nbytes)"
                    )
            nbytes = max(0, end - here)
        self.nbytes = nbytes

    def fill(self, buf: StagingBuffer, offset: int, n: int) -> None:
        with buf.view(0, n) as mv:
            got = 0
            while got < n:
                want = n - got
                r = self._f.readinto(mv[got:])
                # A hostile or broken readinto must not loop forever (-1, None from a non-blocking
                # stream) nor claim bytes it cannot have written (more than asked).
                if r is None or isinstance(r, bool) or not isinstance(r, int) or r < 0 or r > want:
                    raise InvalidArgumentError(
                        f"{type(self._f).__name__}.readinto returned {r!r} for a {want}-byte buffer; "
                        "expected the number of bytes read, 0 <= n <= the buffer's length"
                    )
                if r == 0:
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
