"""Allocation-log readers for ``poolkeeper replay``: RMM logging_resource_adaptor CSV and PyTorch
memory snapshot pickles, plain or gzip-compressed. ``read_log(path)`` detects the format from the
file's first bytes (after decompression).

What a log may cost is bounded: at most ``max_bytes`` (default :data:`MAX_LOG_BYTES`) are read
from it once decompressed -- a 6 MB gzip file can hold 6 GiB of zeros, which the pickle reader
used to load whole (12.6 GB resident, 69 s) -- and a CSV line may hold at most
:data:`~poolkeeper.bench.readers.rmm_csv.MAX_LINE` characters.
"""
from __future__ import annotations

import gzip
import io
import zlib
from typing import IO, Any, Optional

from poolkeeper.bench.errors import ReplayError
from poolkeeper.bench.readers import rmm_csv, torch_snapshot
from poolkeeper.bench.readers.trace import ALLOC, ALLOC_FAILED, FREE, Event, Trace

FORMATS = ("auto", "rmm", "torch")

#: The most bytes ``read_log`` reads from a log (after decompression) unless told otherwise. The
#: replay keeps every event in memory, a few times the text's size: a 1 GiB RMM log is about 16
#: million events. ``poolkeeper replay --max-log-bytes`` raises it.
MAX_LOG_BYTES = 1 << 30

GZIP_MAGIC = b"\x1f\x8b"


class _Capped(io.RawIOBase):
    """A binary stream that raises :class:`ReplayError` once more than ``limit`` bytes were read
    from ``inner``. No read asks ``inner`` for more than one byte past the limit, so a reader that
    asks for gigabytes at once (a pickle's length-prefixed bytes) never makes them exist. Closing it
    closes ``inner`` and then ``also`` (what ``inner`` reads from: a ``GzipFile`` given a file object
    leaves it open)."""

    def __init__(self, inner: IO[bytes], limit: Optional[int], path: str, also: Optional[IO[bytes]] = None) -> None:
        super().__init__()
        self._inner = inner
        self._also = also
        self._limit = limit
        self._path = path
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        # At most 1 MiB per call: gzip decompresses a whole request into a new bytes object first.
        view = memoryview(b).cast("B")[: 1 << 20]
        if self._limit is not None:
            view = view[: max(0, min(len(view), self._limit + 1 - self.count))]
        n = self._inner.readinto(view) or 0
        self.count += n
        if self._limit is not None and self.count > self._limit:
            raise ReplayError(f"the log holds more than {self._limit:,} bytes{' once decompressed' if self._gz else ''}; "
                              "poolkeeper replay --max-log-bytes SIZE raises the bound", path=self._path)
        return n

    @property
    def _gz(self) -> bool:
        return isinstance(self._inner, gzip.GzipFile)

    def close(self) -> None:
        try:
            try:
                self._inner.close()
            finally:
                if self._also is not None:
                    self._also.close()
        finally:
            super().close()


