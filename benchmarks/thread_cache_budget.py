"""How large a thread cache the many-threads case needs (docs/threads.md, "The cache budget"):
ArenaPool over CudaDevice(0) with several thread-cache settings, each measured three times through
the C ABI (capi_bench_threads, as benchmarks/thread_scaling.py) at 1 and 16 threads, on the
"mixed, cross-thread frees" case and on 2 MiB blocks alone; the median of the three and the peak
reserved of the last.

    PYTHONPATH=<site> python3 benchmarks/thread_cache_budget.py     (a GPU host; ~1 minute)

Settings: the pool's defaults, thread_cache_bytes 64 and 128 MiB, thread_cache_max_block 1 MiB.
The first output line is the command; the rows were produced with 32 MiB as the default.
"""
from __future__ import annotations

import statistics
import sys

import poolkeeper as pk
from poolkeeper import _core

KiB, MiB = 1 << 10, 1 << 20
MIXED = [4 * KiB, 256 * KiB, 2 * MiB, 32 * MiB]
SETTINGS = {
    "default": {},
    "tcb64": {"thread_cache_bytes": 64 * MiB},
    "tcb128": {"thread_cache_bytes": 128 * MiB},
    "max1M": {"thread_cache_max_block": 1 * MiB},
}


def main() -> int:
    print("command: python3 benchmarks/thread_cache_budget.py " + " ".join(sys.argv[1:]))
    for name, options in SETTINGS.items():
        for sizes, cross, label in ((MIXED, True, "mixed"), ([2 * MiB], False, "2M")):
            row = []
            for threads in (1, 16):
                rates = []
                for _ in range(3):
                    pool = pk.ArenaPool(pk.upstream.CudaDevice(0), **options)
                    _core.registry_set(0, pool)
                    try:
                        r = _core.capi_bench_threads(0, sizes, threads, 0.4, cross, warmup=0.2)
                    finally:
                        _core.registry_set(0, None)
                    st = pool.stats()
                    pool.trim()
                    pool.close()
                    rates.append(r["pairs_per_s"] / 1e6)
                row.append((threads, statistics.median(rates), rates, st["peak_reserved_bytes"] >> 20))
            cells = " ".join(f"{t}t med {m:.2f}M {['%.2f' % x for x in rs]} peakres {pr}MiB" for t, m, rs, pr in row)
            print(name, label, cells, f"16/1 {row[1][1] / row[0][1]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
