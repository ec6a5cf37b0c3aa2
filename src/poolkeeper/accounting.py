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

import functools
import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Union

from poolkeeper.errors import InvariantError, brief

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
        raise InvariantError(f"not a poolkeeper snapshot: {what} must be an integer, got {brief(v)}")
    if not -(1 << 63) <= v < 1 << 64:  # addresses, sizes and handles are 64-bit
        raise InvariantError(f"not a poolkeeper snapshot: {what} must fit in 64 bits, got {v.bit_length()} bits")
    return v


def _version(v: Any) -> int:
    n = _int(v, "version")
    if not 0 <= n < 1 << 31:
        raise InvariantError(f"not a poolkeeper snapshot: version must be a small non-negative integer, got {n}")
    return n


def _alignment(v: Any) -> int:
    a = _int(v, "alignment")
    if a <= 0 or a & (a - 1):  # every pool's alignment is a power of two
        raise InvariantError(f"not a poolkeeper snapshot: alignment must be a power of two, got {a}")
    return a


def _flag(v: Any, what: str) -> bool:
    if not isinstance(v, bool):  # bool("no") is True: a string or number here is not a flag
        raise InvariantError(f"not a poolkeeper snapshot: {what} must be true or false, got {brief(v)}")
    return v


def _chunk(c: dict) -> "Chunk":
    if not isinstance(c, dict):
        raise InvariantError(f"not a poolkeeper snapshot: a chunk must be an object, got {brief(c)}")
    state = c.get("state")
    if not isinstance(state, str):
        raise InvariantError(f"not a poolkeeper snapshot: chunk state must be a string, got {brief(state)}")
    waits = c.get("waits_on") or []
    if not isinstance(waits, list):
        raise InvariantError(f"not a poolkeeper snapshot: waits_on must be a list, got {brief(waits)}")
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
                    resident=_flag(b.get("resident", False), "backing resident"),
                    oversize=_flag(b.get("oversize", False), "backing oversize"),
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
                alignment=_alignment(d["alignment"]),
                stats=stats,
                backings=backings,
                version=_version(d.get("version", 1)),
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            raise InvariantError(f"not a poolkeeper snapshot: {type(e).__name__}: {str(e)[:200]}") from e

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: Union[str, os.PathLike, None] = None, indent: Optional[int] = None) -> str:
        """Serialize; also write to ``path`` when given, whole or not at all (a new file beside it,
        renamed over it: see :func:`poolkeeper._paths.write_output`). Returns the JSON text.

        Raises :class:`~poolkeeper.errors.InvariantError` if a value cannot be written as JSON (one
        set by hand). Raises :class:`~poolkeeper.errors.InvalidArgumentError` for a ``path`` that is not a
        ``str`` / ``os.PathLike`` (an int is never taken as a file descriptor) or that names a
        directory, block device or socket (see :func:`poolkeeper._paths.output_path`)."""
        from poolkeeper._paths import output_path, write_output

        out = None if path is None else output_path(path, "path")
        try:
            text = json.dumps(self.to_dict(), indent=indent)
        except (TypeError, ValueError, RecursionError) as e:  # a value set by hand that JSON cannot hold
            raise InvariantError(f"the snapshot cannot be written as JSON: {type(e).__name__}: {str(e)[:200]}") from None
        if out is not None:
            write_output(out, text, "path")  # whole or not at all
        return text

    @classmethod
    def from_json(cls, source: Union[str, os.PathLike]) -> "Snapshot":
        """Parse JSON text (a ``str`` starting with ``{``), or read it from a file path (any other
        ``str``, or an ``os.PathLike``).

        Raises :class:`~poolkeeper.errors.InvalidArgumentError` for any other ``source`` (an int
        is never taken as a file descriptor: ``open(fd)`` would close the caller's descriptor)
        and for a path that is a directory; :class:`~poolkeeper.errors.InvariantError` for text
        that is not a snapshot."""
        if isinstance(source, str) and source.lstrip().startswith("{"):
            text = source
        else:
            from poolkeeper._paths import path_arg
            from poolkeeper.errors import InvalidArgumentError

            path = path_arg(source, "source")
            if os.path.isdir(path):
                raise InvalidArgumentError(f"source {path!r} is a directory, not a snapshot file")
            from poolkeeper._json import TooLargeError, read_text

            try:
                text = read_text(path)
            except UnicodeDecodeError as e:
                raise InvariantError(f"not a poolkeeper snapshot: {path!r} is not UTF-8 text (byte {e.start})") from None
            except TooLargeError as e:
                raise InvariantError(f"not a poolkeeper snapshot: {e}") from None
        from poolkeeper._json import unique_keys

        try:
            d = json.loads(text, object_pairs_hook=unique_keys)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, a key twice, int digit limit, deep nesting
            raise InvariantError(f"not a poolkeeper snapshot: not readable JSON ({type(e).__name__}: {str(e)[:200]})") from e
        if not isinstance(d, dict):
            raise InvariantError(f"not a poolkeeper snapshot: expected a JSON object, found {type(d).__name__}")
        return cls.from_dict(d)

    def to_html(self, path: Union[str, os.PathLike]) -> str:
        """Write a self-contained HTML memory map (see ``poolkeeper report``); returns the path.
        ``path`` is checked as for :meth:`to_json`."""
        from poolkeeper._paths import output_path, write_output
        from poolkeeper.report.memory_map import render_html

        out = output_path(path, "path")
        # Encoded with a lone surrogate escaped, before the file is opened, and replaced whole: a
        # pool name holding "\ud800" raised UnicodeEncodeError and left an empty file.
        return write_output(out, render_html(self), "path")

    # -- figures derived from the chunks alone --
    def to_torch(self, path: Union[str, os.PathLike], device: int = 0) -> str:
        """Write this snapshot as PyTorch's memory-snapshot pickle (``torch.cuda.memory._dump_snapshot``'s
        format) for ``device``: one segment per backing, blocks ``active_allocated`` /
        ``active_pending_free`` / ``inactive``. ``torch.cuda._memory_viz`` and ``poolkeeper replay``
        read it. Returns the path. ``device`` must be an int in [-1, 64) (the C ABI's device
        bound; -1, a simulated or host pool's, is written as device 0) and ``path`` is checked as
        for :meth:`to_json`: :class:`~poolkeeper.errors.InvalidArgumentError` otherwise."""
        from poolkeeper.integrations.torch_memory import write_torch_snapshot

        return write_torch_snapshot({device: self}, path)

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


