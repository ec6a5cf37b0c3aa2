"""Peak reserved / peak live when every allocation and free is on one stream and the device lags
the host, as a framework's allocations are on a real GPU (simulated device, exact and
deterministic).

    PYTHONPATH=<built poolkeeper> python3 benchmarks/stream_lag_replay.py [--pools arena,arena_expandable]

A pool named ``KIND+OPTION`` is KIND with OPTION=True (``arena_expandable+single_stream``).

A framework frees a block on the stream it allocated it on; the pool may hand it to that stream
again at once, but to any other stream only after the stream's work has passed the release (a
fence). Replays without streams (``poolkeeper replay``) see every release complete at once. Here
the committed PyTorch traces (``benchmarks/traces``, with their pre-trace blocks), the Llama
benchmark's trace (``benchmarks/results/torch_model_native_trace.csv.gz``) and poolkeeper's own logs
of the H200 real-model runs (``benchmarks/traces/live_*_arena.csv.gz``) run on stream 0 of the
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
import real_models  # noqa: E402  (its arm_pool: "KIND+OPTION" names)
import replay_torch_trace  # noqa: E402  (the Llama trace's reader and replay)

LAGS = [(0.0, 0.0), (5.0, 5.0), (10.0, 5.0), (20.0, 5.0), (50.0, 5.0)]
STREAM = 0


def snapshot_events(trace):
    """A snapshot trace as replay_torch_trace.replay's events, every call on stream 0, and its
    pre-trace blocks as (addr, size)."""
    events = [(ev.kind == ALLOC, ev.addr, ev.size, STREAM) for ev in trace.events
              if (ev.kind == ALLOC and ev.size) or ev.kind == FREE]
    pre = {}
    for ev in trace.pre_trace:
        if ev.size:
            pre.setdefault(ev.addr, ev.size)
    return events, list(pre.items())


def load_traces():
    """Every committed trace as {name: (events, pre-trace blocks)}, in the order the tables print."""
    traces = {name: snapshot_events(read_log(os.path.join(HERE, "traces", f"torch_{name}.pickle.gz")))
              for name in ("bert_serve", "gpt2_generate")}
    traces["llama"] = (replay_torch_trace.load(replay_torch_trace.DEFAULT_TRACE), ())
    # poolkeeper's own allocation logs of the H200 real-model runs (arena arm, LoggingPool CSV):
    # the live sequences, weights loading included (benchmarks/real_models.py --log-dir).
    for name in ("bert", "llama"):
        traces[f"live_{name}"] = snapshot_events(read_log(os.path.join(HERE, "traces", f"live_{name}_arena.csv.gz")))
    return traces


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pools", default="arena,arena_expandable")
    ap.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a pool option for every pool named (as `poolkeeper replay -o`: max_step=32MiB)")
    ap.add_argument("--idle-only", action="store_true", help="only the idle column (a single_stream pool's rows "
                                                             "are the same in every column)")
    ap.add_argument("--calls", action="store_true", help="with each ratio, the upstream calls: maps (or backings) "
                                                           "and frees, and alias / unalias calls, then in brackets "
                                                           "the runs the frees and unaliases went in (one cuMemUnmap "
                                                           "each where the driver takes runs)")
    args = ap.parse_args()
    from poolkeeper.bench.options import parse_options

    extra = parse_options(args.option)
    print("command: python3 benchmarks/stream_lag_replay.py " + " ".join(sys.argv[1:]))
    traces = load_traces()
    runs = LAGS[:1] if args.idle_only else LAGS
    lags = ["idle" if not w else f"lag {w:g}/{a:g}" for w, a in runs]
    print("peak reserved / peak live, all on stream 0 of the Simulated device")
    print(f"{'pool':31s} {'trace':14s} " + " ".join(f"{x:>10s}" for x in lags))
    for kind in args.pools.split(","):
        base, options = real_models.arm_pool(kind)
        options = {**options, **extra}
        every = []
        for name, (events, pre) in traces.items():
            row, calls = [], []
            for w, a in runs:
                r = replay_torch_trace.replay(events, base, w, a, pre_trace=pre, **options)
                row.append(r["peak_reserved_mib"] / r["peak_live_mib"])
                calls.append(f"{r['upstream_allocations']}/{r['upstream_deallocations']} "
                             f"+{r['alias_calls']}/{r['unalias_calls']} [{r['unmap_runs']}/{r['unalias_runs']}]")
            every += row
            tail = "   " + "  ".join(calls) if args.calls else ""
            print(f"{kind:31s} {name:14s} " + " ".join(f"{x:10.3f}" for x in row) + tail, flush=True)
        print(f"{kind:31s} {'mean':14s} {sum(every) / len(every):10.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
