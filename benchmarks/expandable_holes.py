"""Expandable arena: what unmapping free pieces anywhere in the range (holes) saves, and what it costs.

Runs the committed PyTorch traces (replayed with their pre-trace blocks, like
``poolkeeper replay --include-pre-trace``) and the bench workloads random_lifetime, large_recycle,
straddle, kv_cache, inference on the simulated device, once per policy of
``ArenaPool(expandable=True)``:

- ``tail only``: ``reclaim_holes=False, stitch=False``, the behaviour before holes (only the free
  tail unmapped);
- ``holes``: ``stitch=False``, the behaviour before stitching -- wholly free pieces anywhere
  unmapped by trim, shrink scans (two-scan hysteresis) and OOM recovery, lowest holes refilled
  first;
- ``holes, 2 MiB pieces``: the same with ``map_piece=2 MiB`` (every granule its own map call);
- ``release on grow`` (``stitch=False``): also ``release_on_grow=True``: before mapping more, unmap the wholly free
  pieces the request could not use (with 2 MiB and 8 MiB pieces);
- ``stitch`` (the default, ``stitch=True``): when nothing contiguous fits, wholly free pieces are
  mapped a second time into a fresh range instead of mapping more (default options; 2 MiB pieces; growth
  steps of just what is needed, ``step_fraction=0``; up to 256 pieces per stitched range,
  ``stitch_max_parts=256``; with ``release_on_grow``; without the thread cache).

Prints peak reserved / peak live and map / unmap calls per case and policy; with stitching, the
alias / unalias calls (second mappings, each one driver map or unmap) follow after a ``+``. Byte
and call counts are exact and deterministic on the simulated device. ``--backend cuda`` runs the
same cases over ``CudaVirtual`` (the real driver on a GPU, or the fake driver under
``POOLKEEPER_LIBCUDA``) and adds each cell's wall seconds, so the cost of the calls shows.

    PYTHONPATH=<built poolkeeper> python3 benchmarks/expandable_holes.py [--scale quick|full] \
        [--backend simulated|cuda] [--only CASES] [--policies POLICIES] > benchmarks/results/expandable_holes.txt
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Dict, List, Tuple

import poolkeeper as pk
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay_engine import replay
from poolkeeper.bench.workloads import WORKLOADS, RunContext, Selection

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD_NAMES = ("random_lifetime", "large_recycle", "straddle", "kv_cache", "inference")
TRACES = ("torch_gpt2_generate.pickle.gz", "torch_bert_serve.pickle.gz")

OFF = {"stitch": False}
# install()'s stitching before top-ups and homecomings (docs/expandable.md, "Top-ups and
# homecomings"): the comparison this script and expandable_peak.py print.
WIDE_STITCH_BEFORE_TOP_UPS: Dict[str, Any] = {**pk.pools.WIDE_STITCH, "stitch_top_up": False, "stitch_from": 24 * MiB}
POLICIES: List[Tuple[str, Dict[str, Any]]] = [
    ("tail only (before holes)", {"reclaim_holes": False, **OFF}),
    ("holes (before stitching)", dict(OFF)),
    ("holes, 2 MiB pieces", {"map_piece": 2 * MiB, **OFF}),
    ("release on grow, 2 MiB", {"map_piece": 2 * MiB, "release_on_grow": True, **OFF}),
    ("release on grow, 8 MiB", {"map_piece": 8 * MiB, "release_on_grow": True, **OFF}),
    ("stitch (default)", {}),
    ("stitch, 2 MiB", {"map_piece": 2 * MiB}),
    ("stitch, 2 MiB, step 0", {"map_piece": 2 * MiB, "step_fraction": 0}),
    ("stitch, 2 MiB, step 0, 256 parts", {"map_piece": 2 * MiB, "step_fraction": 0, "stitch_max_parts": 256}),
    ("stitch+release, 2 MiB, step 0", {"map_piece": 2 * MiB, "step_fraction": 0, "release_on_grow": True}),
    ("stitch, 2 MiB, step 0, 256, no tcache", {"map_piece": 2 * MiB, "step_fraction": 0, "stitch_max_parts": 256,
                                               "thread_cache_bytes": 0}),
    ("wide stitch (install())", dict(pk.pools.WIDE_STITCH)),
    ("wide stitch, before top-ups", dict(WIDE_STITCH_BEFORE_TOP_UPS)),
]

Case = Callable[[Any, Any], Tuple[int, int]]


def run_workload(name: str, params: Dict[str, Any], scale: str, backend: str) -> Case:
    def go(pool: Any, up: Any) -> Tuple[int, int]:
        m = WORKLOADS[name].run(pool, dict(params), RunContext("arena_expandable", backend, scale, up))
        st = pool.stats()
        live = m.peak_live_bytes if m.peak_live_bytes is not None else st["peak_live_bytes"]
        res = m.peak_reserved_bytes if m.peak_reserved_bytes is not None else st["peak_reserved_bytes"]
        return live, res

    return go


def run_trace(path: str) -> Case:
    trace = read_log(path)

    def go(pool: Any, up: Any) -> Tuple[int, int]:
        r = replay(trace, pool, up, include_pre_trace=True)
        return r["peak_live_bytes"], r["peak_reserved_bytes"]

    return go


def cases(scale: str, backend: str = "simulated") -> List[Tuple[str, Case]]:
    out: List[Tuple[str, Case]] = []
    for t in TRACES:
        out.append((t.split(".")[0] + " (replay)", run_trace(os.path.join(HERE, "traces", t))))
    for name in WORKLOAD_NAMES:
        for params in WORKLOADS[name].params(Selection(scale=scale, backend=backend)):
            label = name + " " + ",".join(f"{k}={v}" for k, v in params.items() if k in ("steps", "rounds", "threads"))
            out.append((label.strip(), run_workload(name, params, scale, backend)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=("quick", "full"), default="quick")
    ap.add_argument("--only", default="", help="comma-separated substrings of case labels to run")
    ap.add_argument("--policies", default="", help="comma-separated substrings of policy labels to run")
    ap.add_argument("--backend", choices=("simulated", "cuda"), default="simulated",
                    help="simulated device, or CudaVirtual(0) (real or fake driver); cuda adds wall seconds")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    pol = [s for s in args.policies.split(",") if s]
    policies = [(lab, o) for lab, o in POLICIES if not pol or any(s in lab for s in pol)]
    print(f"scale {args.scale}, backend {args.backend}; each cell: peak reserved / peak live,"
          " map calls / unmap calls [+ alias calls / unalias calls]" + (" wall s" if args.backend == "cuda" else ""))
    print(f"{'case':34s} {'peak live MiB':>13s} " + " ".join(f"{label:>38s}" for label, _ in policies))
    for label, fn in cases(args.scale, args.backend):
        if only and not any(s in label for s in only):
            continue
        cells, live_mib = [], 0.0
        for _, opts in policies:
            up = pk.upstream.Simulated(latency_us=0) if args.backend == "simulated" else pk.upstream.CudaVirtual(0)
            pool = pk.ArenaPool(up, expandable=True, **opts)
            t0 = time.perf_counter()
            live, res = fn(pool, up)
            wall = time.perf_counter() - t0
            pool.validate()
            c = up.counters()
            cell = f"{res / live:.3f}× {c['maps']:5d}/{c['unmaps']:<5d}"
            if c["aliases"]:
                cell += f" +{c['aliases']}/{c['unaliases']}"
            if args.backend == "cuda":
                cell += f" {wall:.2f}s"
            cells.append(cell)
            live_mib = live / MiB
            try:
                pool.close()
            except pk.errors.PoolkeeperError:
                pass
        print(f"{label:34s} {live_mib:13.1f} " + " ".join(f"{c:>38s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
