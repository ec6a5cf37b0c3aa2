"""Seeded random multi-stream traffic, checked against a stream-order oracle (stream_hazards.py):
no range is ever handed to a stream while another stream's work enqueued before its release may
still use it -- through same-stream splits, merged runs of free and pending chunks
(take_stream_run_locked), record_stream, cross-stream releases, refused upstream calls and limits.
The existing traffic tests check only that live blocks never overlap."""
from __future__ import annotations

import random

import pytest

import poolkeeper as pk
from pool_oracle import check_equation
from stream_hazards import traffic

KiB, MiB = 1 << 10, 1 << 20


def _run(seed: int, expandable: bool) -> int:
    rng = random.Random(seed)
    sim = pk.upstream.Simulated(latency_us=0, capacity=rng.choice([32, 64, 256]) * MiB)
    faulty = rng.random() < 0.5
    up = pk.upstream.Faulty(sim, fail_every=rng.choice([5, 7, 11]), fail_frees=True, armed=False) if faulty else sim
    kw = dict(thread_cache_bytes=rng.choice([0, 0, 256 * KiB]), shards=1)
    if expandable:
        if not sim.supports_virtual:
            pytest.skip("Simulated upstream without virtual memory on this host")
        kw.update(expandable=True, initial_backing=2 * MiB, step_fraction=rng.choice([0, 0.0625]),
                  max_step=rng.choice([2, 8]) * MiB, map_piece=rng.choice([0, 2 * MiB]),
                  release_on_grow=rng.random() < 0.5, stitch=rng.random() < 0.5)
    else:
        kw.update(initial_backing=rng.choice([1, 4, 16]) * MiB)
    if rng.random() < 0.3:
        kw["limit"] = rng.choice([24, 48]) * MiB
    pool = pk.ArenaPool(up, **kw)
    streams = [sim.stream() for _ in range(3)]
    # Mostly one lagging stream, as a framework's traffic: its releases stay pending for the others.
    choices = [streams[0]] * 8 + [None] + streams

    def check() -> None:
        pool.validate()
        check_equation(pool.stats())

    sizes = [256, 4 * KiB, 100 * KiB, MiB, 2 * MiB, 3 * MiB + 7, 5 * MiB]
    traffic(pool, sim, rng, 400, lambda: rng.choice(sizes + [rng.randint(1, 9 * MiB)]), choices,
            up=up if faulty else None, check=check, lagmul=rng.choice([1, 10, 50]))
    pool.synchronize()
    check()
    st = pool.stats()
    assert st["live_bytes"] == 0 and st["pending_bytes"] == 0, st
    pool.close()
    return st["stream_runs"]


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_no_range_reaches_another_stream_before_its_uses_are_done(seed, expandable):
    _run(seed, expandable)
