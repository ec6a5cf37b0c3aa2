"""Allocation-log readers for ``poolkeeper replay``: RMM logging_resource_adaptor CSV and PyTorch
memory snapshot pickles. ``read_log(path)`` detects the format from the file's first bytes."""
from __future__ import annotations

from typing import Optional

from poolkeeper.bench.errors import ReplayError
from poolkeeper.bench.readers import rmm_csv, torch_snapshot
from poolkeeper.bench.readers.trace import ALLOC, ALLOC_FAILED, FREE, Event, Trace

FORMATS = ("auto", "rmm", "torch")


def detect(path: str) -> str:
    """``"rmm"`` or ``"torch"`` from the file's first bytes; :class:`ReplayError` otherwise."""
    with open(path, "rb") as f:
        head = f.read(64)
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
    if fmt == "rmm":
        try:
            with open(path, encoding="utf-8", newline="") as f:
                return rmm_csv.read(f, path)
        except UnicodeDecodeError as e:
            raise ReplayError(f"not a text CSV (undecodable byte at offset {e.start})", path=path) from None
    with open(path, "rb") as f:
        return torch_snapshot.read(f, path, device)


__all__ = ["read_log", "detect", "FORMATS", "Trace", "Event", "ALLOC", "FREE", "ALLOC_FAILED"]
