"""Reader for PyTorch memory snapshots (``torch.cuda.memory._dump_snapshot``).

Format facts (from PyTorch's ``torch/cuda/memory.py`` ``_snapshot`` documentation): the file is a
pickle of a dict with ``segments`` (the allocator's segments at snapshot time, each with
``total_size``) and ``device_traces``: one list per device of trace entries, each a dict with
``action`` (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``,
``segment_free``, ``segment_map``, ``segment_unmap``, ``snapshot``, ``oom``, ...), ``addr``
(absent for ``oom``), ``size``, ``stream``, ``frames`` and, in newer versions, ``time_us``.
A block becomes reusable at ``free_completed`` (``free_requested`` only marks the request while
other streams may still use it), so the replay allocates at ``alloc`` and frees at
``free_completed``; every other action is counted and skipped. The trace is a ring buffer
(``max_entries``), so it may start mid-run.

Loading is restricted to plain data: a snapshot holds only dicts, lists, tuples, numbers and
strings, and this reader refuses any pickle that names a class or function (unpickling such a
file could run code).
"""
from __future__ import annotations

import pickle
from typing import Any, BinaryIO, Dict, List, Optional, Tuple

from poolkeeper.bench.errors import ReplayError
from poolkeeper.errors import brief
from poolkeeper.bench.readers.trace import ALLOC, FREE, Event, Trace

REPLAYED = {"alloc": ALLOC, "free_completed": FREE}
SEGMENT_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def looks_like(first_bytes: bytes) -> bool:
    """True for a pickle (protocol 2+ starts with the PROTO opcode 0x80)."""
    return first_bytes[:1] == b"\x80"


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"it refers to {module}.{name}; a memory snapshot holds only plain data, so it is not loaded"
        )


#: Fewest bytes of pickle a trace entry or segment block that becomes an event can take: a dict of
#: its own with three keys and values (``action``/``addr``/``size``, ``state``/``address``/``size``),
#: each pushed in two bytes at the least (a memo reference, a one-byte int), between a MARK and a
#: DICT opcode. A snapshot yielding more events than its bytes / this repeats one dict.
MIN_EVENT_BYTES = 14


def _load(f: BinaryIO, path: str) -> Tuple[Any, int]:
    """The unpickled snapshot and the bytes of pickle it took."""
    # Unpickled from the stream itself: reading it whole first held the file twice over (its bytes,
    # then the objects), and ``read_log``'s stream bounds how much of it can be read at all.
    counted = _Counting(f)
    try:
        return _DataOnly(counted).load(), counted.count
    except ReplayError:  # the stream's bound (read_log's max_bytes)
        raise
    except EOFError:
        raise ReplayError(f"the pickle ends early after {counted.count} bytes (truncated snapshot)", path=path,
                          where=f"byte {counted.count}") from None
    except pickle.UnpicklingError as e:
        raise ReplayError(f"not a loadable memory snapshot: {e}", path=path, where="pickle") from None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError, RecursionError, OverflowError) as e:
        raise ReplayError(f"corrupt pickle ({type(e).__name__}: {str(e)[:200]})", path=path, where="pickle") from None


