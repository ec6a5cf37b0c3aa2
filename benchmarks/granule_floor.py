"""How far below the default pool an ideal stitching allocator could go on the committed traces
(simulated device, exact and deterministic).

    PYTHONPATH=<built poolkeeper> python3 benchmarks/granule_floor.py

Every trace of benchmarks/stream_lag_replay.py (the PyTorch traces, the Llama benchmark's trace and
poolkeeper's logs of the H200 real-model runs), with three figures beside the targets:

- peak live: what no allocator can hold less than;
- whole granules: the peak of an ideal stitching allocator. Every block of at least one granule
  (2 MiB) gets whole granules of its own, gathered from anywhere at no cost (stitching with
  unlimited free maps), and every smaller block is packed with no waste at all, so at each moment it
  holds the sum over large live blocks of their size rounded up to the granule, plus the small live
  bytes rounded up to a whole number of granules. Placement that shares a granule between the end of one block and
  the start of the next can hold less; stitching whole granules cannot;
- the default pool (install()'s: the expandable arena in single-stream mode with WIDE_STITCH), replayed.

Targets: peak reserved <= 1.05x peak live on every trace, and on the two live logs <= 0.95x PyTorch's
expandable segments in the same H200 invocation (benchmarks/results/real_models_h200.md).
"""
from __future__ import annotations

import os
import sys
from typing import Iterable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 1 << 20
GRANULE = 2 * MiB
# Peak reserved of torch_expandable (PyTorch's allocator with expandable_segments:True) in the H200
# invocation whose poolkeeper arms hold what these logs replay to (results/real_models_h200.md,
# "same-stream placement"): the inputs of the 0.95x target, not results of this script.
TORCH_EXPANDABLE_MIB = {"live_bert": 586.0, "live_llama": 836.0}
DEFAULT_POOL = "arena_expandable+single_stream+wide_stitch"

Event = Tuple[bool, int, int, int]  # (is_alloc, address, size, stream), as stream_lag_replay's


def whole_granule_peak(events: Iterable[Event], pre: Iterable[Tuple[int, int]] = (),
                       granule: int = GRANULE) -> Tuple[int, int]:
    """(peak live bytes, peak bytes of the ideal whole-granule allocator) over a trace.

    A free of an address that is not live (a block from before the trace) is skipped, as the replays
    skip it."""
    live = {}
    live_bytes = large = small = 0
    peak_live = peak = 0

    def account(size: int, sign: int) -> None:
        nonlocal live_bytes, large, small
        live_bytes += sign * size
        if size >= granule:
            large += sign * (-(-size // granule) * granule)
        else:
            small += sign * size

    def note() -> None:
        nonlocal peak_live, peak
        peak_live = max(peak_live, live_bytes)
        peak = max(peak, large + -(-small // granule) * granule)

    for addr, size in pre:
        live[addr] = size
        account(size, 1)
    note()
    for is_alloc, addr, size, _stream in events:
        if is_alloc:
            if addr in live:  # a second allocation at a live address: the first is gone (a log cut)
                account(live.pop(addr), -1)
            live[addr] = size
            account(size, 1)
        else:
            size = live.pop(addr, None)
            if size is None:
                continue
            account(size, -1)
        note()
    return peak_live, peak


def rows() -> List[Tuple[str, float, float, float]]:
    """(trace, peak live MiB, whole-granule peak MiB, default pool's peak reserved MiB)."""
    import real_models
    import replay_torch_trace
    import stream_lag_replay

    base, options = real_models.arm_pool(DEFAULT_POOL)
    out = []
    for name, (events, pre) in stream_lag_replay.load_traces().items():
        live, floor = whole_granule_peak(events, pre)
        r = replay_torch_trace.replay(events, base, 0.0, 0.0, pre_trace=pre, **options)
        out.append((name, live / MiB, floor / MiB, r["peak_reserved_mib"]))
    return out


def main() -> int:
    print("command: python3 benchmarks/granule_floor.py")
    print(f"peak MiB (x peak live); whole granules: {GRANULE // MiB} MiB; default: {DEFAULT_POOL}")
    print(f"{'trace':14s} {'peak live':>10s} {'whole granules':>18s} {'default':>18s} {'1.05x live':>11s} {'0.95x torch_expandable':>24s}")
    for name, live, floor, default in rows():
        te = TORCH_EXPANDABLE_MIB.get(name)
        vs_torch = f"{0.95 * te:.1f} (of {te:.1f})" if te else "-"
        print(f"{name:14s} {live:10.1f} {floor:9.1f} ({floor / live:.3f}x) {default:9.1f} ({default / live:.3f}x) "
              f"{1.05 * live:11.1f} {vs_torch:>24s}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
