"""How far below the default pool an ideal stitching allocator could go on the committed traces
(simulated device, exact and deterministic).

    PYTHONPATH=<built poolkeeper> python3 benchmarks/granule_floor.py

Every trace of benchmarks/stream_lag_replay.py (the PyTorch traces, the Llama benchmark's trace and
poolkeeper's logs of the H200 real-model runs), with four figures beside the targets:

- peak live: what no allocator can hold less than;
- whole granules: the peak of an ideal stitching allocator. Every block of at least one granule
  (2 MiB) gets whole granules of its own, gathered from anywhere at no cost (stitching with
  unlimited free maps), and every smaller block is packed with no waste at all, so at each moment it
  holds the sum over large live blocks of their size rounded up to the granule, plus the small live
  bytes rounded up to a whole number of granules. Placement that shares a granule between the end of one block and
  the start of the next can hold less; stitching whole granules cannot;
- shared granules (greedy): a model of a pool that could also stitch a block from the free end of
  one granule and the free start of another around fresh granules, unmapping every wholly free
  granule at once (shared_granule_peak). It places greedily, so it is not a floor, but it shows
  what sharing granules between stitched blocks would buy;
- the default pool (install()'s: the expandable arena in single-stream mode with WIDE_STITCH), replayed.

Targets: peak reserved <= 1.05x peak live on every trace, and on the two live logs <= 0.95x PyTorch's
expandable segments in the same H200 invocation (benchmarks/results/real_models_h200.md).
"""
from __future__ import annotations

import bisect
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


def shared_granule_peak(events: Iterable[Event], pre: Iterable[Tuple[int, int]] = (),
                        granule: int = GRANULE, alignment: int = 256, candidates: int = 8) -> int:
    """Peak bytes of a greedy model of a pool that shares granules between stitched blocks.

    Held memory is every granule with a live byte in it (a wholly free granule is unmapped at once,
    at no cost). A request (rounded up to ``alignment``) below a granule goes into the smallest free
    gap inside a granule that holds it. Any other request, one below a granule that no gap holds
    included, is stitched end to end from the free end of one granule (a head), fresh granules,
    and the free start of another granule (a tail): among
    the ``candidates`` largest heads and tails, the pair that needs the fewest fresh granules, then
    takes the most of the request, then is the smallest. Blocks never move. Greedy, not a floor: a
    placement that looks ahead could hold less. (Unmapping at once costs the model nothing: with
    every wholly free granule kept mapped and taken before a fresh one, what it holds at any moment
    would be the most granules live so far, and so the same peak.)"""
    gran: dict = {}            # granule id -> sorted [start, end) live intervals within it
    blocks: dict = {}          # address -> [(granule id, start, end)]
    fresh_ids = iter(range(1 << 62))
    peak = 0

    def gaps(iv: list) -> Iterable[Tuple[int, int]]:
        at = 0
        for s0, e0 in iv:
            if s0 > at:
                yield at, s0
            at = e0
        if at < granule:
            yield at, granule

    def put(g: int, s0: int, e0: int, parts: list) -> None:
        bisect.insort(gran.setdefault(g, []), (s0, e0))
        parts.append((g, s0, e0))

    def allocate(addr: int, size: int) -> None:
        size = -(-size // alignment) * alignment
        parts: list = []
        if not size:  # holds no byte (and no granule)
            blocks[addr] = parts
            return
        if size < granule:
            best = None
            for g, iv in gran.items():
                for s0, e0 in gaps(iv):
                    if e0 - s0 >= size and (best is None or e0 - s0 < best[0]):
                        best = (e0 - s0, g, s0)
            if best:
                put(best[1], best[2], best[2] + size, parts)
                blocks[addr] = parts
                return
        heads = sorted(((granule - iv[-1][1], g) for g, iv in gran.items() if iv[-1][1] < granule), reverse=True)
        tails = sorted(((iv[0][0], g) for g, iv in gran.items() if iv[0][0] > 0), reverse=True)
        # (fresh granules, -bytes from the head and tail, their sum: the smallest pair that does)
        best_key, best = None, (0, None, None)
        for a, hg in heads[:candidates] + [(0, None)]:
            for b, tg in tails[:candidates] + [(0, None)]:
                if hg is not None and hg == tg:
                    continue
                key = (-(-max(size - a - b, 0) // granule), -min(a + b, size), a + b)
                if best_key is None or key < best_key:
                    best_key, best = key, (a, hg, tg)
        a, hg, tg = best
        n = best_key[0]
        if hg is not None:
            put(hg, granule - a, granule, parts)
        rest = size - a
        if tg is not None and rest > n * granule:  # fresh granules full, the tail takes the rest
            for _ in range(n):
                put(next(fresh_ids), 0, granule, parts)
            put(tg, 0, rest - n * granule, parts)
        else:
            while rest > 0:
                put(next(fresh_ids), 0, min(granule, rest), parts)
                rest -= granule
        blocks[addr] = parts

    def free(addr: int) -> None:
        for g, s0, e0 in blocks.pop(addr):
            gran[g].remove((s0, e0))
            if not gran[g]:
                del gran[g]

    for addr, size in pre:
        allocate(addr, size)
    peak = len(gran) * granule
    for is_alloc, addr, size, _stream in events:
        if is_alloc:
            if addr in blocks:  # a second allocation at a live address: the first is gone (a log cut)
                free(addr)
            allocate(addr, size)
            peak = max(peak, len(gran) * granule)
        elif addr in blocks:
            free(addr)
    return peak


def rows() -> List[Tuple[str, float, float, float, float]]:
    """(trace, peak live MiB, whole-granule peak MiB, shared-granule model's peak MiB, default pool's
    peak reserved MiB)."""
    import real_models
    import replay_torch_trace
    import stream_lag_replay

    base, options = real_models.arm_pool(DEFAULT_POOL)
    out = []
    for name, (events, pre) in stream_lag_replay.load_traces().items():
        live, floor = whole_granule_peak(events, pre)
        shared = shared_granule_peak(events, pre)
        r = replay_torch_trace.replay(events, base, 0.0, 0.0, pre_trace=pre, **options)
        out.append((name, live / MiB, floor / MiB, shared / MiB, r["peak_reserved_mib"]))
    return out


def main() -> int:
    print("command: python3 benchmarks/granule_floor.py")
    print(f"peak MiB (x peak live); whole granules: {GRANULE // MiB} MiB; default: {DEFAULT_POOL}")
    print(f"{'trace':14s} {'peak live':>10s} {'whole granules':>18s} {'shared (greedy)':>18s} {'default':>18s} "
          f"{'1.05x live':>11s} {'0.95x torch_expandable':>24s}")
    for name, live, floor, shared, default in rows():
        te = TORCH_EXPANDABLE_MIB.get(name)
        vs_torch = f"{0.95 * te:.1f} (of {te:.1f})" if te else "-"
        print(f"{name:14s} {live:10.1f} {floor:9.1f} ({floor / live:.3f}x) {shared:9.1f} ({shared / live:.3f}x) "
              f"{default:9.1f} ({default / live:.3f}x) {1.05 * live:11.1f} {vs_torch:>24s}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
