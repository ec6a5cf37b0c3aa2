"""Accounting: snapshots, the partition check, fragmentation, and phase (leak) comparison.

The partition, at one observation point, for one pool:

    reserved == live + free + pending + overhead

- reserved: bytes held from the upstream (sum of backing sizes).
- live: bytes callers asked for, over blocks not yet released.
- free: bytes reusable by any stream now (thread-cached blocks included, reported separately).
- pending: released bytes still waiting for stream order (an event on the releasing stream and
  on every ``record_stream`` stream). Never counted as free.
- overhead: rounding and alignment slack of live blocks (chunk size - requested).

A :class:`Snapshot` lists every backing and its chunks, so the partition can be re-verified from
the snapshot alone (:func:`check`), rendered as an HTML memory map (``to_html``), and compared
across phases of a repeated workload (:class:`PhaseTracker`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Union

from poolkeeper.errors import InvariantError

STATES = ("live", "free", "pending", "thread_cached")


@dataclass
class Chunk:
    """One chunk of a backing. ``requested`` is set for live chunks only."""

    offset: int
    size: int
    state: str
    requested: Optional[int] = None
    alloc_stream: Optional[int] = None
    last_stream: Optional[int] = None
    event: Optional[int] = None
    waits_on: list = field(default_factory=list)


def _int(v: Any, what: str, optional: bool = False) -> Optional[int]:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvariantError(f"not a poolkeeper snapshot: {what} must be an integer, got {v!r}")
    return v


def _chunk(c: dict) -> "Chunk":
    if not isinstance(c, dict):
        raise InvariantError(f"not a poolkeeper snapshot: a chunk must be an object, got {c!r}")
    state = c.get("state")
    if not isinstance(state, str):
        raise InvariantError(f"not a poolkeeper snapshot: chunk state must be a string, got {state!r}")
    waits = c.get("waits_on") or []
    if not isinstance(waits, list):
        raise InvariantError(f"not a poolkeeper snapshot: waits_on must be a list, got {waits!r}")
    return Chunk(
        offset=_int(c.get("offset"), "chunk offset"),
        size=_int(c.get("size"), "chunk size"),
        state=state,
        requested=_int(c.get("requested"), "chunk requested", optional=True),
        alloc_stream=_int(c.get("alloc_stream"), "alloc_stream", optional=True),
        last_stream=_int(c.get("last_stream"), "last_stream", optional=True),
        event=_int(c.get("event"), "event", optional=True),
        waits_on=[_int(w, "waits_on entry", optional=True) for w in waits],
    )


@dataclass
class Backing:
    """One piece of upstream memory, tiled exactly by its chunks."""

    address: int
    size: int
    resident: bool = False
    oversize: bool = False
    chunks: list = field(default_factory=list)


@dataclass
class Snapshot:
    """A pool's memory at one observation point."""

    pool: str
    upstream: str
    alignment: int
    stats: dict
    backings: list
    version: int = 1

    @classmethod
    def from_dict(cls, d: dict) -> "Snapshot":
        try:
            backings = [
                Backing(
                    address=_int(b["address"], "backing address"),
                    size=_int(b["size"], "backing size"),
                    resident=bool(b.get("resident", False)),
                    oversize=bool(b.get("oversize", False)),
                    chunks=[_chunk(c) for c in b["chunks"]],
                )
                for b in d["backings"]
            ]
            stats = dict(d["stats"])
            # JSON turns int keys into strings; stream handles are ints.
            pbs = stats.get("pending_by_stream") or {}
            stats["pending_by_stream"] = {(None if k in (None, "null", "None") else int(k)): v for k, v in pbs.items()}
            return cls(
                pool=d["pool"],
                upstream=d["upstream"],
                alignment=int(d["alignment"]),
                stats=stats,
                backings=backings,
                version=int(d.get("version", 1)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvariantError(f"not a poolkeeper snapshot: {e!r}") from e

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: Union[str, os.PathLike, None] = None, indent: Optional[int] = None) -> str:
        """Serialize; also write to ``path`` when given. Returns the JSON text."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, source: Union[str, os.PathLike]) -> "Snapshot":
        """Parse JSON text, or read it from a file path."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            with open(source, encoding="utf-8") as f:
                text = f.read()
        return cls.from_dict(json.loads(text))

    def to_html(self, path: Union[str, os.PathLike]) -> str:
        """Write a self-contained HTML memory map (see ``poolkeeper report``)."""
        from poolkeeper.report.memory_map import render_html

        html = render_html(self)
        with open(path, "w", encoding="utf-8") as f:
            f.write(html)
        return str(path)

    # -- figures derived from the chunks alone --
    def chunks(self) -> Iterable[tuple[Backing, Chunk]]:
        for b in self.backings:
            for c in b.chunks:
                yield b, c

    def partition(self) -> "Partition":
        return check(self, compare_stats=False)


@dataclass
class Partition:
    reserved: int
    live: int
    free: int
    pending: int
    overhead: int
    thread_cached: int
    largest_free: int
    free_chunks: int

    @property
    def fragmentation(self) -> float:
        return fragmentation(self.free, self.largest_free)


def fragmentation(free: int, largest_free: int) -> float:
    """1 - largest_free / free: 0 when all free memory is one block, near 1 when it is dust."""
    return 0.0 if free <= 0 else 1.0 - largest_free / free


def check(snapshot: Snapshot, compare_stats: bool = True) -> Partition:
    """Re-verify the partition from the snapshot alone.

    Checks that chunks tile each backing exactly (no gap, no overlap, none outside), that no two
    backings overlap, that every chunk state is known and live chunks have ``requested <= size``,
    and (``compare_stats``) that the recomputed terms equal the pool's reported stats and satisfy
    ``reserved == live + free + pending + overhead``. Raises :class:`InvariantError` naming the
    first breach; returns the recomputed :class:`Partition`.
    """
    reserved = live = free = pending = overhead = cached = largest = nfree = 0
    spans = []
    for b in snapshot.backings:
        if b.size <= 0:
            raise InvariantError(f"backing at {b.address:#x} has size {b.size}")
        spans.append((b.address, b.address + b.size))
        reserved += b.size
        off = 0
        for c in b.chunks:
            if c.offset != off:
                kind = "gap" if c.offset > off else "overlap (a region counted twice)"
                raise InvariantError(
                    f"backing {b.address:#x}: chunk at offset {c.offset} but the previous chunk ends at {off}: {kind}"
                )
            if c.size <= 0:
                raise InvariantError(f"backing {b.address:#x}: chunk at offset {c.offset} has size {c.size}")
            off += c.size
            if c.state == "live":
                req = c.requested if c.requested is not None else c.size
                if req > c.size:
                    raise InvariantError(f"live chunk at {b.address + c.offset:#x}: requested {req} > size {c.size}")
                live += req
                overhead += c.size - req
            elif c.state in ("free", "thread_cached"):
                free += c.size
                nfree += 1
                largest = max(largest, c.size)
                if c.state == "thread_cached":
                    cached += c.size
            elif c.state == "pending":
                pending += c.size
            else:
                raise InvariantError(f"chunk at {b.address + c.offset:#x} has unknown state {c.state!r}")
        if off != b.size:
            raise InvariantError(
                f"backing {b.address:#x}: chunks cover {off} of {b.size} bytes (a missing chunk)"
                if off < b.size
                else f"backing {b.address:#x}: chunks run {off - b.size} bytes past its end"
            )
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        if b0 < a1:
            raise InvariantError(f"backings at {a0:#x} and {b0:#x} overlap")
    part = Partition(reserved, live, free, pending, overhead, cached, largest, nfree)
    if compare_stats:
        st = snapshot.stats
        pending_total = st.get("pending_bytes", 0)
        # Thread-cached blocks tied to a stream are pending, not free; snapshots show them as
        # pending already, so compare term by term.
        want = {
            "reserved_bytes": reserved,
            "live_bytes": live,
            "free_bytes": free,
            "pending_bytes": pending,
            "overhead_bytes": overhead,
        }
        for k, v in want.items():
            if k in st and st[k] != v:
                raise InvariantError(f"{k}: the pool reported {st[k]} but the chunks add up to {v}")
        if reserved != live + free + pending + overhead:
            raise InvariantError(
                f"reserved {reserved} != live {live} + free {free} + pending {pending} + overhead {overhead}"
            )
        del pending_total
    return part


@dataclass
class PhaseRecord:
    phase: int
    reserved: int
    live: int
    free: int
    pending: int
    upstream_allocations: int


@dataclass
class PhaseVerdict:
    """Result of :meth:`PhaseTracker.verdict`."""

    stable: bool
    growing: list  # which of "reserved", "live" grow without bound
    message: str
    records: list

    def __bool__(self) -> bool:
        return self.stable


class PhaseTracker:
    """Tell a stable high-water mark from unbounded growth across repeated workload phases.

    Call :meth:`record` at a completion point after each repetition of the same workload (after
    synchronizing the streams it used). A healthy pool reaches a high-water mark: after a few
    warm-up phases reserved and live stop rising. A leak keeps one of them rising phase after
    phase.

    Args:
        warmup: phases ignored while the pool grows to its high-water mark (default 2).
        tolerance: relative growth per phase still counted as flat (default 0.01).
    """

    def __init__(self, pool: Any = None, warmup: int = 2, tolerance: float = 0.01) -> None:
        self.pool = pool
        self.warmup = warmup
        self.tolerance = tolerance
        self.records: list[PhaseRecord] = []

    def record(self, stats: Optional[dict] = None) -> PhaseRecord:
        if stats is None:
            if self.pool is None:
                raise ValueError("PhaseTracker.record() needs stats or a pool")
            stats = self.pool.stats()
        r = PhaseRecord(
            phase=len(self.records),
            reserved=int(stats["reserved_bytes"]),
            live=int(stats["live_bytes"]),
            free=int(stats["free_bytes"]),
            pending=int(stats["pending_bytes"]),
            upstream_allocations=int(stats.get("upstream_allocations", 0)),
        )
        self.records.append(r)
        return r

    def verdict(self) -> PhaseVerdict:
        recs = self.records[self.warmup :]
        if len(recs) < 3:
            return PhaseVerdict(
                True, [], f"need at least {self.warmup + 3} phases to judge; have {len(self.records)}", self.records
            )
        growing = []
        details = []
        for term in ("reserved", "live"):
            vals = [getattr(r, term) for r in recs]
            rises = [b - a for a, b in zip(vals, vals[1:])]
            base = max(vals[0], 1)
            # Growth without bound: the term rises (beyond tolerance) in every later phase pair.
            if all(d > self.tolerance * base for d in rises):
                growing.append(term)
                details.append(
                    f"{term} grew in each of the last {len(rises)} phases: {vals[0]} -> {vals[-1]} bytes"
                    f" (+{(vals[-1] - vals[0]) / len(rises):.0f} per phase)"
                )
            else:
                details.append(f"{term} stable at a high-water mark of {max(vals)} bytes")
        stable = not growing
        msg = ("stable: " if stable else "growing without bound: ") + "; ".join(details)
        return PhaseVerdict(stable, growing, msg, self.records)


__all__ = [
    "Chunk",
    "Backing",
    "Snapshot",
    "Partition",
    "check",
    "fragmentation",
    "PhaseTracker",
    "PhaseVerdict",
    "STATES",
]
