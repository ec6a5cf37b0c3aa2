"""Replay the Llama benchmark's allocation trace against poolkeeper pools on a simulated device.

The trace (benchmarks/results/torch_model_native_trace.csv.gz, written by
``torch_model.py --repeat-native --trace-out``) is PyTorch's own allocation history from the
native arm: every ``alloc`` / ``free_completed`` of device 0 (sizes are the native allocator's
block sizes), all on the default stream.

Two ways to play it:

- *idle stream*: every release is complete at once (as if the GPU kept pace with the CPU);
- *lagging stream*: each allocation enqueues ``--work-us`` of device work and the host clock moves
  ``--advance-us`` per event, so the stream falls behind the CPU as it does on a real GPU (the
  CPU runs ahead, queueing kernels).

When this script was written the arena's peak reserved on the real H200 run was about 3x the native
allocator's, and the lagging replay reproduced it: a block released on stream s was reusable by s
at once only at its exact size, so a smaller request on s grew the pool instead of splitting it.
Same-stream splitting, and then carving the smaller of the best free fit and the best fit pending
on s, brought the replays down (benchmarks/results/replay_torch_model_trace.md; docs/stream_order.md).

Usage: python benchmarks/replay_torch_trace.py [trace.csv.gz] [--work-us 10 --advance-us 5]
"""
from __future__ import annotations

import argparse
import gzip
import os
from typing import List, Tuple

import poolkeeper as pk

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, "results", "torch_model_native_trace.csv.gz")


def load(path: str) -> List[Tuple[bool, int, int, int]]:
    events = []
    with gzip.open(path, "rt") as f:
        next(f)
        for line in f:
            action, addr, size, stream = line.rstrip().split(",")
            events.append((action == "alloc", int(addr), int(size), int(stream)))
    return events


def replay(events, kind: str, work_us: float, advance_us: float, pre_trace=(), **options) -> dict:
    """Play ``events`` ((is_alloc, addr, size, stream) tuples) on a fresh ``kind`` pool over the
    Simulated device; ``pre_trace``: (addr, size) blocks allocated first, without a stream (what
    the logged process held before its log began; the events may free them). Each allocation enqueues ``work_us`` of device work on its
    stream and each event advances the clock ``advance_us``."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.make_pool(kind, sim, **options)
    live = {addr: pool.allocate(size) for addr, size in pre_trace}
    for is_alloc, addr, size, stream in events:
        if is_alloc:
            old = live.pop(addr, None)
            if old is not None:  # the log lost this address's free: assume it
                pool.deallocate(old, stream)
            live[addr] = pool.allocate(size, stream)
            if work_us:
                sim.enqueue(stream, work_us)
        else:
            p = live.pop(addr, None)
            if p is not None:
                pool.deallocate(p, stream)
        if advance_us:
            sim.advance(advance_us)
    st = pool.stats()
    return {
        "peak_reserved_mib": st["peak_reserved_bytes"] / 2**20,
        "peak_live_mib": st["peak_live_bytes"] / 2**20,
        "upstream_allocations": st["upstream_allocations"],
        "upstream_deallocations": st["upstream_deallocations"],
        "alias_calls": st.get("alias_calls", 0),
        "unalias_calls": st.get("unalias_calls", 0),
        "unmap_runs": st.get("unmap_runs", 0),
        "unalias_runs": st.get("unalias_runs", 0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--work-us", type=float, default=10.0)
    ap.add_argument("--advance-us", type=float, default=5.0)
    args = ap.parse_args()
    events = load(args.trace)
    print(f"{len(events)} events from {args.trace}")
    cases = [
        ("arena, idle stream", "arena", 0.0, 0.0, {}),
        (f"arena, lagging stream ({args.work_us}/{args.advance_us} us)", "arena", args.work_us, args.advance_us, {}),
        ("size_class, idle stream", "size_class", 0.0, 0.0, {}),
    ]
    print("| case | peak reserved (MiB) | peak live (MiB) | upstream allocs | upstream frees |")
    print("|---|---|---|---|---|")
    for name, kind, w, a, opts in cases:
        r = replay(events, kind, w, a, **opts)
        print(f"| {name} | {r['peak_reserved_mib']:.0f} | {r['peak_live_mib']:.0f} | {r['upstream_allocations']} "
              f"| {r['upstream_deallocations']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
