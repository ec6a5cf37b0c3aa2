"""How much could one expandable (virtual-memory) backing save? The floor, measured.

An expandable arena keeps one reserved address range and maps physical memory onto its end as
it grows. Without unmapping in the middle, what it maps at any moment is the highest address in
use (rounded up to the 2 MiB mapping granularity). This script measures that high-water by
running today's ArenaPool with ONE enormous backing (64 GiB of fake simulated addresses: they
cost nothing) and watching every pointer the pool hands out, and prints it against peak live,
next to the current arena's peak reserved / peak live on the same run.

Runs the bench workloads random_lifetime, large_recycle, straddle, kv_cache, inference (each
parameter set of the chosen scale) and the two PyTorch traces in benchmarks/traces (replayed with
their pre-trace blocks, like ``poolkeeper replay --include-pre-trace``).

    PYTHONPATH=<built poolkeeper> python3 benchmarks/expandable_floor.py [--scale quick|full] \
        > benchmarks/results/expandable_floor.txt
"""
from __future__ import annotations

import argparse
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import poolkeeper as pk
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay_engine import replay
from poolkeeper.bench.workloads import WORKLOADS, RunContext, Selection

MiB = 1 << 20
GiB = 1 << 30
GRANULE = 2 * MiB
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD_NAMES = ("random_lifetime", "large_recycle", "straddle", "kv_cache", "inference")
TRACES = ("torch_gpt2_generate.pickle.gz", "torch_bert_serve.pickle.gz")


class HighWater:
    """Wraps a pool; records the highest end address (ptr + size - base) it hands out."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.base: Optional[int] = None
        self.top = 0
        self._mu = threading.Lock()

    def allocate(self, nbytes: int, stream: Any = None) -> int:
        p = self.pool.allocate(nbytes, stream)
        with self._mu:
            if self.base is None:
                self.base = _base_of(self.pool)
            self.top = max(self.top, p + nbytes - self.base)
        return p

    def mapped_floor(self) -> int:
        return -(-self.top // GRANULE) * GRANULE

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def _base_of(pool: Any) -> int:
    backings = pool.snapshot().to_dict()["backings"]
    assert len(backings) == 1, "the floor run must hold exactly one backing"
    return int(backings[0]["address"])


def run_workload(name: str, params: Dict[str, Any], pool: Any, up: Any, scale: str) -> Tuple[int, int]:
    m = WORKLOADS[name].run(pool, dict(params), RunContext("arena", "simulated", scale, up))
    st = pool.stats()
    live = m.peak_live_bytes if m.peak_live_bytes is not None else st["peak_live_bytes"]
    res = m.peak_reserved_bytes if m.peak_reserved_bytes is not None else st["peak_reserved_bytes"]
    return live, res


def run_trace(path: str) -> Callable[[Any, Any], Tuple[int, int]]:
    trace = read_log(path)

    def go(pool: Any, up: Any) -> Tuple[int, int]:
        # The replay `poolkeeper replay --include-pre-trace` runs: blocks held from before the
        # trace first, then every logged allocation and free.
        r = replay(trace, pool, up, include_pre_trace=True)
        return r["peak_live_bytes"], r["peak_reserved_bytes"]

    return go


def cases(scale: str) -> List[Tuple[str, Callable[[Any, Any], Tuple[int, int]]]]:
    out: List[Tuple[str, Callable[[Any, Any], Tuple[int, int]]]] = []
    for name in WORKLOAD_NAMES:
        for params in WORKLOADS[name].params(Selection(scale=scale)):
            label = name + " " + ",".join(f"{k}={v}" for k, v in params.items() if k in ("steps", "rounds", "threads"))
            out.append((label.strip(), lambda p, u, n=name, q=params: run_workload(n, q, p, u, scale)))
    for t in TRACES:
        out.append((t.split(".")[0], run_trace(os.path.join(HERE, "traces", t))))
    return out


VARIANTS = [
    ("fraction 0 (need only)", {"step_fraction": 0.0}),
    ("fraction 1/32, max 64 MiB", {"step_fraction": 1 / 32}),
    ("fraction 1/16, max 64 MiB", {"step_fraction": 1 / 16}),
    ("fraction 1/8, max 64 MiB", {"step_fraction": 1 / 8}),
    ("fraction 1/16, max 16 MiB", {"step_fraction": 1 / 16, "max_step": 16 * MiB}),
]


def sweep(scale: str) -> None:
    """ArenaPool(expandable=True) itself, per growth-step policy: ratio and map calls."""
    print(f"\nArenaPool(expandable=True) on the same runs: peak reserved / peak live, and map calls (upstream allocations)")
    print(f"{'case':36s} " + " ".join(f"{label:>26s}" for label, _ in VARIANTS))
    for label, fn in cases(scale):
        cells = []
        for _, opts in VARIANTS:
            up = pk.upstream.Simulated(latency_us=0)
            pool = pk.ArenaPool(up, expandable=True, **opts)
            live, res = fn(pool, up)
            cells.append(f"{res / live:.3f}× {up.counters()['maps']:4d} maps")
            pool.close()
        print(f"{label:36s} " + " ".join(f"{c:>26s}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=("quick", "full"), default="quick")
    ap.add_argument("--sweep", action="store_true", help="also run the expandable arena per step policy")
    ap.add_argument("--va", type=int, default=64, help="GiB of fake address range for the floor run")
    args = ap.parse_args()
    va = args.va * GiB
    print(f"scale {args.scale}; floor = high-water of the highest used address, rounded up to 2 MiB, "
          f"in one {args.va} GiB backing")
    print(f"{'case':36s} {'peak live MiB':>13s} {'arena MiB':>10s} {'arena ×':>8s} {'floor MiB':>10s} "
          f"{'floor ×':>8s} {'arena allocs':>12s}")
    for label, fn in cases(args.scale):
        up = pk.upstream.Simulated(latency_us=0)
        pool = pk.ArenaPool(up)
        live, res = fn(pool, up)
        allocs = up.counters()["allocations"]
        pool.close()

        up = pk.upstream.Simulated(latency_us=0)
        hw = HighWater(pk.ArenaPool(up, initial_backing=va, max_backing=va, oversize_threshold=va))
        live2, _ = fn(hw, up)
        hw.pool.close()
        assert up.counters()["allocations"] == 1, "the floor run grew past its one backing"
        floor = hw.mapped_floor()
        print(f"{label:36s} {live / MiB:13.1f} {res / MiB:10.1f} {res / live:8.3f} {floor / MiB:10.1f} "
              f"{floor / live2:8.3f} {allocs:12d}")
    if args.sweep:
        sweep(args.scale)


if __name__ == "__main__":
    main()
