"""Do GPU kernels read memory mapped in pieces (the expandable arena's) slower than one cudaMalloc
segment?

The expandable arena maps its memory in 2 MiB physical pieces (``map_piece``) and stitches pieces
that lie apart into new ranges (aliases); PyTorch's allocator hands out pieces of cudaMalloc
segments. If the GPU's address translation reads small separate physical allocations more slowly,
kernels on the arena's memory run slower even where the allocator makes no call. This times the
same kernels, with CUDA events, on one buffer of ``--mib`` MiB from each source:

- ``cudaMalloc``: ``torch.empty`` under PyTorch's own allocator (one segment);
- ``pieces P``: one reserved range mapped in pieces of P MiB (``CudaVirtual.map_pieces``; the
  whole buffer as one piece last);
- ``stitched 2``: every other 2 MiB piece of a range twice the size, aliased end to end into a
  fresh range (``alias_pieces``), as a stitched range is.

Kernels: a sum over the buffer (streaming read); a copy into a cudaMalloc buffer (``copy_``: a
device-to-device memcpy), the same bytes through an elementwise kernel (``torch.add(b, 0, out=)``),
and a copy into the buffer; a ``torch.cat`` of its two halves (as a KV cache grows); and a gather of 8 KiB rows in random order (``index_select``:
translation-heavy, as reading a KV cache's blocks is). Each figure is the median of ``--reps`` runs, the sources taken in turn within
each repetition so that a drifting clock falls on all of them alike; ratios are against cudaMalloc.

    PYTHONPATH=<built poolkeeper> python3 benchmarks/vmm_bandwidth.py [--mib 1024] [--reps 30] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Dict, List

MiB = 1 << 20


class _Raw:
    """A device range as a one-dimensional float16 array (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes // 2,), "typestr": "<f2", "data": (ptr, False),
                                         "version": 3, "strides": None}


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="buffer size (a multiple of 2)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pieces", default="2,4,20", help="piece sizes in MiB (the whole buffer as one piece is added)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import torch  # only here: loading the script must not import torch

    import poolkeeper as pk

    n = args.mib * MiB
    up = pk.upstream.CudaVirtual(0)
    g = up.vm_granularity
    ranges = []  # (base, bytes) reserved, for the teardown
    mapped = []  # (base, [piece sizes]) mapped
    aliased = []  # (dst, [sizes])
    bufs: Dict[str, torch.Tensor] = {"cudaMalloc": torch.empty(n // 2, dtype=torch.float16, device="cuda")}
    for p in [int(x) * MiB for x in args.pieces.split(",") if x.strip()] + [n]:
        base = up.reserve(n)
        ranges.append((base, n))
        up.map_pieces(base, n, p)
        mapped.append((base, [min(p, n - at) for at in range(0, n, p)]))
        bufs[f"pieces {p // MiB}" if p < n else "one piece"] = torch.as_tensor(_Raw(base, n), device="cuda")
    src = up.reserve(2 * n)
    ranges.append((src, 2 * n))
    up.map_pieces(src, 2 * n, g)
    mapped.append((src, [g] * (2 * n // g)))
    dst = up.reserve(n)
    ranges.append((dst, n))
    up.alias_pieces(dst, [(src + 2 * k * g, g) for k in range(n // g)])
    aliased.append((dst, [g] * (n // g)))
    bufs[f"stitched {g // MiB}"] = torch.as_tensor(_Raw(dst, n), device="cuda")

    out = torch.empty(n // 2, dtype=torch.float16, device="cuda")
    row = 4096  # 8 KiB of float16
    idx = torch.randperm(n // 2 // row, device="cuda")
    gathered = torch.empty(idx.numel(), row, dtype=torch.float16, device="cuda")
    for b in bufs.values():
        b.fill_(1.0)
    ones = torch.ones(n // 2, dtype=torch.float16, device="cuda")
    kernels: Dict[str, Callable[[torch.Tensor], object]] = {
        "sum": lambda b: b.sum(),
        "copy": lambda b: out.copy_(b),  # contiguous, same dtype: torch's device-to-device memcpy
        "copy by kernel": lambda b: torch.add(b, 0.0, out=out),  # the same bytes through an elementwise kernel
        "copy in": lambda b: b.copy_(ones),  # the source as the memcpy's destination
        # A KV cache grown by torch.cat (as a dynamic cache grows it each decode step): two halves
        # of the buffer, each 256 rows of 8 KiB blocks, concatenated along the rows.
        "cat": lambda b: torch.cat([h.view(256, -1) for h in b.chunk(2)], dim=1, out=out.view(256, -1)),
        "gather 8 KiB rows": lambda b: torch.index_select(b.view(-1, row), 0, idx, out=gathered),
    }
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms: Dict[str, Dict[str, List[float]]] = {k: {s: [] for s in bufs} for k in kernels}
    for kname, k in kernels.items():
        for b in bufs.values():  # warm every source once
            k(b)
        torch.cuda.synchronize()
        for _ in range(args.reps):
            for s, b in bufs.items():
                start.record()
                k(b)
                end.record()
                end.synchronize()
                ms[kname][s].append(start.elapsed_time(end))
    res = {k: {s: statistics.median(v) for s, v in per.items()} for k, per in ms.items()}
    print(f"{args.mib} MiB per buffer, median of {args.reps} runs, ms (ratio to cudaMalloc)")
    print(f"{'source':14s} " + " ".join(f"{k:>24s}" for k in kernels))
    for s in bufs:
        print(f"{s:14s} " + " ".join(f"{res[k][s]:14.3f} ({res[k][s] / res[k]['cudaMalloc']:6.3f}x)" for k in kernels))
    del bufs
    torch.cuda.synchronize()
    for d, sizes in aliased:
        up.unalias_pieces(d, sizes)
    for b, sizes in mapped:
        up.unmap_pieces(b, sizes)
    for b, k in ranges:
        up.unreserve(b, k)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"mib": args.mib, "reps": args.reps, "ms": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
