"""False-positive and false-negative rates of ``PhaseTracker``'s leak verdict (docs/accounting.md).

Feeds synthetic per-phase figures (no pool needed, fully seeded) through the tracker and counts
verdicts. The cases are the ones that broke the earlier "rise in every phase pair" rule:

- ``step``: live stable at 64 MiB for 5 phases, then +2 MiB per phase for 25 phases (a leak);
- ``slow``: +256 KiB per phase for 40 phases (a leak);
- ``noisy_leak``: +1 MiB per phase for 30 phases under uniform noise of up to +-3 MiB (a leak);
- ``noisy_stable``: 64 MiB with uniform noise of up to +-3 MiB for 30 phases (no leak);
- ``short_noisy_stable``: the same for only 8 phases (few phases: the old rule's weak spot);
- ``plateau``: +2 MiB per phase for 8 phases, then flat (with +-3 MiB noise) for 22 (no leak: a
  high-water mark reached after a long warm-up).

Reserved follows live as an arena would: the running maximum rounded up to 2 MiB backings.

    python benchmarks/phase_tracker_rates.py [--runs 200] [--seed 0] [--old]

``--old`` also scores the previous rule (a rise beyond 1% of the first value in every post-warm-up
phase pair) for comparison.
"""
from __future__ import annotations

import argparse
import random

from poolkeeper.accounting import PhaseTracker

MiB = 1 << 20
KiB = 1 << 10


def _series(case: str, rng: random.Random) -> list:
    base = 64 * MiB
    if case == "step":
        return [base] * 5 + [base + 2 * MiB * (i + 1) for i in range(25)]
    if case == "slow":
        return [base + 256 * KiB * i for i in range(40)]
    if case == "noisy_leak":
        return [base + MiB * i + rng.uniform(-3, 3) * MiB for i in range(30)]
    if case == "noisy_stable":
        return [base + rng.uniform(-3, 3) * MiB for _ in range(30)]
    if case == "short_noisy_stable":
        return [base + rng.uniform(-3, 3) * MiB for _ in range(8)]
    if case == "plateau":
        return [base + 2 * MiB * min(i, 8) + rng.uniform(-3, 3) * MiB for i in range(30)]
    raise ValueError(case)


CASES = {"step": True, "slow": True, "noisy_leak": True, "noisy_stable": False, "short_noisy_stable": False, "plateau": False}


def _stats(live: float, peak: float) -> dict:
    reserved = -(-int(peak) // (2 * MiB)) * 2 * MiB
    return {"reserved_bytes": reserved, "live_bytes": int(live), "free_bytes": reserved - int(live), "pending_bytes": 0}


def _old_rule(tracker: PhaseTracker) -> bool:
    recs = tracker.records[tracker.warmup :]
    for term in ("reserved", "live"):
        vals = [getattr(r, term) for r in recs]
        if all(b - a > 0.01 * max(vals[0], 1) for a, b in zip(vals, vals[1:])):
            return False
    return True


def measure(runs: int, seed: int, old: bool = False) -> dict:
    out = {}
    for case, leak in CASES.items():
        wrong = wrong_old = 0
        for r in range(runs):
            rng = random.Random(seed * 1_000_003 + r)
            t = PhaseTracker()
            peak = 0.0
            for live in _series(case, rng):
                peak = max(peak, live)
                t.record(_stats(live, peak))
            stable = t.verdict().stable
            wrong += stable == leak  # a leak called stable, or a stable run called a leak
            if old:
                wrong_old += _old_rule(t) == leak
        out[case] = {"leak": leak, "runs": runs, "wrong": wrong, "wrong_old": wrong_old if old else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--old", action="store_true")
    a = ap.parse_args()
    res = measure(a.runs, a.seed, a.old)
    print(f"| case | truth | {'wrong verdicts (old rule) | ' if a.old else ''}wrong verdicts (trend test) |")
    print(f"|---|---|{'---|' if a.old else ''}---|")
    for case, r in res.items():
        kind = "false negatives" if r["leak"] else "false positives"
        truth = "leak" if r["leak"] else "stable"
        old = f"{r['wrong_old']} / {r['runs']} | " if a.old else ""
        print(f"| {case} | {truth} | {old}{r['wrong']} / {r['runs']} {kind} |")


if __name__ == "__main__":
    main()