def theil_sen_slope(values: list) -> float:
    """Median of the pairwise slopes ``(v[j] - v[i]) / (j - i)``: a trend estimate that a few
    outlying phases cannot drag (breakdown point 29%)."""
    slopes = sorted((values[j] - values[i]) / (j - i) for i in range(len(values)) for j in range(i + 1, len(values)))
    if not slopes:
        return 0.0
    m = len(slopes) // 2
    return float(slopes[m]) if len(slopes) % 2 else (slopes[m - 1] + slopes[m]) / 2.0


#: Above this many values :func:`mann_kendall_p` uses the normal approximation. The exact
#: distribution costs O(n^3) big-integer additions (0.05 s at 100, 0.4 s at 200, and the quadruple
#: loop it replaced took hours at 1000); at 100 the approximation is within 10% of the exact
#: p-value wherever that lies in [0.001, 0.1], around the default ``alpha`` of 0.01 (tested).
MK_EXACT_MAX = 100


@functools.lru_cache(maxsize=8)
def _mahonian_cdf(n: int) -> tuple:
    """``cdf[k]``: permutations of n items with at most k inversions (cumulative Mahonian numbers)."""
    counts = [1]
    for m in range(2, n + 1):
        # nxt[k] = counts[k - m + 1] + ... + counts[k]: a sliding-window sum, O(len) per m.
        nxt = []
        run = 0
        for k in range(len(counts) + m - 1):
            if k < len(counts):
                run += counts[k]
            if k >= m:
                run -= counts[k - m]
            nxt.append(run)
        counts = nxt
    return tuple(itertools.accumulate(counts))


