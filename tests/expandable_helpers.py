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
