"""Reader for RMM's ``logging_resource_adaptor`` CSV logs.

Format facts (from RMM's documentation and the adaptor's source): a header line
``Thread,Time,Action,Pointer,Size,Stream``, then one line per event:
thread id, wall-clock time ``HH:MM:SS.ffffff``, action ``allocate`` / ``free`` (documentation of
some versions says ``deallocate``) / ``allocate failure`` (a failed upstream allocation, logged
with a null pointer), the pointer in hex (``0x7f..`` from older versions, bare hex digits from
newer ones), the size in bytes, and the stream in hex. Events are in log order, which RMM's own
replay benchmark also takes as time order for multi-threaded logs.
"""
from __future__ import annotations

from typing import Dict, TextIO

from poolkeeper.bench.errors import ReplayError
from poolkeeper.bench.readers.trace import ALLOC, ALLOC_FAILED, FREE, Event, Trace

HEADER = ("Thread", "Time", "Action", "Pointer", "Size", "Stream")
ACTIONS = {"allocate": ALLOC, "free": FREE, "deallocate": FREE, "allocate failure": ALLOC_FAILED}


def looks_like(first_bytes: bytes) -> bool:
    """True when a file starts like an RMM log (its header line, possibly after a BOM)."""
    head = first_bytes.lstrip(b"\xef\xbb\xbf").lstrip()
    return head.startswith(b"Thread,") or head.startswith(b"Thread ,")


#: Longest line read (characters, its end included). A real line is under 100 characters; without a
#: bound one line with no newline (a gzip bomb of commas) was read whole into memory.
MAX_LINE = 1 << 16
MAX_SIZE_DIGITS = 20  # 2**64 has 20 decimal digits: anything longer is not a size
_HEX = frozenset("0123456789abcdef")


def _hex(text: str) -> int:
    t = text.strip().lower()
    if t in ("", "(nil)", "nullptr", "null"):
        return 0
    digits = t[2:] if t.startswith("0x") else t
    # Only ASCII hex digits (int() would also take signs, underscores and other scripts' digits),
    # and at most 64 bits.
    if not digits or len(digits) > 16 or not set(digits) <= _HEX:
        raise ValueError(text)
    return int(digits, 16)


def read(f: TextIO, path: str = "") -> Trace:
    """Parse an RMM CSV log. Raises :class:`ReplayError` naming the first bad line."""
    trace = Trace(path=path, format="rmm_csv", location="line")
    lineno = 0
    cols: Dict[str, int] = {}
    width = 0
    while True:
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            break
        lineno += 1
        if len(raw) > MAX_LINE and not raw.endswith(("\n", "\r")):
            raise ReplayError(f"line longer than {MAX_LINE:,} characters ({raw[:40]!r}...): not an RMM log line",
                              path=path, line=lineno)
        line = raw.strip()
        if lineno == 1:
            line = line.lstrip("\ufeff")
        if not line:
            continue
        fields = [x.strip() for x in line.split(",")]
        if not cols:
            names = fields
            missing = [h for h in HEADER if h not in names]
            if missing:
                raise ReplayError(
                    f"expected the RMM log header {','.join(HEADER)}; got {line[:80]!r}", path=path, line=lineno
                )
            cols = {h: names.index(h) for h in HEADER}
            width = len(names)
            continue
        if len(fields) != width:
            hint = " (the log looks truncated)" if len(fields) < width else ""
            raise ReplayError(
                f"expected {width} comma-separated fields ({','.join(HEADER)}), got {len(fields)}{hint}: {line[:80]!r}",
                path=path, line=lineno,
            )
        action = fields[cols["Action"]]
        kind = ACTIONS.get(action.lower())
        if kind is None:
            raise ReplayError(
                f"unknown action {action!r} (expected one of: {', '.join(ACTIONS)})", path=path, line=lineno
            )
        try:
            addr = _hex(fields[cols["Pointer"]])
        except ValueError:
            raise ReplayError(f"pointer {fields[cols['Pointer']]!r} is not hexadecimal", path=path, line=lineno) from None
        size_text = fields[cols["Size"]]
        # isdigit() alone accepts superscripts and other scripts' digits that int() then refuses,
        # and a 5000-digit size would trip int()'s digit limit: ASCII digits, 64 bits at most.
        if not (size_text.isascii() and size_text.isdigit()) or len(size_text) > MAX_SIZE_DIGITS \
                or int(size_text) >= 1 << 64:
            raise ReplayError(f"size {size_text[:40]!r} is not a non-negative 64-bit integer", path=path, line=lineno)
        try:
            stream = _hex(fields[cols["Stream"]])
        except ValueError:
            raise ReplayError(f"stream {fields[cols['Stream']]!r} is not hexadecimal", path=path, line=lineno) from None
        trace.events.append(Event(kind, addr, int(size_text), stream, lineno))
    if not cols:
        raise ReplayError("empty log: no RMM header line", path=path, line=max(lineno, 1))
    trace.find_pre_trace()
    return trace


__all__ = ["read", "looks_like", "HEADER", "ACTIONS"]
