"""``poolkeeper report``: a pool snapshot as a self-contained HTML memory map.

Each backing is a horizontal bar; its chunks are coloured by state (live, free, pending,
thread-cached; the slack of a live chunk beyond its requested size as overhead) and sized by bytes.
Hover shows a chunk's details, click pins them. A summary states the partition
``reserved = live + free + pending + overhead`` with its figures, the largest free block and the
fragmentation.

The snapshot is verified with :func:`poolkeeper.accounting.check` before anything is drawn: a
snapshot whose chunks do not tile their backings, or whose figures disagree with the pool's own
stats, is refused with :class:`~poolkeeper.errors.InvariantError` rather than drawn wrongly.

Chunk data is embedded as compact per-backing columns and drawn on a canvas that only paints the
rows in view, so snapshots with 100,000 chunks stay responsive (no DOM node per chunk).
"""
from __future__ import annotations

import argparse
import html
import math
import os
import sys
from typing import Any, Union

from poolkeeper.accounting import STATES, Backing, Chunk, Snapshot, check
from poolkeeper.errors import InvalidArgumentError, InvariantError, PoolkeeperError, brief
from poolkeeper._json import load as load_json
from poolkeeper.report._inline import asset, fill, inline_code, script_json

_STATE_CODE = {s: i for i, s in enumerate(STATES)}
# Integers above this lose precision as JavaScript numbers; handles that large are sent as text.
_JS_SAFE = 2**53 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_types(snapshot: Snapshot) -> None:
    """Refuse fields of the wrong type before ``check`` does arithmetic on them. A snapshot read by
    ``Snapshot.from_dict`` has the right types already; one built or changed by hand may not (a
    ``float("nan")`` alignment, a backing that is not a :class:`Backing`), and got a bare
    ``AttributeError`` or ``ValueError`` from deep inside the rendering."""
    for name in ("alignment", "version"):
        v = getattr(snapshot, name)
        if not _is_int(v) or not 0 <= v <= _JS_SAFE:
            raise InvariantError(f"snapshot {name} must be a non-negative integer, not {brief(v)}")
    if not isinstance(snapshot.stats, dict):
        raise InvariantError(f"snapshot stats must be a dict, not {brief(snapshot.stats)}")
    if not isinstance(snapshot.backings, list):
        raise InvariantError("snapshot backings must be a list")
    for i, b in enumerate(snapshot.backings):
        if not isinstance(b, Backing):
            raise InvariantError(f"backing #{i} must be a Backing, not {brief(b)}")
        if not (isinstance(b.resident, bool) and isinstance(b.oversize, bool)):
            raise InvariantError(f"backing #{i}: resident and oversize must be booleans")
        if not (_is_int(b.address) and _is_int(b.size)):
            raise InvariantError(f"backing #{i}: address and size must be integers")
        if not 0 <= b.address <= _JS_SAFE or b.size > _JS_SAFE:
            raise InvariantError(f"backing #{i}: address {brief(b.address)} or size {brief(b.size)} out of range")
        if not isinstance(b.chunks, list):
            raise InvariantError(f"backing {b.address:#x}: chunks must be a list")
        for j, c in enumerate(b.chunks):
            if not isinstance(c, Chunk):
                raise InvariantError(f"backing {b.address:#x}: chunk #{j} must be a Chunk, not {brief(c)}")
            where = f"backing {b.address:#x}, chunk at offset {brief(c.offset)}"
            if not (_is_int(c.offset) and _is_int(c.size)):
                raise InvariantError(f"{where}: offset and size must be integers")
            if c.state not in _STATE_CODE:
                raise InvariantError(f"{where}: unknown state {brief(c.state)} (expected one of {', '.join(STATES)})")
            for name in ("requested", "alloc_stream", "last_stream", "event"):
                v = getattr(c, name)
                if v is not None and not _is_int(v):
                    raise InvariantError(f"{where}: {name} must be an integer or null, not {brief(v)}")
            if not isinstance(c.waits_on, list) or not all(_is_int(s) or s is None for s in c.waits_on):
                raise InvariantError(f"{where}: waits_on must be a list of stream handles")


def _handle(v: Any) -> str:
    """A stream or event handle as the page shows it: small ones in decimal, pointers in hex."""
    return str(v) if 0 <= v < 2**32 else hex(v)