class _Counting:
    """The file-like interface the unpickler uses, counting the bytes it was given."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        b = self._f.read(n)
        self.count += len(b)
        return b

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b) or 0
        self.count += n
        return n

    def readline(self, limit: int = -1) -> bytes:
        b = self._f.readline(limit)
        self.count += len(b)
        return b

    def peek(self, n: int = 0) -> bytes:  # lets the unpickler read ahead in large pieces
        return self._f.peek(n)


def _int(entry: Dict[str, Any], key: str, path: str, where: str) -> int:
    v = entry.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ReplayError(f"field {key!r} is {brief(v)}, expected an integer", path=path, where=where)
    if v < 0:
        raise ReplayError(f"field {key!r} is negative ({brief(v)})", path=path, where=where)
    if v >= 1 << 64:
        raise ReplayError(f"field {key!r} is {brief(v)}, more than 64 bits", path=path, where=where)
    return v


def read(f: BinaryIO, path: str = "", device: Optional[int] = None) -> Trace:
    """Parse a snapshot pickle; replay ``device``'s trace (default: the device with most allocs).

    Raises :class:`ReplayError` naming the entry (``device_traces[d][i]``) that is malformed.
    """
    snap, nbytes = _load(f, path)
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ReplayError("not a PyTorch memory snapshot: no 'device_traces' (record history with "
                          "torch.cuda.memory._record_memory_history() before _dump_snapshot)", path=path, where="top level")
    traces = snap["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ReplayError("'device_traces' must be a list of lists (one per device)", path=path, where="device_traces")
    # A pickle puts one object in many places for a byte or two each (DUP, a memo reference), so
    # what it describes can outnumber its bytes without bound: one list of 3,000 entries named
    # 3,000 times is 12 KB of file and 9 million entries to walk (a 160 KB file walked for hours;
    # one list of blocks shared by many segments made tens of GB of events). Every list item of a
    # real snapshot takes a byte of its own at least, and every event a dict of its own.
    _check_items(sum(len(t) for t in traces), nbytes, path, "device_traces")
    max_events = nbytes // MIN_EVENT_BYTES
    if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
        raise ReplayError(f"device must be an int; got {device!r}", path=path, where="device_traces")
    if device is None:
        counts = [sum(1 for e in t if isinstance(e, dict) and e.get("action") == "alloc") for t in traces]
        device = max(range(len(traces)), key=lambda d: counts[d]) if traces else 0
    if not 0 <= device < len(traces):
        raise ReplayError(f"no trace for device {device} (the snapshot has {len(traces)})", path=path,
                          where="device_traces")
    trace = Trace(path=path, format="torch_snapshot", location="entry")
    trace.info["device"] = device
    trace.info["devices"] = len(traces)
    segment_delta = 0
    running = 0
    peak_running = 0
    saw_segments = False
    for i, e in enumerate(traces[device]):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            raise ReplayError(f"trace entry is not a dict with a string 'action': {brief(e)}", path=path, where=where)
        action = e["action"]
        kind = REPLAYED.get(action)
        if kind is not None:
            addr = _int(e, "addr", path, where)
            size = _int(e, "size", path, where)
            stream = e.get("stream", 0)
            stream = stream if isinstance(stream, int) and not isinstance(stream, bool) and 0 <= stream < (1 << 64) - 1 else 0
            if len(trace.events) >= max_events:
                _repeated(nbytes, path, where)
            trace.events.append(Event(kind, addr, size, stream, i))
            continue
        trace.ignore(action)
        if action in SEGMENT_DELTA:
            saw_segments = True
            d = SEGMENT_DELTA[action] * _int(e, "size", path, where)
            running += d
            segment_delta += d
            peak_running = max(peak_running, running)
    segments = snap.get("segments")
    if isinstance(segments, list):
        _check_items(len(segments) + sum(len(s["blocks"]) for s in segments
                                         if isinstance(s, dict) and isinstance(s.get("blocks"), list)),
                     nbytes, path, "segments")
    _source_peak(trace, snap, device, saw_segments, segment_delta, peak_running)
    _source_live(trace, snap, device, max_events, nbytes)
    return trace


def _check_items(items: int, nbytes: int, path: str, where: str) -> None:
    if items > nbytes:
        raise ReplayError(f"{items:,} list items in {nbytes:,} bytes of pickle: the file names the same "
                          "lists many times over, which no memory snapshot does", path=path, where=where)


def _repeated(nbytes: int, path: str, where: str) -> None:
    raise ReplayError(f"more than {nbytes // MIN_EVENT_BYTES:,} events in {nbytes:,} bytes of pickle: the file "
                      "names the same entries many times over, which no memory snapshot does", path=path, where=where)


def _source_live(trace: Trace, snap: Dict[str, Any], device: int, max_events: int, nbytes: int) -> None:
    """The logged process's own peak live bytes, counting blocks allocated before the trace began.

    The replay skips those by default (their frees are "unknown"), so its peak live can be lower
    than what the logged allocator held; the logged allocator's ratio uses this figure. Such blocks
    are the ones the trace frees without having allocated, plus the ones the snapshot's segments
    show as still allocated that the trace never allocated (``Trace.pre_trace``).
    """
    trace.find_pre_trace()
    allocated = {ev.addr for ev in trace.events if ev.kind == ALLOC}
    segments = snap.get("segments")
    for seg in segments if isinstance(segments, list) else []:
        if not isinstance(seg, dict) or seg.get("device", device) != device:
            continue
        blocks = seg.get("blocks")
        for b in blocks if isinstance(blocks, list) else []:
            if not isinstance(b, dict) or b.get("state") not in ("active_allocated", "active_awaiting_free"):
                continue
            addr = b.get("address")
            size = b.get("requested_size", b.get("size"))
            if isinstance(addr, int) and isinstance(size, int) and 0 < size < 1 << 64 and 0 <= addr < 1 << 64 \
                    and addr not in allocated:
                if len(trace.events) + len(trace.pre_trace) >= max_events:
                    _repeated(nbytes, trace.path, "segments")
                trace.pre_trace.append(Event(ALLOC, addr, size, 0, -1))
    pre = sum(ev.size for ev in trace.pre_trace)
    if pre == 0:
        return
    live = peak = pre
    table: Dict[int, int] = {ev.addr: ev.size for ev in trace.pre_trace}
    for ev in trace.events:
        if ev.kind == ALLOC:
            table[ev.addr] = ev.size
            live += ev.size
            peak = max(peak, live)
        elif ev.addr in table:
            live -= table.pop(ev.addr)
    trace.info["source_live_before_trace"] = pre
    trace.info["source_peak_live_bytes"] = peak


def _source_peak(trace: Trace, snap: Dict[str, Any], device: int, saw: bool, delta: int, peak_running: int) -> None:
    """The logged allocator's own peak reserved bytes during the trace, when it can be known: the
    segments at snapshot time minus the trace's segment changes give the reserved bytes when the
    trace started; the running sum from there peaks where the allocator held the most."""
    segments: List[Any] = snap.get("segments") or []
    if not saw or not isinstance(segments, list):
        return
    total = 0
    for s in segments:
        if isinstance(s, dict) and s.get("device", device) == device and isinstance(s.get("total_size"), int):
            total += s["total_size"]
    start = total - delta
    if start < 0:
        return
    trace.info["source_reserved_at_start"] = start
    trace.info["source_peak_reserved_bytes"] = start + peak_running


__all__ = ["read", "looks_like", "REPLAYED"]
