"""Expandable arena: where the bytes above peak live sit at the moment of peak reserved.

Runs the committed PyTorch traces (with their pre-trace blocks, like ``poolkeeper replay
--include-pre-trace``) and the bench's random_lifetime workload on the simulated device through a
thin wrapper that watches ``stats()["reserved_bytes"]`` after every allocation and takes a
``snapshot()`` each time it reaches a new high. The last such snapshot is the pool at its peak;
the script splits ``peak reserved - peak live`` into:

- ``live below peak``: peak live minus the bytes live at that moment (the peak reserved was set
  when fewer bytes were live than at the live peak);
- ``rounding``: live chunks' sizes minus the sizes asked for (alignment);
- ``thread-cached``, ``pending`` (stream-ordered releases not yet passed), ``stitched free``;
- ``free`` chunks by size band, and how much of the free bytes lie in whole granules (2 MiB,
  what an unmap could give back) rather than in granules shared with live bytes.

It also prints the request that set the peak (a growth) and the largest free chunk then. The same
for a set of ``ArenaPool(expandable=True, ...)`` option sets (``--policy NAME``, repeatable; the
names are :data:`POLICIES`). ``--sweep`` prints only peak reserved / peak live and map / unmap
calls (``+`` alias calls) per policy, the cases side by side, and with ``--seeds`` the worst and
mean ratio of random_lifetime 4,000 steps over those seeds (a policy that wins on seed 0 only is
luck: small option changes move the layout). Exact and deterministic.

    PYTHONPATH=<built poolkeeper> python3 benchmarks/expandable_peak.py [--policy default] [--steps 4000,40000]
    PYTHONPATH=<built poolkeeper> python3 benchmarks/expandable_peak.py --sweep --seeds 1,2,3,4,5,6,7,8
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Tuple

import poolkeeper as pk
from poolkeeper.bench.readers import read_log
from poolkeeper.bench.replay_engine import replay
from poolkeeper.bench.workloads import WORKLOADS, RunContext

MiB = 1 << 20
GRANULE = 2 * MiB
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from expandable_holes import WIDE_STITCH_BEFORE_TOP_UPS  # noqa: E402

TRACES = ("torch_gpt2_generate.pickle.gz", "torch_bert_serve.pickle.gz")
BANDS = [(0, 1 * MiB, "<1M"), (1 * MiB, 2 * MiB, "1-2M"), (2 * MiB, 8 * MiB, "2-8M"), (8 * MiB, 32 * MiB, "8-32M"),
         (32 * MiB, 1 << 62, ">=32M")]

M2, M8 = 2 * MiB, 8 * MiB
POLICIES: Dict[str, Dict[str, Any]] = {
    "default": {},  # max_step 8 MiB since this study
    "max_step_64M": {"max_step": 64 * MiB},  # the default before it
    "no_tcache": {"thread_cache_bytes": 0},
    "tcache_256K_blocks": {"thread_cache_max_block": 256 << 10},
    "tcache_4M": {"thread_cache_bytes": 4 * MiB},
    "align512": {"alignment": 512},
    "step0": {"step_fraction": 0},
    "step0_no_tcache": {"step_fraction": 0, "thread_cache_bytes": 0},
    "max_step_4M": {"max_step": 4 * MiB},
    "max_step_16M": {"max_step": 16 * MiB},
    "step_0.02": {"step_fraction": 0.02},
    "no_tcache_64M": {"thread_cache_bytes": 0, "max_step": 64 * MiB},
    "tcache_256K_blocks_64M": {"thread_cache_max_block": 256 << 10, "max_step": 64 * MiB},
    "tcache_1M_blocks": {"thread_cache_max_block": 1 << 20},
    "release": {"release_on_grow": True},
    "release_no_tcache": {"release_on_grow": True, "thread_cache_bytes": 0},
    "release2M_64M": {"release_on_grow": True, "map_piece": M2, "max_step": 64 * MiB},
    "release2M": {"release_on_grow": True, "map_piece": M2},
    "release8M": {"release_on_grow": True, "map_piece": M8},
    "release2M_no_tcache": {"release_on_grow": True, "map_piece": M2, "thread_cache_bytes": 0},
    "release8M_no_tcache": {"release_on_grow": True, "map_piece": M8, "thread_cache_bytes": 0},
    "release8M_step0_no_tcache": {"release_on_grow": True, "map_piece": M8, "step_fraction": 0,
                                  "thread_cache_bytes": 0},
    "release2M_step0_64M": {"release_on_grow": True, "map_piece": M2, "step_fraction": 0, "max_step": 64 * MiB},
    "release2M_step0_no_tcache": {"release_on_grow": True, "map_piece": M2, "step_fraction": 0,
                                  "thread_cache_bytes": 0},
    "wide_stitch": dict(pk.pools.WIDE_STITCH),  # install()'s default options
    "wide_stitch_no_fragments": {**pk.pools.WIDE_STITCH, "stitch_fragments": False},  # before fragments
    "wide_stitch_before": dict(WIDE_STITCH_BEFORE_TOP_UPS),  # before top-ups and homecomings
}


_UNWATCHED = object()


class PeakWatch:
    """Forwards allocate/deallocate to ``pool``; keeps the snapshot at the highest reserved bytes."""

    def __init__(self, pool: Any, watch_all: bool) -> None:
        self.pool = pool
        self.watch_all = watch_all
        self.live = 0
        self.sizes: Dict[int, int] = {}
        self.best = -1
        self.at_peak: Any = None
        self.live_at_peak = 0
        self.request_at_peak = 0
        self.largest_free_before = 0
        self._largest_free = 0

    def allocate(self, n: int, stream: Any = _UNWATCHED) -> int:
        # random_lifetime's steps call allocate(n, stream) through its Meter, its closing probe
        # allocate(n): the probe comes after the run's peaks and is not watched.
        watched = self.watch_all or stream is not _UNWATCHED
        before = self.pool.stats() if watched else None
        p = self.pool.allocate(n, stream) if stream not in (None, _UNWATCHED) else self.pool.allocate(n)
        self.live += n
        self.sizes[p] = n
        r = self.pool.stats()["reserved_bytes"] if watched else -1
        if r > self.best:
            self.best = r
            self.at_peak = self.pool.snapshot()
            self.live_at_peak = self.live
            self.request_at_peak = n
            self.largest_free_before = before["largest_free_block"]
            self.free_before = before["free_bytes"]
        return p

    def deallocate(self, p: int, stream: Any = None) -> None:
        self.live -= self.sizes.pop(p)
        if stream is not None:
            self.pool.deallocate(p, stream)
        else:
            self.pool.deallocate(p)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def whole_granules(addr: int, size: int) -> int:
    lo = (addr + GRANULE - 1) // GRANULE * GRANULE
    hi = (addr + size) // GRANULE * GRANULE
    return max(0, hi - lo)


def breakdown(w: PeakWatch, peak_live: int) -> Dict[str, Any]:
    snap = w.at_peak
    out: Dict[str, Any] = {"reserved": w.best, "peak_live": peak_live, "live_now": w.live_at_peak}
    rounding = cached = pending = free = free_whole = stitched_free = 0
    bands = {lab: [0, 0] for _, _, lab in BANDS}
    largest = 0
    for b in snap.backings:
        for c in b.chunks:
            if c.state == "live":
                rounding += c.size - (c.requested or c.size)
            elif c.state == "thread_cached":
                cached += c.size
            elif c.state == "pending":
                pending += c.size
            elif c.state == "free":
                free += c.size
                largest = max(largest, c.size)
                free_whole += whole_granules(b.address + c.offset, c.size)
                for lo, hi, lab in BANDS:
                    if lo <= c.size < hi:
                        bands[lab][0] += 1
                        bands[lab][1] += c.size
            else:
                out.setdefault("other_" + c.state, 0)
                out["other_" + c.state] += c.size
    st = snap.stats
    out.update(rounding=rounding, cached=cached, pending=pending, free=free, free_whole_granules=free_whole,
               largest_free=largest, bands=bands, overhead=st.get("overhead_bytes", 0),
               stitched_bytes=st.get("stitched_bytes", 0), segments=len(snap.backings),
               request=w.request_at_peak, largest_free_before=w.largest_free_before, free_before=w.free_before)
    return out


def run_cases(opts: Dict[str, Any], steps: List[int]) -> List[Tuple[str, Dict[str, Any], Dict[str, int]]]:
    rows = []
    for t in TRACES:
        up = pk.upstream.Simulated(latency_us=0)
        w = PeakWatch(pk.ArenaPool(up, expandable=True, **opts), True)
        r = replay(read_log(os.path.join(HERE, "traces", t)), w, up, include_pre_trace=True)
        rows.append((t.split(".")[0], breakdown(w, r["peak_live_bytes"]), up.counters()))
        w.pool.close()
    for n in steps:
        up = pk.upstream.Simulated(latency_us=0)
        w = PeakWatch(pk.ArenaPool(up, expandable=True, **opts), False)
        m = WORKLOADS["random_lifetime"].run(w, {"steps": n, "seed": 0, "probe_bytes": 64 * MiB},
                                             RunContext("arena_expandable", "simulated", "full", up))
        # the workload's probe comes after its peaks: a probe growth is not the run's peak
        rows.append((f"random_lifetime {n}", breakdown(w, m.peak_live_bytes), up.counters()))
        w.pool.close()
    return rows


def fmt(rows: List[Tuple[str, Dict[str, Any], Dict[str, int]]]) -> str:
    lines = []
    for label, d, c in rows:
        excess = d["reserved"] - d["peak_live"]
        f = lambda x: f"{x / MiB:7.1f}"  # noqa: E731
        lines.append(f"{label}: peak reserved {d['reserved'] / MiB:.1f} MiB / peak live {d['peak_live'] / MiB:.1f} MiB"
                     f" = {d['reserved'] / d['peak_live']:.3f}x; excess {excess / MiB:.1f} MiB"
                     f"  (maps {c['maps']}, unmaps {c['unmaps']}, aliases {c['aliases']})")
        lines.append(f"   live below peak {f(d['peak_live'] - d['live_now'])}   rounding {f(d['rounding'])}"
                     f"   thread-cached {f(d['cached'])}   pending {f(d['pending'])}   free {f(d['free'])}"
                     f" (in whole 2 MiB granules {f(d['free_whole_granules'])}, largest {f(d['largest_free'])})"
                     f"   stitched {f(d['stitched_bytes'])}   segments {d['segments']}")
        lines.append("   free by chunk size: " + ", ".join(f"{lab} {n} chunks {b / MiB:.1f} MiB"
                                                          for lab, (n, b) in d["bands"].items() if n))
        lines.append(f"   request that set the peak {d['request'] / MiB:.2f} MiB; before it: free {d['free_before'] / MiB:.1f}"
                     f" MiB, largest free {d['largest_free_before'] / MiB:.2f} MiB")
    return "\n".join(lines)


def sweep(names: List[str], steps: List[int], seeds: List[int]) -> None:
    """Ratio and call counts only (no watching): one line per policy, the cases side by side;
    with ``seeds``, random_lifetime 4,000 steps at those seeds too (worst and mean ratio)."""
    labels = [t.split(".")[0].replace("torch_", "") for t in TRACES] + [f"random_lifetime {n}" for n in steps]
    if seeds:
        labels.append(f"rl 4000 seeds {seeds[0]}-{seeds[-1]} max/mean")
    print(f"{'policy':28s} " + " ".join(f"{lab:>30s}" for lab in labels))
    for name in names:
        cells = []
        for t in TRACES:
            up = pk.upstream.Simulated(latency_us=0)
            pool = pk.ArenaPool(up, expandable=True, **POLICIES[name])
            r = replay(read_log(os.path.join(HERE, "traces", t)), pool, up, include_pre_trace=True)
            cells.append((r["peak_reserved_bytes"] / r["peak_live_bytes"], up.counters()))
            pool.close()
        for n in steps:
            up = pk.upstream.Simulated(latency_us=0)
            pool = pk.ArenaPool(up, expandable=True, **POLICIES[name])
            m = WORKLOADS["random_lifetime"].run(pool, {"steps": n, "seed": 0, "probe_bytes": 64 * MiB},
                                                 RunContext("arena_expandable", "simulated", "full", up))
            cells.append((m.peak_reserved_bytes / m.peak_live_bytes, up.counters()))
            pool.close()
        text = [f"{'%.3fx %d/%d' % (r, c['maps'], c['unmaps']) + (' +%d' % c['aliases'] if c['aliases'] else ''):>30s}"
                for r, c in cells]
        if seeds:
            ratios, maps = [], 0
            for seed in seeds:
                up = pk.upstream.Simulated(latency_us=0)
                pool = pk.ArenaPool(up, expandable=True, **POLICIES[name])
                m = WORKLOADS["random_lifetime"].run(pool, {"steps": 4000, "seed": seed, "probe_bytes": 64 * MiB},
                                                     RunContext("arena_expandable", "simulated", "full", up))
                ratios.append(m.peak_reserved_bytes / m.peak_live_bytes)
                maps = max(maps, up.counters()["maps"])
                pool.close()
            text.append(f"{'%.3fx/%.3fx maps<=%d' % (max(ratios), sum(ratios) / len(ratios), maps):>30s}")
        print(f"{name:28s} " + " ".join(text), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", action="append", default=[], help=f"one of {', '.join(POLICIES)} (repeatable)")
    ap.add_argument("--steps", default="4000,40000", help="random_lifetime lengths")
    ap.add_argument("--sweep", action="store_true", help="only ratios and map/unmap[+alias] calls, every policy"
                    " (or those given with --policy)")
    ap.add_argument("--seeds", default="", help="with --sweep: random_lifetime 4,000 steps at these seeds too")
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",") if s]
    if args.sweep:
        sweep(args.policy or list(POLICIES), steps, [int(x) for x in args.seeds.split(",") if x])
        return
    for name in args.policy or ["default"]:
        print(f"== policy {name}: ArenaPool(Simulated, expandable=True, **{POLICIES[name]})")
        print(fmt(run_cases(POLICIES[name], steps)), flush=True)


if __name__ == "__main__":
    main()
