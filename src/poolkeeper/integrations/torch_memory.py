"""PyTorch's memory API vocabulary over poolkeeper's pools, without torch.

PyTorch's pluggable allocator interface (2.x, checked against 2.11) answers
``torch.cuda.memory_stats``, ``reset_peak_memory_stats`` and ``memory_snapshot`` with an error
("CUDAPluggableAllocator does not yet support getDeviceStats"), and offers no hook for them. So
:mod:`poolkeeper.integrations.torch` serves the same names itself; this module holds the mapping,
written over plain pool stats and :class:`~poolkeeper.accounting.Snapshot` objects so that it works
(and is tested) on any pool, simulated ones included.

Mapping (``.all`` only: poolkeeper has no small/large pool split):

=====================================  ==========================================================
PyTorch key                            poolkeeper figure
=====================================  ==========================================================
``allocated_bytes.all.current/peak``   ``live_bytes`` / ``peak_live_bytes`` (bytes asked for;
                                       the rounding slack is ``overhead_bytes``, inside reserved)
``requested_bytes.all.current/peak``   the same (poolkeeper's live bytes are the requested bytes)
``reserved_bytes.all.current/peak``    ``reserved_bytes`` / ``peak_reserved_bytes``
``active_bytes.all.current``           ``live_bytes + pending_bytes`` (released, still waiting
                                       for stream order: PyTorch's "active, pending free")
``inactive_split_bytes.all.current``   ``free_bytes``
``allocation.all.current``             ``live_blocks``
``active.all.current``                 ``live_blocks + pending_blocks``
``inactive_split.all.current``         ``free_chunks``
``segment.all.current``                ``backings``
``oversize_segments.all.current``      ``oversize_backings`` (arena)
``num_alloc_retries``                  ``oom_retries`` (arena: growth failed, caches flushed and
                                       free backings returned, then retried)
``num_ooms``                           ``ooms`` (OutOfMemory errors raised by the pool)
``num_device_alloc/free``              ``upstream_allocations`` / ``upstream_deallocations``
=====================================  ==========================================================

Keys whose figure poolkeeper does not track (``active_bytes.all.peak``, ``segment.all.peak``,
cumulative ``allocated``/``freed`` counters) are left out rather than invented.

The snapshot export writes PyTorch's memory-snapshot pickle (what ``torch.cuda.memory._snapshot``
returns): one segment per backing with its blocks; states ``active_allocated`` (live),
``active_pending_free`` (pending) and ``inactive`` (free, thread-cached included). Segment totals
add up to reserved bytes and active blocks' ``requested_size`` to live bytes. ``device_traces``
holds one empty list per device: a pool keeps no allocation history.
"""
from __future__ import annotations

import operator
import os
import pickle
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Union

from poolkeeper import _core
from poolkeeper.accounting import Snapshot

TORCH_BLOCK_STATE = {
    "live": "active_allocated",
    "pending": "active_pending_free",
    "free": "inactive",
    "thread_cached": "inactive",
}


def memory_stats_from(st: Mapping[str, Any]) -> "OrderedDict[str, int]":
    """PyTorch's ``memory_stats()`` keys from one pool's ``stats()`` dict (see the module table)."""
    live, pending = int(st.get("live_bytes", 0)), int(st.get("pending_bytes", 0))
    out: Dict[str, int] = {
        "allocated_bytes.all.current": live,
        "allocated_bytes.all.peak": int(st.get("peak_live_bytes", live)),
        "requested_bytes.all.current": live,
        "requested_bytes.all.peak": int(st.get("peak_live_bytes", live)),
        "reserved_bytes.all.current": int(st.get("reserved_bytes", 0)),
        "reserved_bytes.all.peak": int(st.get("peak_reserved_bytes", st.get("reserved_bytes", 0))),
        "active_bytes.all.current": live + pending,
        "inactive_split_bytes.all.current": int(st.get("free_bytes", 0)),
        "allocation.all.current": int(st.get("live_blocks", 0)),
        "active.all.current": int(st.get("live_blocks", 0)) + int(st.get("pending_blocks", 0)),
        "inactive_split.all.current": int(st.get("free_chunks", 0)),
        "segment.all.current": int(st.get("backings", 0)),
        "oversize_segments.all.current": int(st.get("oversize_backings", 0)),
        "num_alloc_retries": int(st.get("oom_retries", 0)),
        "num_ooms": int(st.get("ooms", 0)),
        "num_device_alloc": int(st.get("upstream_allocations", 0)),
        "num_device_free": int(st.get("upstream_deallocations", 0)),
    }
    return OrderedDict(sorted(out.items()))  # PyTorch returns its keys sorted


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def summary_text(stats_by_device: Mapping[int, Mapping[str, Any]], names: Mapping[int, str] = None) -> str:
    """A plain-text report like ``torch.cuda.memory_summary()``, one block per device."""
    names = names or {}
    lines: List[str] = []
    bar = "=" * 78
    for device in sorted(stats_by_device):
        st = stats_by_device[device]
        m = memory_stats_from(st)
        lines += [bar, f" poolkeeper memory summary, device {device}: {names.get(device, '')}".rstrip(), bar]
        rows = [
            ("Allocated (live) memory", m["allocated_bytes.all.current"], m["allocated_bytes.all.peak"]),
            ("Reserved memory", m["reserved_bytes.all.current"], m["reserved_bytes.all.peak"]),
            ("Active memory (live + pending)", m["active_bytes.all.current"], None),
            ("Free (inactive) memory", m["inactive_split_bytes.all.current"], None),
            ("Pending (stream-ordered) memory", int(st.get("pending_bytes", 0)), None),
            ("Overhead (rounding slack)", int(st.get("overhead_bytes", 0)), None),
            ("Largest free block", int(st.get("largest_free_block", 0)), None),
        ]
        lines.append(f" {'Metric':<34}{'Current':>18}{'Peak':>18}")
        lines.append("-" * 78)
        for label, cur, peak in rows:
            lines.append(f" {label:<34}{_fmt(cur):>18}{(_fmt(peak) if peak is not None else '-'):>18}")
        lines.append("-" * 78)
        counts = [
            ("Allocations (live blocks)", m["allocation.all.current"]),
            ("Free chunks", m["inactive_split.all.current"]),
            ("Segments (backings)", m["segment.all.current"]),
            ("Device allocs / frees", f"{m['num_device_alloc']} / {m['num_device_free']}"),
            ("Alloc retries / OOMs", f"{m['num_alloc_retries']} / {m['num_ooms']}"),
            ("Fragmentation", f"{float(st.get('fragmentation', 0.0)):.3f}"),
        ]
        for label, v in counts:
            lines.append(f" {label:<34}{str(v):>18}")
        lines.append(bar)
    if not lines:
        return "poolkeeper: no device pool yet (nothing has been allocated through it)\n"
    return "\n".join(lines) + "\n"


