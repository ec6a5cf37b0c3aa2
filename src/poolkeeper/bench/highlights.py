"""The lines printed under the bench table: the figures each workload exists to show, next to
the reference figures they are measured against (H200 host measurements)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from poolkeeper.bench.format import fmt_bytes, fmt_ns, fmt_ratio
from poolkeeper.bench.tables import arm_label, by_workload

MiB = 1 << 20


def _hit_pair(rows: Sequence[Dict[str, Any]]) -> List[str]:
    out = []
    for r in by_workload(rows, "hit_pair"):
        x = r["extras"]
        capi = x.get("capi_pair_ns")
        out.append(
            f"hit_pair {fmt_bytes(r['params']['nbytes'])} {arm_label(r)}: Python allocate+deallocate "
            f"{fmt_ns(r['p50_ns'])} per pair = {fmt_ratio(x.get('pair_over_two_empty_calls'))} two empty Python calls "
            f"({fmt_ns(x.get('two_empty_calls_ns'))}); C-ABI pair {fmt_ns(capi)} in a native loop"
        )
    if out:
        out.append("  (for reference, on an H200 host: CuPy MemoryPool pair 1,180 ns, torch caching allocator pair 4,160 ns, "
                   "empty Python call 40 ns)")
    return out


def _random_lifetime(rows: Sequence[Dict[str, Any]]) -> List[str]:
    out = []
    for r in by_workload(rows, "random_lifetime"):
        x = r["extras"]
        probe = "fit (no upstream call)" if x.get("probe_fit") else f"did not fit ({x.get('probe_upstream_allocations')} upstream allocation)"
        anchor = ""
        if "torch_anchor" in x:
            anchor = f"; PyTorch on the H200: {x['torch_anchor']['ratio']:.2f}×"
        out.append(
            f"random_lifetime steps={r['params']['steps']} {arm_label(r)}: peak live {r['peak_live_bytes'] / MiB:.1f} MiB, "
            f"peak reserved {r['peak_reserved_bytes'] / MiB:.1f} MiB, ratio {fmt_ratio(r['reserved_over_live'])}{anchor}; "
            f"{fmt_bytes(x.get('probe_bytes'))} probe {probe}"
        )
    return out


def _kv_cache(rows: Sequence[Dict[str, Any]]) -> List[str]:
    rs = by_workload(rows, "kv_cache")
    if not rs:
        return []
    parts = ", ".join(f"{arm_label(r)} {r['upstream_allocations']}" for r in rs)
    return [f"kv_cache upstream allocations: {parts} ({rs[0]['extras'].get('distinct_sizes')} distinct request sizes, "
            f"peak live {fmt_bytes(rs[0]['peak_live_bytes'])})"]


def _trim(rows: Sequence[Dict[str, Any]]) -> List[str]:
    out = []
    for r in by_workload(rows, "trim"):
        x = r["extras"]
        out.append(
            f"trim {arm_label(r)}: p50 {fmt_ns(x.get('trim_ns_p50'))} = traversal {fmt_ns(x.get('trim_traversal_ns_p50'))} "
            f"+ upstream frees {fmt_ns(x.get('trim_upstream_free_ns_p50'))} ({x.get('trim_upstream_frees_p50'):.0f} frees, "
            f"{fmt_bytes(x.get('trim_released_bytes_p50'))} released)"
        )
    return out


def highlights(rows: Sequence[Dict[str, Any]]) -> List[str]:
    return _hit_pair(rows) + _kv_cache(rows) + _random_lifetime(rows) + _trim(rows)


__all__ = ["highlights"]