class _Joined(io.RawIOBase):
    """``head``, then what ``rest`` holds after it. A log is opened once and its first bytes (the
    gzip magic, the format's) are read from the stream it is parsed from: opened again, a pipe
    (``replay /dev/stdin``, ``replay <(zcat log.gz)``) had lost them, and every such log was
    "unrecognized"."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        super().__init__()
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self._head:
            view = memoryview(b).cast("B")
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(b) or 0

    def close(self) -> None:
        try:
            self._rest.close()
        finally:
            super().close()


def _open(path: str, limit: Optional[int] = None, buffer_size: int = 1 << 20) -> IO[bytes]:
    """The log's bytes, decompressed if it is gzip, at most ``limit`` of them; the file is opened
    and read once (see :class:`_Joined`)."""
    f = open(path, "rb")
    try:
        magic = f.read(len(GZIP_MAGIC))  # a BufferedReader: as many bytes as there are, up to 2
        src: IO[bytes] = _Joined(magic, f)
        if magic == GZIP_MAGIC:
            return io.BufferedReader(_Capped(gzip.GzipFile(fileobj=src, mode="rb"), limit, path, also=src),
                                     buffer_size=buffer_size)
        return io.BufferedReader(_Capped(src, limit, path), buffer_size=buffer_size)
    except BaseException:
        f.close()
        raise


def _read_head(f: IO[bytes], path: str) -> bytes:
    """The first 64 bytes of ``f`` (fewer if it is shorter), read errors as :class:`ReplayError`."""
    try:
        return f.read(64)
    except OSError as e:
        if isinstance(e, gzip.BadGzipFile):
            raise ReplayError(f"unreadable gzip data ({e})", path=path) from None
        raise ReplayError(f"cannot read the log: {e.strerror or e}", path=path) from None
    except EOFError as e:
        raise ReplayError(f"the compressed log is truncated ({e or type(e).__name__})", path=path) from None
    except zlib.error as e:
        raise ReplayError(f"unreadable gzip data ({e or type(e).__name__})", path=path) from None


def _open_log(path: str, limit: Optional[int]) -> IO[bytes]:
    try:
        return _open(path, limit)
    except OSError as e:
        # Not there, a directory, no permission: the open's own words, not "gzip".
        raise ReplayError(f"cannot read the log: {e.strerror or e}", path=path) from None


def _format_of(head: bytes, path: str) -> str:
    if not head:
        raise ReplayError("empty file", path=path, line=1)
    if torch_snapshot.looks_like(head):
        return "torch"
    if rmm_csv.looks_like(head):
        return "rmm"
    raise ReplayError(
        "unrecognized log format: expected an RMM logging_resource_adaptor CSV (header "
        "'Thread,Time,Action,Pointer,Size,Stream') or a PyTorch memory snapshot pickle",
        path=path, line=1,
    )


def detect(path: str) -> str:
    """``"rmm"`` or ``"torch"`` from the file's first bytes; :class:`ReplayError` otherwise."""
    with _open_log(path, None) as f:
        return _format_of(_read_head(f, path), path)


def read_log(path: str, fmt: str = "auto", device: Optional[int] = None,
             max_bytes: Optional[int] = MAX_LOG_BYTES) -> Trace:
    """Parse a log into a :class:`Trace` (``fmt``: auto, rmm or torch; ``device``: torch only).

    Reads at most ``max_bytes`` bytes of the log once decompressed (``None``: no bound); a larger
    log, like a malformed one, is a :class:`ReplayError`. The log is read once, from its start to
    its end, so it may be a pipe (``/dev/stdin``)."""
    from poolkeeper._paths import path_arg

    path = path_arg(path, "log")
    if fmt not in FORMATS:
        raise ReplayError(f"unknown log format {fmt!r} (valid: {', '.join(FORMATS)})", path=path)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
        from poolkeeper.errors import InvalidArgumentError, brief

        raise InvalidArgumentError(f"max_bytes must be a positive int or None, not {brief(max_bytes)}")
    with _open_log(path, max_bytes) as f:
        head = _read_head(f, path)
        if fmt == "auto":
            fmt = _format_of(head, path)
        try:
            with io.BufferedReader(_Joined(head, f), buffer_size=1 << 20) as body:
                if fmt == "rmm":
                    with io.TextIOWrapper(body, encoding="utf-8", newline="") as text:
                        return rmm_csv.read(text, path)
                return torch_snapshot.read(body, path, device)
        except UnicodeDecodeError as e:
            raise ReplayError(f"not a text CSV (undecodable byte at offset {e.start})", path=path) from None
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise ReplayError(f"the compressed log is truncated or corrupt ({e or type(e).__name__})", path=path) from None
        except (RecursionError, OverflowError, MemoryError) as e:  # hostile nesting or sizes, whatever the format
            raise ReplayError(f"the log cannot be read ({type(e).__name__}: {str(e)[:200]})", path=path) from None


__all__ = ["read_log", "detect", "FORMATS", "MAX_LOG_BYTES", "Trace", "Event", "ALLOC", "FREE", "ALLOC_FAILED"]
