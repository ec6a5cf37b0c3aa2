"""What the expandable-arena tests share: the simulated device and a pool that grows one mapping
granule at a time, so every granule can be mapped, unmapped and counted on its own."""
from __future__ import annotations

import poolkeeper as pk

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
G = 2 * MiB  # the simulated device's mapping granularity


def sim(**kw):
    """A simulated device without latency (it has the virtual-memory interface)."""
    return pk.upstream.Simulated(latency_us=0, **kw)


def pool_in_granules(up, **kw):
    """An expandable ArenaPool whose growth maps exactly what is missing, one granule per map call
    (no step fraction, no thread cache); ``kw`` overrides."""
    opts = dict(expandable=True, initial_backing=G, step_fraction=0.0, max_step=G, thread_cache_bytes=0)
    opts.update(kw)
    return pk.ArenaPool(up, **opts)


def physical_spans(up, p, n):
    """The memory behind the block [p, p + n) on a Simulated device ``up``, as [start, end) spans of
    first-mapping addresses: a stitched block's bytes lie behind pieces of the main range."""
    spans, at = [], p
    while at < p + n:
        end = min(p + n, (at // G + 1) * G)  # pieces and aliases are whole granules
        phys = up.physical(at)
        assert phys, f"byte {at:#x} of a live block is not mapped"
        spans.append((phys, phys + end - at))
        at = end
    return spans


def assert_disjoint(up, blocks):
    """No physical byte lies behind two of ``blocks`` ((address, size) pairs): neither two
    addresses of the same block range nor a stitched alias and the main range reach one byte."""
    spans = sorted(s for p, n in blocks if n for s in physical_spans(up, p, n))
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, f"physical bytes {b0:#x}..{min(a1, b1):#x} lie behind two live blocks"
