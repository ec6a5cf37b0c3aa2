"""Each virtual-memory driver call timed alone on the GPU, and whether one cuMemUnmap takes down a
run of mappings.

The expandable arena's time in the driver is its maps, aliases and unmaps (docs/expandable.md,
"Runs"); ``vmm_latency.py`` times them as poolkeeper makes them. This times the driver calls
inside them one at a time, calling libcuda directly (ctypes; the library poolkeeper loads:
``POOLKEEPER_LIBCUDA`` or ``libcuda.so.1``), so the cost of a map splits into cuMemCreate,
cuMemMap and cuMemSetAccess, and an alias (cuMemMap of a handle mapped already) stands apart.
cuMemSetAccess is timed over one piece and over a run of ``--pieces`` pieces (per piece).
Medians over ``--reps`` repetitions, in us, one granule per piece; each figure includes one ctypes
call (under 1 us).

Then a question the driver's documentation leaves open ("the range must be the entire contiguous
address range that was mapped to"): does one cuMemUnmap over ``--pieces`` adjacent mappings take
them all down? The answer is printed as the driver gave it (and checked: a piece it took down
can be mapped again). CudaVirtual asks the same question at its first run and keeps the answer
(``CudaVirtual.unmap_runs``); ``vmm_latency.py`` prints what it got.

With ``--background 0,1000,4000`` the calls are timed again with that many other mappings present
(aliases of one piece, access granted, as the expandable arena's stale aliases are): whether the
driver's calls slow as its mappings grow, which is what keeping stale aliases mapped could cost
(docs/expandable.md, "Stale aliases stay").

    python3 benchmarks/vmm_driver_calls.py [--device 0] [--pieces 8] [--reps 20] [--background 0]
                                           [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from typing import Callable, Dict, List

c_u64 = ctypes.c_uint64


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


PINNED, LOCATION_DEVICE, PROT_READWRITE = 1, 1, 3


class Driver:
    """The few libcuda entry points this needs, typed, with a context current on this thread."""

    def __init__(self, device: int) -> None:
        self.lib = lib = ctypes.CDLL(os.environ.get("POOLKEEPER_LIBCUDA") or "libcuda.so.1")
        sig = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(c_u64), ctypes.c_size_t, ctypes.c_size_t, c_u64, ctypes.c_ulonglong],
            "cuMemAddressFree": [c_u64, ctypes.c_size_t],
            "cuMemCreate": [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.POINTER(AllocationProp), ctypes.c_ulonglong],
            "cuMemRelease": [ctypes.c_ulonglong],
            "cuMemMap": [c_u64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_ulonglong],
            "cuMemUnmap": [c_u64, ctypes.c_size_t],
            "cuMemSetAccess": [c_u64, ctypes.c_size_t, ctypes.POINTER(AccessDesc), ctypes.c_size_t],
        }
        for name, args in sig.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
        self.check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.prop = AllocationProp(type=PINNED, requestedHandleTypes=0, location=MemLocation(LOCATION_DEVICE, device))
        self.access = AccessDesc(location=MemLocation(LOCATION_DEVICE, device), flags=PROT_READWRITE)
        g = ctypes.c_size_t()
        self.check(lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self.prop), 0), "cuMemGetAllocationGranularity")
        self.granule = g.value

    @staticmethod
    def check(r: int, call: str) -> None:
        if r:
            raise RuntimeError(f"{call} returned CUresult {r}")

    def reserve(self, n: int) -> int:
        p = c_u64()
        self.check(self.lib.cuMemAddressReserve(ctypes.byref(p), n, self.granule, 0, 0), "cuMemAddressReserve")
        return p.value

    def create(self) -> int:
        h = ctypes.c_ulonglong()
        self.check(self.lib.cuMemCreate(ctypes.byref(h), self.granule, ctypes.byref(self.prop), 0), "cuMemCreate")
        return h.value

    def map(self, at: int, h: int) -> None:
        self.check(self.lib.cuMemMap(at, self.granule, 0, h, 0), "cuMemMap")

    def grant(self, at: int, n: int) -> None:
        self.check(self.lib.cuMemSetAccess(at, n, ctypes.byref(self.access), 1), "cuMemSetAccess")

    def unmap(self, at: int, n: int) -> int:
        return self.lib.cuMemUnmap(at, n)

    def release(self, h: int) -> None:
        self.check(self.lib.cuMemRelease(h), "cuMemRelease")


def timed(t: Dict[str, List[float]], key: str, fn: Callable[[], object], per: int = 1) -> object:
    t0 = time.perf_counter_ns()
    r = fn()
    t.setdefault(key, []).append((time.perf_counter_ns() - t0) / per / 1e3)
    return r


def measure(d: Driver, n: int, reps: int) -> Dict[str, float]:
    g = d.granule
    base, dst = d.reserve(n * g), d.reserve(n * g)
    t: Dict[str, List[float]] = {}
    for rep in range(reps):
        hs = [timed(t, "cuMemCreate", d.create) for _ in range(n)]
        for k, h in enumerate(hs):
            timed(t, "cuMemMap", lambda: d.map(base + k * g, h))
        if rep % 2:
            for k in range(n):
                timed(t, "cuMemSetAccess, one piece", lambda: d.grant(base + k * g, g))
        else:
            timed(t, f"cuMemSetAccess, run of {n} (per piece)", lambda: d.grant(base, n * g), per=n)
        for k, h in enumerate(hs):  # aliases: the same handles again at dst
            timed(t, "cuMemMap of a mapped handle (alias)", lambda: d.map(dst + k * g, h))
        d.grant(dst, n * g)
        for k in range(n):
            timed(t, "cuMemUnmap of an alias", lambda: d.check(d.unmap(dst + k * g, g), "cuMemUnmap"))
        for k in range(n):
            timed(t, "cuMemUnmap", lambda: d.check(d.unmap(base + k * g, g), "cuMemUnmap"))
        for h in hs:
            timed(t, "cuMemRelease", lambda: d.release(h))
    d.check(d.lib.cuMemAddressFree(dst, n * g), "cuMemAddressFree")
    d.check(d.lib.cuMemAddressFree(base, n * g), "cuMemAddressFree")
    return {k: statistics.median(v) for k, v in t.items()}


def with_background(d: Driver, count: int, fn: Callable[[], Dict[str, float]]) -> Dict[str, float]:
    """fn() with ``count`` other mappings present: one piece aliased ``count`` times end to end,
    access granted over them; all taken down afterwards."""
    if not count:
        return fn()
    g = d.granule
    base = d.reserve(count * g)
    h = d.create()
    for k in range(count):
        d.map(base + k * g, h)
    d.grant(base, count * g)
    try:
        return fn()
    finally:
        for k in range(count):
            d.check(d.unmap(base + k * g, g), "cuMemUnmap")
        d.release(h)
        d.check(d.lib.cuMemAddressFree(base, count * g), "cuMemAddressFree")


def unmap_run_probe(d: Driver, n: int) -> Dict[str, object]:
    """One cuMemUnmap over n adjacent mappings: the driver's answer, and whether each piece it
    took down can be mapped again (it is unmapped)."""
    g = d.granule
    base = d.reserve(n * g)
    hs = [d.create() for _ in range(n)]
    for k, h in enumerate(hs):
        d.map(base + k * g, h)
    d.grant(base, n * g)
    t0 = time.perf_counter_ns()
    r = d.unmap(base, n * g)
    us = (time.perf_counter_ns() - t0) / 1e3
    remapped = 0
    if r == 0:
        for k, h in enumerate(hs):  # unmapped for real: each maps again where it was
            if d.lib.cuMemMap(base + k * g, g, 0, h, 0) == 0:
                remapped += 1
    # Every piece is mapped now (never taken down, or mapped again): each goes alone. The answer
    # above is reported even if this cleanup is refused somewhere (cleanup_ok says so).
    unmapped = [d.unmap(base + k * g, g) for k in range(n)]
    released = [d.lib.cuMemRelease(h) for h in hs]
    freed = d.lib.cuMemAddressFree(base, n * g)
    return {"pieces": n, "result": r, "accepted": r == 0, "us": us, "remapped": remapped,
            "cleanup_ok": freed == 0 and not any(unmapped) and not any(released)}


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--pieces", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--background", default="0",
                    help="comma-separated counts of other mappings present while timing (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.background.split(",")]
    if any(c < 0 for c in counts):
        ap.error("--background counts must be >= 0")
    d = Driver(args.device)
    by_count = {c: with_background(d, c, lambda: measure(d, args.pieces, args.reps)) for c in counts}
    calls = by_count[counts[0]]
    print(f"one piece = {d.granule >> 20} MiB; median of {args.reps} repetitions, us per call (per piece for a run)")
    if len(counts) > 1:
        print(f"  {'other mappings present':42s} " + " ".join(f"{c:>8d}" for c in counts))
    for k in calls:
        print(f"  {k:42s} " + " ".join(f"{by_count[c][k]:8.1f}" for c in counts))
    probe = unmap_run_probe(d, args.pieces)
    verdict = (f"accepted ({probe['us']:.1f} us; {probe['remapped']} of {args.pieces} pieces mapped again after it)"
               if probe["accepted"] else f"refused (CUresult {probe['result']}); unmapped one by one instead")
    if not probe["cleanup_ok"]:
        verdict += "; cleaning up afterwards was refused somewhere"
    print(f"one cuMemUnmap over {args.pieces} adjacent mappings: {verdict}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"granularity": d.granule, "reps": args.reps, "pieces": args.pieces, "calls_us": calls,
                       "background_calls_us": {str(c): v for c, v in by_count.items()}, "unmap_run": probe}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
