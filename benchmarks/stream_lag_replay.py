"""Peak reserved / peak live when every allocation and free is on one stream and the device lags
the host, as a framework's allocations are on a real GPU (simulated device, exact and
deterministic).

    PYTHONPATH=<built poolkeeper> python3 benchmarks/stream_lag_replay.py [--pools arena,arena_expandable]

A framework frees a block on the stream it allocated it on; the pool may hand it to that stream
again at once, but to any other stream only after the stream's work has passed the release (a
fence). Replays without streams (``poolkeeper replay``) see every release complete at once. Here
the committed PyTorch traces (``benchmarks/traces``, with their pre-trace blocks) and the Llama
benchmark's trace (``benchmarks/results/torch_model_native_trace.csv.gz``) run on stream 0 of the
Simulated device: "idle" enqueues no device work (a fence completes as soon as it is recorded);
"lag W/A" enqueues W us of work per allocation and advances the clock A us per event, so the stream
falls behind the host (the real H200 run of BERT held 598-650 MiB where the stream-less replay
holds 538 MiB; lagging, the replay holds about 600).
"""
from __future__ import annotations

import argparse
import os
import sys

import poolkeeper as pk
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay_engine import ALLOC, FREE

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import replay_torch_trace  # noqa: E402  (the Llama trace's reader and replay)

LAGS = [(0.0, 0.0), (5.0, 5.0), (10.0, 5.0), (20.0, 5.0), (50.0, 5.0)]
STREAM = 0


def replay_snapshot(trace, kind: str, work_us: float, advance_us: float) -> float:
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.make_pool(kind, sim)
    table = {}
    for ev in trace.pre_trace:
        if ev.size and ev.addr not in table:
            table[ev.addr] = pool.allocate(ev.size)
    for ev in trace.events:
        if ev.kind == ALLOC and ev.size:
            old = table.pop(ev.addr, None)
            if old is not None:  # the log lost this address's free: assume it
                pool.deallocate(old, STREAM)
            table[ev.addr] = pool.allocate(ev.size, STREAM)
            if work_us:
                sim.enqueue(STREAM, work_us)
        elif ev.kind == FREE:
            p = table.pop(ev.addr, None)
            if p is not None:
                pool.deallocate(p, STREAM)
        if advance_us:
            sim.advance(advance_us)
    st = pool.stats()
    return st["peak_reserved_bytes"] / st["peak_live_bytes"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", default="arena,arena_expandable")
    args = ap.parse_args()
    print("command: python3 benchmarks/stream_lag_replay.py " + " ".join(sys.argv[1:]))
    traces = {name: read_log(os.path.join(HERE, "traces", f"torch_{name}.pickle.gz"))
              for name in ("bert_serve", "gpt2_generate")}
    llama = replay_torch_trace.load(replay_torch_trace.DEFAULT_TRACE)
    lags = ["idle" if not w else f"lag {w:g}/{a:g}" for w, a in LAGS]
    print("peak reserved / peak live, all on stream 0 of the Simulated device")
    print(f"{'pool':18s} {'trace':14s} " + " ".join(f"{x:>10s}" for x in lags))
    for kind in args.pools.split(","):
        every = []
        for name, tr in traces.items():
            row = [replay_snapshot(tr, kind, w, a) for w, a in LAGS]
            every += row
            print(f"{kind:18s} {name:14s} " + " ".join(f"{x:10.3f}" for x in row), flush=True)
        row = []
        for w, a in LAGS:
            r = replay_torch_trace.replay(llama, kind, w, a)
            row.append(r["peak_reserved_mib"] / r["peak_live_mib"])
        every += row
        print(f"{kind:18s} {'llama':14s} " + " ".join(f"{x:10.3f}" for x in row), flush=True)
        print(f"{kind:18s} {'mean':14s} {sum(every) / len(every):10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