def torch_segments(snap: Snapshot, device: int) -> List[Dict[str, Any]]:
    """One PyTorch snapshot segment per backing of ``snap`` (see the module docstring)."""
    expandable = bool(snap.stats.get("expandable", 0))
    segments = []
    for b in sorted(snap.backings, key=lambda b: b.address):
        blocks = []
        allocated = active = requested = 0
        for c in b.chunks:
            state = TORCH_BLOCK_STATE.get(c.state, "inactive")
            req = c.requested if (c.state == "live" and c.requested is not None) else c.size
            if c.state == "live":
                allocated += c.size
                requested += req
            if state != "inactive":
                active += c.size
            blocks.append(
                {
                    "address": b.address + c.offset,
                    "size": c.size,
                    "requested_size": req,
                    "state": state,
                    "frames": [],
                }
            )
        stream = next((c.alloc_stream for c in b.chunks if c.state == "live" and c.alloc_stream is not None), 0)
        segments.append(
            {
                "device": device,
                "address": b.address,
                "total_size": b.size,
                "stream": stream if isinstance(stream, int) else 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "allocated_size": allocated,
                "active_size": active,
                "requested_size": requested,
                "is_expandable": expandable,
                "frames": [],
                "blocks": blocks,
            }
        )
    return segments


#: Device indices a pool can have: -1 (host/simulated) and [0, MAX_DEVICES), the C ABI's
#: registry bound (64; docs/conformance.md).
MAX_DEVICES: int = _core.MAX_DEVICES


def _device(device: Any) -> int:
    from poolkeeper.errors import InvalidArgumentError, brief

    # device_traces holds a list per index up to the largest: an unchecked 2**40 allocated lists
    # until memory ran out. Any integer type passes (numpy's np.int64 did before the check).
    try:
        index = None if isinstance(device, bool) else operator.index(device)
    except TypeError:
        index = None
    if index is None or not -1 <= index < MAX_DEVICES:
        raise InvalidArgumentError(f"device must be an int in [-1, {MAX_DEVICES}); got {brief(device)}")
    return index


def torch_snapshot_dict(snapshots: Mapping[int, Snapshot]) -> Dict[str, Any]:
    """PyTorch's snapshot dict for ``{device: Snapshot}`` (a device below 0, e.g. a simulated
    pool's, is written as device 0: PyTorch's tools index devices from 0). A device that is not an
    int in [-1, :data:`MAX_DEVICES`) raises :class:`~poolkeeper.errors.InvalidArgumentError`."""
    segments: List[Dict[str, Any]] = []
    top = 0
    checked = {_device(device): snap for device, snap in snapshots.items()}
    for device, snap in sorted(checked.items()):
        d = max(device, 0)
        top = max(top, d)
        segments += torch_segments(snap, d)
    return {"segments": segments, "device_traces": [[] for _ in range(top + 1)], "allocator_settings": {}}


def write_torch_snapshot(snapshots: Mapping[int, Snapshot], path: Union[str, os.PathLike]) -> str:
    """Write :func:`torch_snapshot_dict` as a pickle (what ``torch.cuda.memory._dump_snapshot``
    writes); returns the path. ``path`` is checked as for
    :meth:`~poolkeeper.accounting.Snapshot.to_json`."""
    from poolkeeper._paths import output_path, write_output

    path = output_path(path, "path")
    data = torch_snapshot_dict(snapshots)
    return write_output(path, pickle.dumps(data, protocol=4), "path")  # whole or not at all


__all__ = ["memory_stats_from", "summary_text", "torch_segments", "torch_snapshot_dict", "write_torch_snapshot", "TORCH_BLOCK_STATE"]
