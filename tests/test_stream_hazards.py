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


def _run(seed: int, expandable: bool, single_stream: bool = False, home_share: int = 8,
         check_releases: bool = False) -> dict:
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
    if single_stream:
        # Frequent shrink scans too: they release home memory only behind their own settle events.
        kw.update(single_stream=True, shrink_interval=rng.choice([1, 3, 4096]), shrink_hysteresis=rng.choice([1, 2]))
    pool = pk.ArenaPool(up, **kw)
    streams = [sim.stream() for _ in range(3)]
    # Mostly one lagging stream, as a framework's traffic: its releases stay pending for the others.
    choices = [streams[0]] * home_share + [None] + streams

    def check() -> None:
        pool.validate()
        check_equation(pool.stats())

    sizes = [256, 4 * KiB, 100 * KiB, MiB, 2 * MiB, 3 * MiB + 7, 5 * MiB]
    traffic(pool, sim, rng, 400, lambda: rng.choice(sizes + [rng.randint(1, 9 * MiB)]), choices,
            up=up if faulty else None, check=check, lagmul=rng.choice([1, 10, 50]), check_releases=check_releases)
    pool.synchronize()
    check()
    st = pool.stats()
    assert st["live_bytes"] == 0 and st["pending_bytes"] == 0, st
    pool.close()
    return st


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_no_range_reaches_another_stream_before_its_uses_are_done(seed, expandable):
    _run(seed, expandable)


@pytest.mark.parametrize("home_share", [8, 400])
@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_single_stream_mode_hands_no_range_to_another_stream_before_the_home_stream_is_past_it(
        seed, expandable, home_share):
    """single_stream files home releases free at once; the first allocation on another stream (or
    none) must wait for the home stream before it can take any of that memory, trim and OOM
    recovery must wait before giving it back, and the mode must end. home_share 400: the home
    stream alone for long stretches, so the mode lasts and ends late."""
    st = _run(seed, expandable, single_stream=True, home_share=home_share, check_releases=True)
    if home_share == 400:  # the mode lasted long enough to file home releases free
        assert st["home_frees"] > 0, st


@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_no_range_leaves_the_pool_while_a_stream_may_still_use_it(seed, expandable):
    """The same traffic, each step's memory going back upstream (freed, unmapped, unaliased)
    checked against the oracle as well, in the default stream order."""
    _run(seed, expandable, check_releases=True)