def _mk_p_exact(s: int, n: int) -> float:
    max_inv = (n * (n - 1) // 2 - s) // 2  # S = pairs - 2 * inversions, so S >= s <=> inv <= max_inv
    if max_inv < 0:
        return 0.0
    cdf = _mahonian_cdf(n)
    return cdf[min(max_inv, len(cdf) - 1)] / cdf[-1]


def _mk_p_normal(s: int, n: int) -> float:
    # Var(S) with no ties; S moves in steps of 2, so P(S >= s) is read at s - 1 (continuity).
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    return 0.5 * math.erfc((s - 1) / (sd * math.sqrt(2.0)))


def mann_kendall_p(values: list) -> float:
    """One-sided p-value of Mann–Kendall's rank test for an upward trend: the probability, were the
    values in random order, of an S statistic (concordant minus discordant pairs) at least this
    large. Exact (inversion counts of permutations) up to :data:`MK_EXACT_MAX` values, the
    continuity-corrected normal approximation above; computed without the tie correction: ties
    only shrink S, so the test stays conservative on step-like series."""
    n = len(values)
    if n < 2:
        return 1.0
    s = 0
    for i in range(n):
        for j in range(i + 1, n):
            d = values[j] - values[i]
            s += (d > 0) - (d < 0)
    return _mk_p_exact(s, n) if n <= MK_EXACT_MAX else _mk_p_normal(s, n)


class PhaseTracker:
    """Tell a stable high-water mark from unbounded growth across repeated workload phases.

    Call :meth:`record` at a completion point after each repetition of the same workload (after
    synchronizing the streams it used). A healthy pool reaches a high-water mark: after a few
    warm-up phases reserved and live stop rising (they may still wander with the workload's
    noise). A leak keeps one of them trending up.

    The verdict looks at the last ``window`` phases after warm-up, separately for reserved and
    live, and calls a term growing only when all three hold:

    1. its Theil–Sen slope (median pairwise slope) is at least ``min_growth`` bytes per phase
       (and at least ``tolerance`` times the window's first value, when ``tolerance`` is given);
    2. Mann–Kendall's rank test finds an upward trend at level ``alpha`` (one-sided; exact up to
       :data:`MK_EXACT_MAX` phases, the normal approximation above, so any ``window`` is cheap);
    3. each third of the window sets a new high over the previous third (one raised high-water
       mark, or a plateau reached after a long warm-up, is not a leak).

    docs/accounting.md gives the measured false-positive and false-negative rates
    (``benchmarks/phase_tracker_rates.py``).

    Args:
        warmup: phases ignored while the pool grows to its high-water mark (default 2).
        tolerance: optional relative floor on the slope, per phase (default 0: off).
        window: how many of the latest post-warm-up phases are judged (default 16).
        min_growth: smallest slope, in bytes per phase, called growth (default 64 KiB).
        alpha: significance level of the rank test (default 0.01).
    """

    MIN_PHASES = 5  # the exact rank test cannot reach alpha=0.01 with fewer points

    def __init__(
        self,
        pool: Any = None,
        warmup: int = 2,
        tolerance: float = 0.0,
        *,
        window: int = 16,
        min_growth: int = 64 * 1024,
        alpha: float = 0.01,
    ) -> None:
        from poolkeeper.errors import InvalidArgumentError

        for name, v, lo in (("warmup", warmup, 0), ("window", window, self.MIN_PHASES), ("min_growth", min_growth, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}; got {v!r}")
        for name, f, ok in (("tolerance", tolerance, lambda x: 0 <= x < 1e6), ("alpha", alpha, lambda x: 0 < x < 1)):
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not ok(f):
                raise InvalidArgumentError(f"{name} out of range; got {f!r}")
        self.pool = pool
        self.warmup = warmup
        self.tolerance = float(tolerance)
        self.window = window
        self.min_growth = min_growth
        self.alpha = float(alpha)
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

    def trend(self, term: str) -> dict:
        """The figures behind the verdict for ``term`` (``"reserved"`` or ``"live"``): ``slope``
        (bytes per phase), ``p`` (rank test), ``new_high`` (each third of the window tops the last), ``threshold``, ``phases``,
        ``growing``."""
        recs = self.records[self.warmup :][-self.window :]
        vals = [getattr(r, term) for r in recs]
        slope = theil_sen_slope(vals)
        p = mann_kendall_p(vals)
        # Each third of the window must top the previous one: a leak keeps setting new highs, a
        # high-water mark raised once (one step, a plateau after a long warm-up) does not.
        k = len(vals) // 3
        thirds = [vals[:k], vals[k : len(vals) - k], vals[len(vals) - k :]] if k else []
        new_high = bool(thirds) and max(thirds[0]) < max(thirds[1]) < max(thirds[2])
        threshold = max(float(self.min_growth), self.tolerance * max(vals[0], 1) if vals else 0.0)
        growing = len(vals) >= self.MIN_PHASES and slope >= threshold and p <= self.alpha and new_high
        return {"slope": slope, "p": p, "new_high": new_high, "threshold": threshold, "phases": len(vals),
                "first": vals[0] if vals else 0, "last": vals[-1] if vals else 0, "peak": max(vals) if vals else 0,
                "growing": growing}

    def verdict(self) -> PhaseVerdict:
        need = self.warmup + self.MIN_PHASES
        if len(self.records) < need:
            return PhaseVerdict(True, [], f"need at least {need} phases to judge; have {len(self.records)}", self.records)
        growing = []
        details = []
        for term in ("reserved", "live"):
            t = self.trend(term)
            if t["growing"]:
                growing.append(term)
                details.append(
                    f"{term} trends up over the last {t['phases']} phases: {t['first']} -> {t['last']} bytes"
                    f" (+{t['slope']:.0f} per phase, Theil-Sen; rank test p={t['p']:.2g})"
                )
            else:
                details.append(f"{term} stable at a high-water mark of {t['peak']} bytes")
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
    "theil_sen_slope",
    "mann_kendall_p",
    "STATES",
]
