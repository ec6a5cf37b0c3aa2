"""Allocation-log readers for ``poolkeeper replay``: RMM logging_resource_adaptor CSV and PyTorch
memory snapshot pickles, plain or gzip-compressed. ``read_log(path)`` detects the format from the
file's first bytes (after decompression)."""
from __future__ import annotations

import gzip
import io
import zlib
from typing import IO, Optional

from poolkeeper.bench.errors import ReplayError
from poolkeeper.bench.readers import rmm_csv, torch_snapshot
from poolkeeper.bench.readers.trace import ALLOC, ALLOC_FAILED, FREE, Event, Trace

FORMATS = ("auto", "rmm", "torch")


GZIP_MAGIC = b"\x1f\x8b"


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")


def detect(path: str) -> str:
    """``"rmm"`` or ``"torch"`` from the file's first bytes; :class:`ReplayError` otherwise."""
    try:
        with _open(path) as f:
            head = f.read(64)
    except (OSError, EOFError, zlib.error) as e:
        raise ReplayError(f"unreadable gzip data ({e})", path=path) from None
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


def read_log(path: str, fmt: str = "auto", device: Optional[int] = None) -> Trace:
    """Parse a log into a :class:`Trace` (``fmt``: auto, rmm or torch; ``device``: torch only)."""
    if fmt not in FORMATS:
        raise ReplayError(f"unknown log format {fmt!r} (valid: {', '.join(FORMATS)})", path=path)
    if fmt == "auto":
        fmt = detect(path)
    try:
        if fmt == "rmm":
            with _open(path) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
                return rmm_csv.read(f, path)
        with _open(path) as f:
            return torch_snapshot.read(f, path, device)
    except UnicodeDecodeError as e:
        raise ReplayError(f"not a text CSV (undecodable byte at offset {e.start})", path=path) from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ReplayError(f"the compressed log is truncated or corrupt ({e or type(e).__name__})", path=path) from None
    except (RecursionError, OverflowError, MemoryError) as e:  # hostile nesting or sizes, whatever the format
        raise ReplayError(f"the log cannot be read ({type(e).__name__}: {str(e)[:200]})", path=path) from None


__all__ = ["read_log", "detect", "FORMATS", "Trace", "Event", "ALLOC", "FREE", "ALLOC_FAILED"]