def page_data(snapshot: Snapshot) -> dict:
    """Verify ``snapshot`` and pack it for the page (columns per backing, streams as indices).

    Raises :class:`InvariantError` if the snapshot is malformed or does not add up.
    """
    _check_types(snapshot)
    part = check(snapshot, compare_stats=True)
    streams: dict[Any, int] = {}

    def sid(v: Any) -> int:
        if v is None:
            return -1
        if v not in streams:
            streams[v] = len(streams)
        return streams[v]

    backings = []
    for b in snapshot.backings:
        cols: dict[str, list] = {"off": [], "sz": [], "st": [], "req": [], "as": [], "ls": [], "ev": [], "w": []}
        for c in b.chunks:
            cols["off"].append(c.offset)
            cols["sz"].append(c.size)
            cols["st"].append(_STATE_CODE[c.state])
            cols["req"].append(c.requested if c.state == "live" else None)
            cols["as"].append(sid(c.alloc_stream))
            cols["ls"].append(sid(c.last_stream))
            cols["ev"].append(None if c.event is None else _handle(c.event))
            cols["w"].append([sid(s) for s in c.waits_on] if c.waits_on else None)
        backings.append(
            {"address": hex(b.address), "size": b.size, "resident": b.resident, "oversize": b.oversize, **cols}
        )
    stats = {
        k: v
        for k, v in snapshot.stats.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and (not isinstance(v, float) or math.isfinite(v))
    }
    pbs = snapshot.stats.get("pending_by_stream") or {}
    pending_by_stream = [
        ["default" if k is None else _handle(k) if _is_int(k) else str(k), v]
        for k, v in (pbs.items() if isinstance(pbs, dict) else [])
        if _is_int(v)
    ]
    return {
        "pool": str(snapshot.pool),
        "upstream": str(snapshot.upstream),
        "alignment": snapshot.alignment,
        "version": snapshot.version,
        "states": list(STATES),
        "streams": ["default" if h is None else _handle(h) for h in streams],
        "verified": {
            "reserved": part.reserved,
            "live": part.live,
            "free": part.free,
            "pending": part.pending,
            "overhead": part.overhead,
            "thread_cached": part.thread_cached,
            "largest_free": part.largest_free,
            "free_chunks": part.free_chunks,
            "fragmentation": part.fragmentation,
        },
        "stats": stats,
        "pending_by_stream": pending_by_stream,
        "backings": backings,
    }


def render_html(snapshot: Union[Snapshot, dict]) -> str:
    """The memory map of ``snapshot`` (a :class:`Snapshot` or its dict) as one HTML document.

    Raises :class:`InvariantError` if the snapshot does not verify (see :func:`page_data`).
    """
    if isinstance(snapshot, dict):
        snapshot = Snapshot.from_dict(snapshot)
    if not isinstance(snapshot, Snapshot):
        raise InvalidArgumentError(f"render_html takes a Snapshot or its dict, not {brief(snapshot)}")
    data = page_data(snapshot)
    title = f"poolkeeper memory map: {snapshot.pool} on {snapshot.upstream}"
    return fill(
        asset("memory_map.html"),
        {
            "TITLE": html.escape(title),
            "CSS": inline_code(asset("memory_map.css"), "</style"),
            "JS": inline_code(asset("memory_map.js"), "</script"),
            "DATA": script_json(data),
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("snapshot", metavar="SNAPSHOT.json", help="a snapshot written by pool.snapshot().to_json(path)")
    parser.add_argument("-o", "--output", metavar="MAP.html", help="where to write the map (default: SNAPSHOT.html)")


def run(args: argparse.Namespace) -> int:
    from poolkeeper._paths import check_not_input, output_path, write_output

    default = os.path.splitext(args.snapshot)[0] + ".html"
    out = output_path(args.output or default, "output")
    if not args.output and os.path.normcase(os.path.abspath(default)) == os.path.normcase(os.path.abspath(args.snapshot)):
        # SNAPSHOT.html's default output is itself: writing it would replace the snapshot with its map.
        print(f"poolkeeper report: {args.snapshot} would be its own output (the map goes to SNAPSHOT.html); "
              "choose one with -o MAP.html", file=sys.stderr)
        return 1
    check_not_input(out, [args.snapshot], "output")
    try:
        raw = load_json(args.snapshot)  # bounded, strict about duplicate keys
        if not isinstance(raw, dict):
            raise InvariantError(f"expected a JSON object, found {type(raw).__name__}")
        page = render_html(Snapshot.from_dict(raw))
    except (ValueError, RecursionError) as e:  # undecodable, not JSON, an int over the digit limit, deep nesting
        print(f"poolkeeper report: {args.snapshot} is not readable JSON: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return 1
    except PoolkeeperError as e:
        print(f"poolkeeper report: refusing {args.snapshot}: {e}", file=sys.stderr)
        return 1
    except (TypeError, KeyError, AttributeError, OverflowError) as e:
        # A field of a type the checks above did not foresee: still the file's fault, said in one line.
        print(f"poolkeeper report: refusing {args.snapshot}: malformed snapshot ({type(e).__name__}: {str(e)[:200]})",
              file=sys.stderr)
        return 1
    # A lone surrogate in a snapshot's text (valid JSON, "\ud800") cannot be written as UTF-8: it is
    # written escaped, and encoded before the file is opened; the file is replaced whole or not at
    # all (a full disk or a Ctrl-C leaves no half-written map).
    write_output(out, page, "output", [args.snapshot])
    print(f"wrote {out}")
    return 0
