"""Replays a parsed allocation log against a pool and measures what the pool held.

Addresses in the log are identities only: each logged allocation gets a fresh block from the
pool, and the logged free of that address returns it. Events the replay cannot honour are
counted, never fatal: a free of an address the log never allocated (logging started mid-run, or
a ring buffer dropped the allocation), an allocation the logged process failed, a zero-byte
allocation, and an allocation of an address that is still live in the log (its missing free is
assumed). Streams are not replayed (every call uses ``stream=None``: the log's device work has
long completed), so the figures show the pool's placement policy, not stream order.

Every allocate and deallocate is timed on its own (``perf_counter_ns`` around the call).
"Fragmentation at the peak" is the pool's own figure at the moment live bytes peaked.

A pool that refuses an event (an allocation larger than it can hold, an absurd size) stops the
replay with its own error (type and figures kept), the message led by the event that failed:
its index in ``trace.events`` and its place in the log (``line N`` of a CSV log, ``entry N`` of
a snapshot's trace), also set as the error's ``event`` and ``line`` (None when not a line).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Callable, Dict, Optional

from poolkeeper.bench.quantiles import new_samples, summarize
from poolkeeper.bench.readers.trace import ALLOC, ALLOC_FAILED, FREE, Event, Trace
from poolkeeper.errors import PoolkeeperError

PEAK_STATS = ("reserved_bytes", "free_bytes", "largest_free_block", "fragmentation", "free_chunks", "backings")


@dataclass
class ReplayCounts:
    allocations: int = 0
    frees: int = 0
    unknown_frees: int = 0
    failed_in_log: int = 0
    zero_size: int = 0
    reallocated_live: int = 0
    size_mismatch_frees: int = 0
    pre_trace_blocks: int = 0


def _name_event(err: PoolkeeperError, trace: Trace, index: Optional[int], ev: Event) -> None:
    """Lead ``err``'s message with the event the pool refused. The error itself is kept (its type
    and figures are what a caller catches: an OOM stays an OOM), only its text and two figures
    are added."""
    place = trace.where_text(ev.where) if ev.where >= 0 else "held from before the log began"
    what = f"{ev.kind} of {ev.size} bytes at 0x{ev.addr:x}"
    head = f"event {index} ({place}: {what})" if index is not None else f"a block {place} ({what})"
    msg = f"{head}: {err.message or err}"
    err.message = msg
    err.args = (msg,)
    err.event = index
    err.line = ev.where if trace.location == "line" and ev.where >= 0 else None


def replay(trace: Trace, pool: Any, upstream: Any, on_progress: Optional[Callable[[int, int], None]] = None,
           include_pre_trace: bool = False) -> Dict[str, Any]:
    """Replay ``trace`` on ``pool`` (which draws from ``upstream``); return the report dict.

    ``include_pre_trace``: first allocate (untimed) the blocks the logged process held from before
    the log began (``trace.pre_trace``), so the pool holds what the logged allocator held and their
    frees are no longer unknown.
    """
    counts = ReplayCounts()
    alloc_t = new_samples()
    free_t = new_samples()
    table: Dict[int, tuple] = {}  # logged address -> (pool pointer, size)
    live = peak_live = 0
    at_peak: Dict[str, Any] = {}
    peak_pending = False
    alloc, free = pool.allocate, pool.deallocate
    if include_pre_trace:
        for ev in trace.pre_trace:
            if ev.size and ev.addr not in table:
                try:
                    table[ev.addr] = (alloc(ev.size), ev.size)
                except PoolkeeperError as e:
                    _name_event(e, trace, None, ev)
                    raise
                live += ev.size
                counts.pre_trace_blocks += 1
        peak_live = live
    events = trace.events
    n = len(events)
    step = max(1, n // 200)

    stats_ns = 0

    def take_peak() -> None:
        nonlocal stats_ns
        t = perf_counter_ns()
        st = pool.stats()
        stats_ns += perf_counter_ns() - t
        at_peak.clear()
        at_peak.update({k: st.get(k) for k in PEAK_STATS})
        at_peak["live_bytes"] = peak_live

    gc_was = gc.isenabled()
    gc.disable()
    t_start = perf_counter_ns()
    i, ev = -1, None
    try:
        for i, ev in enumerate(events):
            if on_progress is not None and i % step == 0:
                on_progress(i, n)
            kind = ev.kind
            if kind == ALLOC:
                if ev.size == 0:
                    counts.zero_size += 1
                    continue
                old = table.pop(ev.addr, None)
                if old is not None:  # the log lost this address's free: assume it
                    counts.reallocated_live += 1
                    free(old[0])
                    live -= old[1]
                t0 = perf_counter_ns()
                p = alloc(ev.size)
                alloc_t.append(perf_counter_ns() - t0)
                table[ev.addr] = (p, ev.size)
                counts.allocations += 1
                live += ev.size
                if live > peak_live:
                    peak_live = live
                    peak_pending = True
            elif kind == FREE:
                entry = table.pop(ev.addr, None)
                if entry is None:
                    if ev.addr == 0:
                        counts.zero_size += 1
                    else:
                        counts.unknown_frees += 1
                    continue
                if peak_pending:  # live is about to fall: the pool's state now is the peak's
                    take_peak()
                    peak_pending = False
                if ev.size and ev.size != entry[1]:
                    counts.size_mismatch_frees += 1
                t0 = perf_counter_ns()
                free(entry[0])
                free_t.append(perf_counter_ns() - t0)
                counts.frees += 1
                live -= entry[1]
            elif kind == ALLOC_FAILED:
                counts.failed_in_log += 1
        i, ev = -1, None  # past the events: what fails from here is no event's
        if peak_pending:
            take_peak()
        wall = perf_counter_ns() - t_start - stats_ns  # the peak snapshots are not replay time
        live_at_end = sum(s for _, s in table.values())
        blocks_at_end = len(table)
        stats = pool.stats()
        counters = upstream.counters()
        for p, _ in table.values():
            free(p)
        table.clear()
    except PoolkeeperError as e:
        if ev is not None:
            _name_event(e, trace, i, ev)
        raise
    finally:
        if gc_was:
            gc.enable()
    if on_progress is not None:
        on_progress(n, n)

    all_t = new_samples()
    all_t.extend(alloc_t)
    all_t.extend(free_t)
    peak_reserved = stats["peak_reserved_bytes"]
    ops = len(all_t)
    return {
        "events": n,
        "include_pre_trace": include_pre_trace,
        "counts": counts.__dict__.copy(),
        "ignored_actions": dict(trace.ignored),
        "peak_live_bytes": peak_live,
        "peak_reserved_bytes": peak_reserved,
        "reserved_over_live": (peak_reserved / peak_live) if peak_live else None,
        "at_peak_live": at_peak,
        "fragmentation_at_peak": at_peak.get("fragmentation"),
        "upstream_allocations": counters["allocations"],
        "upstream_deallocations": counters["deallocations"],
        # Second mappings of mapped memory (the expandable arena's stitching): driver calls too,
        # but no memory, so counted apart from the allocations.
        "upstream_aliases": counters.get("aliases", 0),
        "upstream_unaliases": counters.get("unaliases", 0),
        # The runs the expandable arena gave its unmaps and unaliases back in: one driver call each
        # where the driver takes a run of mappings at once (docs/expandable.md, "Runs").
        "unmap_runs": stats.get("unmap_runs", 0),
        "unalias_runs": stats.get("unalias_runs", 0),
        "upstream_alloc_ns": counters.get("alloc_ns"),
        "upstream_dealloc_ns": counters.get("dealloc_ns"),
        "live_at_end_bytes": live_at_end,
        "live_at_end_blocks": blocks_at_end,
        "ops": ops,
        "wall_s": wall / 1e9,
        "ops_per_s": ops / (wall / 1e9) if wall else None,
        "alloc": summarize(alloc_t),
        "free": summarize(free_t),
        "all": summarize(all_t),
    }


__all__ = ["replay", "ReplayCounts"]
