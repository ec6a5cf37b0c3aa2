#!/usr/bin/env python3
"""Host-to-device bandwidth from a pageable source: the staging Uploader against plain pageable
``cuMemcpyHtoD`` and against a copy from already-pinned memory (the link's limit), same run.

    python benchmarks/uploader_bench.py benchmarks/uploader_h200.json

For each size (default 256 MiB and 2 GiB) it reports GB/s (1e9 B/s; median and best of
``--reps``) of:

- ``pageable``: ``memcpy_htod(dev, numpy_buffer)`` (the driver stages pageable memory itself);
- ``pinned``: ``memcpy_htod(dev, pinned_buffer)`` with the data already in page-locked memory
  (the pin and the fill are not timed: this is the ceiling, not a way to move pageable data);
- ``uploader``: ``Uploader.upload(numpy_buffer, dev)`` for each engine (``--engine native,python``)
  x chunk size x worker count (``--threads``) x, for the native engine, non-temporal fill on/off
  (``--nt on,off``), after one warm-up upload; ``steady_pinned_allocs`` is the pool's pinned
  allocation count over the timed uploads (must be 0). For the best native configuration of each
  size the engine's phase counters are printed (fill, wait, enqueue time summed over workers, time
  to the first copy), which say where the time goes when the target is missed.

``--nt-threshold BYTES`` re-runs the script with glibc's non-temporal store threshold lowered
(``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold``), so the workers' large memcpys bypass
the cache instead of reading each destination line first: less memory traffic per byte moved.

Every uploader configuration's last upload is verified: the device bytes are copied back and
compared with the source. A table goes to stdout and everything to the JSON file.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

MiB = 1 << 20
GiB = 1 << 30


def parse_size(s: str) -> int:
    s = s.strip().upper()
    for suf, mul in (("GIB", GiB), ("G", GiB), ("MIB", MiB), ("M", MiB), ("KIB", 1024), ("K", 1024)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * mul)
    return int(s)


def fmt_size(n: int) -> str:
    return f"{n / GiB:g} GiB" if n >= GiB else f"{n / MiB:g} MiB"


def timed(fn: Callable[[], Any], reps: int) -> list:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gbps_summary(n: int, secs: list) -> dict:
    rates = [n / s / 1e9 for s in secs]
    return {"gbps_median": statistics.median(rates), "gbps_best": max(rates), "seconds": secs}


def machine() -> dict:
    import poolkeeper as pk

    info: dict = {"python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node()}
    try:
        d = pk.cuda.device_info(0)
        info.update(gpu=d.name, pci_bus_id=d.pci_bus_id, driver=pk.cuda.driver_version())
    except Exception as e:  # still run; say why it is missing
        info["gpu_info_error"] = repr(e)
    return info


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json_out", help="where to write the JSON results")
    ap.add_argument("--sizes", default="256M,2G", help="comma-separated transfer sizes (default 256M,2G)")
    ap.add_argument("--chunks", default="4M,8M,16M", help="uploader chunk sizes to measure")
    ap.add_argument("--workers", "--threads", dest="workers", default="8,12,16", help="uploader worker (thread) counts")
    ap.add_argument("--engine", default="native,python", help="uploader engines to measure (native,python)")
    ap.add_argument("--nt", default="off,on", help="native engine: non-temporal fill settings to measure (on,off)")
    ap.add_argument("--depth", type=int, default=2, help="staging buffers per worker (default 2)")
    ap.add_argument("--ramp", choices=("on", "off", "both"), default="on", help="uploader chunk ramp (default on)")
    ap.add_argument("--tail", choices=("on", "off", "both"), default="on",
                    help="native engine: pieces halving toward the end (default on)")
    ap.add_argument("--nt-threshold", type=parse_size, default=None, help="re-run with this glibc non-temporal threshold")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default 5)")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    tun = f"glibc.cpu.x86_non_temporal_threshold={args.nt_threshold}" if args.nt_threshold else None
    if tun and tun not in os.environ.get("GLIBC_TUNABLES", ""):
        env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), tun])))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + (argv if argv is not None else sys.argv[1:]), env)

    import poolkeeper as pk
    from poolkeeper.cuda import driver
    from poolkeeper.staging import PinnedStagingPool, Uploader

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    chunks = [parse_size(s) for s in args.chunks.split(",")]
    workers = [int(t) for t in args.workers.split(",")]
    ramps = {"on": [True], "off": [False], "both": [True, False]}[args.ramp]
    tails = {"on": [True], "off": [False], "both": [True, False]}[args.tail]
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    nts = [{"on": True, "off": False}[v.strip()] for v in args.nt.split(",") if v.strip()]
    from poolkeeper import _core

    print(f"NT fill ISA: {_core.stream_copy_isa() or 'none (memcpy)'}", flush=True)
    top = max(sizes)
    driver.set_device(args.device)
    print(f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES')}", flush=True)

    t0 = time.perf_counter()
    src = np.random.default_rng(0).integers(0, 2**63, top // 8 + 1, dtype=np.uint64).view(np.uint8)[:top]
    src = np.ascontiguousarray(src)
    gen_s = time.perf_counter() - t0
    dev_up = pk.upstream.CudaDevice(args.device)
    dev = dev_up.allocate(top)
    pinned_up = pk.upstream.CudaPinned(args.device)
    check = np.empty(top, dtype=np.uint8)

    def verify(n: int) -> bool:
        check[:n] = 0
        driver.memcpy_dtoh(check.ctypes.data, dev, n)
        return bool(np.array_equal(check[:n], src[:n]))

    results: dict = {
        "machine": machine(),
        "args": vars(args),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "source_generation_s": gen_s,
        "rows": [],
    }
    rows = results["rows"]

    for n in sizes:
        sp = src[:n]
        # Pageable: the driver's own staging path.
        driver.memcpy_htod(dev, sp.ctypes.data, n)  # warm-up (first touch of the driver's path)
        r = gbps_summary(n, timed(lambda: driver.memcpy_htod(dev, sp.ctypes.data, n), args.reps))
        rows.append(dict(method="pageable memcpy_htod", size=n, verified=verify(n), **r))

        # Pinned: data already page-locked; the pin and unpin are timed once, separately.
        t = time.perf_counter()
        hp = pinned_up.allocate(n)
        pin_s = time.perf_counter() - t
        try:
            ctypes.memmove(hp, sp.ctypes.data, n)
            driver.memcpy_htod(dev, hp, n)
            r = gbps_summary(n, timed(lambda: driver.memcpy_htod(dev, hp, n), args.reps))
            ok = verify(n)
        finally:
            t = time.perf_counter()
            pinned_up.deallocate(hp, n)
            free_s = time.perf_counter() - t
        rows.append(dict(method="pinned memcpy_htod", size=n, verified=ok, pin_alloc_s=pin_s, pin_free_s=free_s, **r))

        # Uploader: pageable source through reused pinned staging buffers.
        configs = [
            (e, c, th, ramp, nt, tail)
            for e in engines
            for c in chunks
            for th in workers
            for ramp in ramps
            for nt in (nts if e == "native" else [False])
            for tail in (tails if e == "native" else [False])
        ]
        for eng, c, th, ramp, nt, tail in configs:
            nbuf = th * args.depth
            pool = PinnedStagingPool(pinned_up, max_buffers=max(8, nbuf), max_bytes=max(512 * MiB, nbuf * c))
            with Uploader(pool, chunk_bytes=c, workers=th, depth=args.depth, ramp=ramp, engine=eng, nt_fill=nt,
                          tail_ramp=tail) as up:
                warm = up.upload(sp, dev)
                reports = [up.upload(sp, dev) for _ in range(args.reps)]
                ok = verify(n)
                st = pool.stats()
            pool.close()
            best_rep = min(reports, key=lambda rp: rp.seconds)
            rows.append(
                dict(
                    method="uploader",
                    engine=eng,
                    nt_fill=bool(best_rep.phases and best_rep.phases["nt_fill"]),
                    size=n,
                    chunk_bytes=c,
                    workers=th,
                    depth=args.depth,
                    ramp=ramp,
                    tail_ramp=tail,
                    verified=ok,
                    warmup_pinned_allocs=warm.pinned_alloc_calls,
                    steady_pinned_allocs=sum(rp.pinned_alloc_calls for rp in reports),
                    steady_reuses=sum(rp.reuses for rp in reports),
                    chunks_per_upload=warm.chunks,
                    overlapped_fills=[rp.overlapped_fills for rp in reports],
                    phases_best=best_rep.phases,
                    pool_pinned_alloc_calls=st["pinned_alloc_calls"],
                    **gbps_summary(n, [rp.seconds for rp in reports]),
                )
            )
            print(
                f"  {fmt_size(n):>8} {eng:<6} chunk {fmt_size(c):>7} workers {th:>2} ramp {'on ' if ramp else 'off'}"
                f"{(' nt ' + ('on ' if nt else 'off') + ' tail ' + ('on ' if tail else 'off')) if eng == 'native' else '                '}: "
                f"{rows[-1]['gbps_median']:6.1f} GB/s median, {rows[-1]['gbps_best']:6.1f} best, "
                f"steady pinned allocs {rows[-1]['steady_pinned_allocs']}, verified {ok}",
                flush=True,
            )

    dev_up.deallocate(dev, top)

    # Summary table: per size, pageable, pinned, and the best configuration of each engine.
    def label(r: dict) -> str:
        name = r["method"]
        if name == "uploader":
            name = f"{r['engine']} ({fmt_size(r['chunk_bytes'])}, {r['workers']}x{r['depth']}"
            name += f"{'' if r['ramp'] else ', no ramp'}{', nt' if r['nt_fill'] else ''}"
            name += f"{', no tail' if r['engine'] == 'native' and not r.get('tail_ramp', True) else ''})"
        return name

    print()
    print(f"{'size':>8}  {'method':<34} {'GB/s median':>11} {'GB/s best':>9} {'steady pins':>11} {'verified':>8}")
    summary = []
    for n in sizes:
        sel = [r for r in rows if r["size"] == n]
        bests = [
            max((r for r in sel if r["method"] == "uploader" and r["engine"] == e), key=lambda r: r["gbps_median"])
            for e in engines
        ]
        for r in [x for x in sel if x["method"] != "uploader"] + bests:
            pins = str(r.get("steady_pinned_allocs", "-"))
            print(f"{fmt_size(n):>8}  {label(r):<34} {r['gbps_median']:>11.1f} {r['gbps_best']:>9.1f} {pins:>11} {str(r['verified']):>8}")
            summary.append({k: v for k, v in r.items() if k != "seconds"})
    print("\nphase counters of the best native configuration (fastest rep; fill/wait/enqueue summed over workers):")
    for n in sizes:
        nat = [r for r in rows if r["size"] == n and r.get("engine") == "native"]
        if not nat:
            continue
        r = max(nat, key=lambda r: r["gbps_median"])
        ph, w = r["phases_best"], r["workers"]
        print(
            f"{fmt_size(n):>8}  {label(r)}: wall {ph['wall_s'] * 1e3:.2f} ms, first copy at {ph['first_copy_s'] * 1e3:.2f} ms; "
            f"per worker: fill {ph['fill_s'] / w * 1e3:.2f} ms, wait {ph['wait_s'] / w * 1e3:.2f} ms, "
            f"enqueue {ph['enqueue_s'] / w * 1e3:.2f} ms"
        )
        if "last_start_s" in ph:
            total = min(r["seconds"])
            print(
                f"{'':>8}  upload() {total * 1e3:.2f} ms = engine {ph['wall_s'] * 1e3:.2f} ms + "
                f"{(total - ph['wall_s']) * 1e3:.2f} ms around it (acquire, witnesses, retire); last worker "
                f"started at {ph['last_start_s'] * 1e3:.2f} ms; last fill ended at {ph['last_fill_end_s'] * 1e3:.2f} ms "
                f"(copy tail {(ph['wall_s'] - ph['last_fill_end_s']) * 1e3:.2f} ms); link time at 55.3 GB/s "
                f"{n / 55.3e9 * 1e3:.2f} ms"
            )
    results["summary"] = summary
    with open(args.json_out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json_out}")
    bad = [r for r in rows if not r["verified"] or r.get("steady_pinned_allocs", 0)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
