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
    asks for gigabytes at once (a pickle's length-prefixed bytes) never makes them exist."""

    def __init__(self, inner: IO[bytes], limit: Optional[int], path: str) -> None:
        super().__init__()
        self._inner = inner
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
            self._inner.close()
        finally:
            super().close()


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _open(path: str, limit: Optional[int] = None, buffer_size: int = 1 << 20) -> IO[bytes]:
    inner = gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")
    return io.BufferedReader(_Capped(inner, limit, path), buffer_size=buffer_size)


def detect(path: str) -> str:
    """``"rmm"`` or ``"torch"`` from the file's first bytes; :class:`ReplayError` otherwise."""
    try:
        with _open(path, buffer_size=64) as f:
            head = f.read(64)
    except OSError as e:
        if isinstance(e, gzip.BadGzipFile):
            raise ReplayError(f"unreadable gzip data ({e})", path=path) from None
        # Not there, a directory, no permission: the open's own words, not "gzip".
        raise ReplayError(f"cannot read the log: {e.strerror or e}", path=path) from None
    except EOFError as e:
        raise ReplayError(f"the compressed log is truncated ({e or type(e).__name__})", path=path) from None
    except zlib.error as e:
        raise ReplayError(f"unreadable gzip data ({e or type(e).__name__})", path=path) from None
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


def read_log(path: str, fmt: str = "auto", device: Optional[int] = None,
             max_bytes: Optional[int] = MAX_LOG_BYTES) -> Trace:
    """Parse a log into a :class:`Trace` (``fmt``: auto, rmm or torch; ``device``: torch only).

    Reads at most ``max_bytes`` bytes of the log once decompressed (``None``: no bound); a larger
    log, like a malformed one, is a :class:`ReplayError`."""
    from poolkeeper._paths import path_arg

    path = path_arg(path, "log")
    if fmt not in FORMATS:
        raise ReplayError(f"unknown log format {fmt!r} (valid: {', '.join(FORMATS)})", path=path)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0):
        from poolkeeper.errors import InvalidArgumentError, brief

        raise InvalidArgumentError(f"max_bytes must be a positive int or None, not {brief(max_bytes)}")
    if fmt == "auto":
        fmt = detect(path)
    try:
        if fmt == "rmm":
            with _open(path, max_bytes) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
                return rmm_csv.read(f, path)
        with _open(path, max_bytes) as f:
            return torch_snapshot.read(f, path, device)
    except UnicodeDecodeError as e:
        raise ReplayError(f"not a text CSV (undecodable byte at offset {e.start})", path=path) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ReplayError(f"the compressed log is truncated or corrupt ({e or type(e).__name__})", path=path) from None
    except (RecursionError, OverflowError, MemoryError) as e:  # hostile nesting or sizes, whatever the format
        raise ReplayError(f"the log cannot be read ({type(e).__name__}: {str(e)[:200]})", path=path) from None


__all__ = ["read_log", "detect", "FORMATS", "MAX_LOG_BYTES", "Trace", "Event", "ALLOC", "FREE", "ALLOC_FAILED"]
