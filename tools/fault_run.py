#!/usr/bin/env python3
"""Long seeded fault-injection campaign over every pool (the figures in docs/hardening.md).

    PYTHONPATH=/tmp/site-NAME python3 tools/fault_run.py --ops 20000 --seeds 3

Each run: random allocate/free/record_stream/process_pending/trim/synchronize over
Faulty(Simulated) with a share of the allocations and frees refused; validate() after every
operation; at the end faults off, everything freed, the pool closed. See tests/test_faults.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_faults import POOLS, run_campaign  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=20000, help="operations per run")
    ap.add_argument("--seeds", type=int, default=3, help="runs per (pool, error)")
    ap.add_argument("--seed", type=int, default=1, help="first seed")
    args = ap.parse_args()
    tot = dict(ops=0, faults=0, failed=0, validations=0, free_failures=0)
    print(f"{'pool':<14} {'error':<9} {'seed':>5} {'ops':>7} {'faults':>7} {'raised':>7} {'free_fail':>9} {'leaked_B':>10} {'validate':>9}")
    t0 = time.time()
    for kind in sorted(POOLS):
        for error in ("oom", "upstream"):
            for k in range(args.seeds):
                c = run_campaign(kind, error, args.ops, args.seed + k)
                print(f"{kind:<14} {error:<9} {args.seed + k:>5} {c.ops:>7} {c.faults_injected:>7} {c.ops_failed:>7} "
                      f"{c.upstream_free_failures:>9} {c.leaked_bytes:>10} {c.validations:>9}")
                tot["ops"] += c.ops
                tot["faults"] += c.faults_injected
                tot["failed"] += c.ops_failed
                tot["validations"] += c.validations
                tot["free_failures"] += c.upstream_free_failures
    print(f"total: {tot['ops']} operations, {tot['faults']} faults injected, all survived with validate() clean "
          f"after every operation ({tot['validations']} validations); {tot['failed']} operations raised a typed error; "
          f"{tot['free_failures']} refused frees counted by the pools; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
