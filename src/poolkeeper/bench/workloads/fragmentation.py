"""Random-lifetime fragmentation run, ending with a large-block probe.

The allocation sequence is the one PyTorch's caching allocator was measured on (the same seed,
the same calls into the same generator, so the same sizes in the same order): each step frees a random live block with probability 1/2, otherwise
allocates ``randint(1, 64) * 1000 * choice([1, 7, 33, 129])`` float32 elements. PyTorch on the
H200 reached peak live 446.1 MiB, peak reserved 518.0 MiB (ratio 1.16) on it.

At the end, with the survivors still live, one large block is requested: ``probe_fit`` says
whether the pool served it from memory it already held (no upstream allocation).
"""
from __future__ import annotations

import random
from time import perf_counter_ns
from typing import Any, Dict, List

from poolkeeper.bench.workloads.base import MiB, Measurement, Meter, RunContext, Selection, Workload, single

TORCH_ANCHOR = {"peak_live_mib": 446.1, "peak_reserved_mib": 518.0, "ratio": 1.16, "steps": 4000, "seed": 0}


def _params(sel: Selection) -> List[Dict[str, Any]]:
    out = [{"steps": 4000, "seed": 0, "probe_bytes": 64 * MiB}]
    if sel.scale == "full":
        out.append({"steps": 40000, "seed": 0, "probe_bytes": 64 * MiB})
    return out


def _run(pool: Any, p: Dict[str, Any], ctx: RunContext) -> Measurement:
    # The same generator calls as the PyTorch measurement: random() is skipped while nothing is live.
    rng = random.Random(p["seed"])
    m = Meter(pool)
    live = []
    t0 = perf_counter_ns()
    for _ in range(p["steps"]):
        if live and rng.random() < 0.5:
            ptr, n = live.pop(rng.randrange(len(live)))
            m.free(ptr, n)
        else:
            n = rng.randint(1, 64) * 1000 * rng.choice([1, 7, 33, 129]) * 4
            live.append((m.alloc(n), n))
    steps_ns = perf_counter_ns() - t0

    # The probe is not one of the run's ops: it is measured on its own, and the run's peaks are
    # taken before it so a probe that grows the pool does not change the ratio.
    before = pool.stats()
    probe = p["probe_bytes"]
    t1 = perf_counter_ns()
    q = pool.allocate(probe)
    probe_ns = perf_counter_ns() - t1
    after = pool.stats()
    pool.deallocate(q)
    t2 = perf_counter_ns()
    for ptr, n in live:
        m.free(ptr, n)
    wall = steps_ns + perf_counter_ns() - t2
    grew = after["upstream_allocations"] - before["upstream_allocations"]
    extras = {
        "probe_bytes": probe,
        "probe_fit": grew == 0,
        "probe_upstream_allocations": grew,
        "probe_ns": probe_ns,
        "survivors": len(live),
        "free_bytes_before_probe": before["free_bytes"],
        "largest_free_before_probe": before["largest_free_block"],
        "fragmentation_before_probe": before["fragmentation"],
    }
    if p["steps"] == TORCH_ANCHOR["steps"] and p["seed"] == TORCH_ANCHOR["seed"]:
        extras["torch_anchor"] = dict(TORCH_ANCHOR)
    meas = single(m, wall, **extras)
    meas.peak_reserved_bytes = before["peak_reserved_bytes"]
    meas.extras["peak_reserved_after_probe"] = after["peak_reserved_bytes"]
    return meas


RANDOM_LIFETIME = Workload(
    "random_lifetime",
    "random-lifetime sequence PyTorch was measured on (446 MiB live, 518 MiB reserved there) + a 64 MiB probe",
    _params,
    _run,
)

__all__ = ["RANDOM_LIFETIME", "TORCH_ANCHOR"]
