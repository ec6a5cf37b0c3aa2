"""Stream-ordered release on the simulated device (docs/stream_order.md): a block released on
stream A is reusable at once on A, and on any other stream only after an event recorded on A (and
on every record_stream stream) has completed. Pending bytes are never free."""
from __future__ import annotations

import random

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20
STREAM_POOLS = {
    "size_class": lambda up: pk.SizeClassPool(up),
    "arena": lambda up: pk.ArenaPool(up, initial_backing=1 * MiB, max_backing=4 * MiB),
    "arena_nocache": lambda up: pk.ArenaPool(up, initial_backing=1 * MiB, max_backing=4 * MiB, thread_cache_bytes=0),
}


@pytest.fixture(params=sorted(STREAM_POOLS))
def spool(request):
    sim = pk.upstream.Simulated(latency_us=0)
    return sim, STREAM_POOLS[request.param](sim)


def test_block_returns_to_its_own_stream_at_once_but_not_to_another_until_the_event(spool):
    sim, pool = spool
    a, b = sim.stream(), sim.stream()
    sim.enqueue(a, 100.0)  # a kernel on A still uses the block for 100 us
    p = pool.allocate(64 * KiB, a)
    pool.deallocate(p, a)
    st = pool.stats()
    assert st["pending_bytes"] >= 64 * KiB and st["free_bytes"] + st["pending_bytes"] + st["live_bytes"] + st["overhead_bytes"] == st["reserved_bytes"]
    q = pool.allocate(64 * KiB, b)  # another stream: must not get p while A's work runs
    assert q != p
    pool.validate()
    r = pool.allocate(64 * KiB, a)  # the same stream: p at once (stream order covers it)
    assert r == p
    pool.deallocate(r, a)
    pool.deallocate(q, b)
    assert pool.process_pending() == 0 or sim.now < 100.0
    for _ in range(3):  # still before A's event: B never sees p
        x = pool.allocate(64 * KiB, b)
        assert x != p
        pool.deallocate(x)
    sim.advance(100.0)  # the clock passes A's work
    pool.process_pending()
    assert p not in _pending_addresses(pool)
    seen = {pool.allocate(64 * KiB, b) for _ in range(4)}
    assert p in seen
    pool.validate()


def _pending_addresses(pool):
    return {b.address + c.offset for b in pool.snapshot().backings for c in b.chunks if c.state == "pending"}


def test_pending_bytes_are_never_free(spool):
    sim, pool = spool
    a = sim.stream()
    sim.enqueue(a, 50.0)
    ptrs = [pool.allocate(32 * KiB, a) for _ in range(4)]
    free_before = pool.stats()["free_bytes"]
    for p in ptrs:
        pool.deallocate(p, a)
    st = pool.stats()
    assert st["pending_bytes"] >= 4 * 32 * KiB
    assert st["free_bytes"] == free_before  # nothing released on A became free
    assert st["pending_by_stream"].get(a, 0) + st.get("thread_cached_pending_bytes", 0) >= 4 * 32 * KiB or st["pending_bytes"] >= 4 * 32 * KiB
    snap = pool.snapshot()
    pk.accounting.check(snap)
    pending = [c for b in snap.backings for c in b.chunks if c.state == "pending"]
    assert pending and all(a in c.waits_on for c in pending)
    sim.advance(50.0)
    pool.process_pending()
    st = pool.stats()
    assert st["pending_bytes"] == 0 and st["free_bytes"] >= free_before + 4 * 32 * KiB
    pool.validate()


def test_record_stream_delays_reuse_until_every_stream_is_done(spool):
    sim, pool = spool
    a, b, c = sim.stream(), sim.stream(), sim.stream()
    p = pool.allocate(128 * KiB, a)
    sim.enqueue(a, 10.0)
    sim.enqueue(b, 200.0)  # B also reads the block, for longer
    pool.record_stream(p, b)
    pool.deallocate(p, a)
    sim.advance(20.0)  # A is done, B is not
    pool.process_pending()
    assert p in _pending_addresses(pool)
    assert pool.allocate(128 * KiB, c) != p
    assert pool.allocate(128 * KiB, a) != p  # recorded on B: not even A may reuse it early
    sim.advance(200.0)
    pool.process_pending()
    assert p not in _pending_addresses(pool)
    pool.validate()


def test_synchronize_settles_everything(spool):
    sim, pool = spool
    s = sim.stream()
    sim.enqueue(s, 1e6)
    for _ in range(10):
        pool.deallocate(pool.allocate(10 * KiB, s), s)
    assert pool.stats()["pending_bytes"] > 0
    pool.synchronize()
    assert pool.stats()["pending_bytes"] == 0
    assert sim.now >= 1e6  # the host waited for the device
    pool.validate()


def test_stream_none_release_is_free_for_everyone(spool):
    sim, pool = spool
    a, b = sim.stream(), sim.stream()
    sim.enqueue(a, 1e6)
    p = pool.allocate(64 * KiB, a)
    pool.deallocate(p)  # caller guarantees completion
    assert pool.stats()["pending_bytes"] == 0
    assert pool.allocate(64 * KiB, b) == p
    pool.validate()


def test_one_fence_covers_many_releases():
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, thread_cache_bytes=0)
    a, b = sim.stream(), sim.stream()
    ptrs = [pool.allocate(4 * KiB, a) for _ in range(100)]
    for p in ptrs:
        pool.deallocate(p, a)
    assert pool.stats()["fences_recorded"] == 0  # releases record no event
    pool.process_pending()
    st = pool.stats()
    assert st["fences_recorded"] == 1 and st["pending_bytes"] == 0
    assert sim.live_events == 0  # the event was released once its blocks moved to free


@pytest.mark.parametrize("stream_obj", ["cuda_stream", "ptr", "protocol"])
def test_stream_objects_are_accepted(stream_obj):
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim)
    h = sim.stream()

    class TorchLike:
        cuda_stream = h

    class CupyLike:
        ptr = h

    class Protocol:
        def __cuda_stream__(self):
            return (0, h)

    obj = {"cuda_stream": TorchLike(), "ptr": CupyLike(), "protocol": Protocol()}[stream_obj]
    sim.enqueue(h, 10.0)
    p = pool.allocate(1 * KiB, obj)
    pool.deallocate(p, obj)
    assert pool.stats()["pending_bytes"] > 0
    assert pool.allocate(1 * KiB, h) == p  # the object and the int are the same stream
    snap = pool.snapshot()
    assert any(c.alloc_stream == h for _, c in snap.chunks())


@pytest.mark.parametrize("kind", ["size_class", "arena", "arena_nocache"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_multi_stream_run_never_reuses_early(kind, seed):
    """Thousands of steps over several streams with a reuse oracle: an address released on stream
    A may be handed to another stream only once the clock has passed the work A had enqueued at
    release (and the work of every record_stream stream). validate() after every step."""
    rng = random.Random(seed)
    sim = pk.upstream.Simulated(latency_us=0)
    pool = STREAM_POOLS[kind](sim)
    streams = [sim.stream() for _ in range(4)]
    live = {}  # ptr -> (size, alloc stream, extra streams)
    safe = {}  # ptr -> (release stream, time after which any stream may reuse it)
    sizes = [256, 1000, 4 * KiB, 33 * KiB, 64 * KiB, 300 * KiB]
    cross_reuses = 0
    for step in range(1500):
        r = rng.random()
        s = rng.choice(streams)
        if r < 0.15:
            sim.enqueue(s, rng.choice([0.0, 5.0, 50.0, 400.0]))
        elif r < 0.25:
            sim.advance(rng.choice([1.0, 20.0, 100.0]))
        elif r < 0.30:
            pool.process_pending()
        elif r < 0.33 and live:
            p = rng.choice(list(live))
            extra = rng.choice(streams)
            pool.record_stream(p, extra)
            live[p][2].add(extra)
        elif r < 0.65 or not live:
            n = rng.choice(sizes)
            p = pool.allocate(n, s)
            if p in safe:
                rel_stream, t = safe.pop(p)
                assert s == rel_stream or sim.now >= t, (
                    f"step {step}: {p:#x} released on {rel_stream} reused on {s} at t={sim.now} < {t}")
                cross_reuses += s != rel_stream
            live[p] = (n, s, set())
        else:
            p = rng.choice(list(live))
            n, alloc_s, extra = live.pop(p)
            rs = rng.choice([None, alloc_s, alloc_s, s])
            pool.deallocate(p, rs)
            if rs is None:
                safe.pop(p, None)
            else:
                users = {rs} | extra
                t = max(sim.busy_until(u) for u in users)
                # Same-stream reuse is only safe when no other stream used it.
                safe[p] = (rs if not (extra - {rs}) else None, t)
        st = pool.stats()
        assert st["reserved_bytes"] == st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]
        pool.validate()
    assert cross_reuses >= 20  # the oracle was exercised, not vacuous
    for p in list(live):
        pool.deallocate(p)
    pool.synchronize()
    assert pool.stats()["pending_bytes"] == 0
    pool.validate()


def test_a_stream_splits_its_own_pending_blocks_instead_of_growing():
    """A framework frees on the stream it allocates on while the device lags: the stream must be
    able to carve smaller requests out of what it released, not only reuse exact sizes."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=3 * MiB, max_backing=3 * MiB, thread_cache_bytes=0)
    s, other = sim.stream(), sim.stream()
    sim.enqueue(s, 1e6)  # the device is far behind
    big = pool.allocate(3 * MiB, s)
    pool.deallocate(big, s)
    reserved = pool.stats()["reserved_bytes"]
    parts = [pool.allocate(700 * KiB, s) for _ in range(4)]  # all carved from the pending 3 MiB
    assert parts[0] == big and pool.stats()["reserved_bytes"] == reserved
    assert all(big <= p < big + 3 * MiB for p in parts)
    assert pool.allocate(700 * KiB, other) not in range(big, big + 3 * MiB)  # never another stream
    pool.validate()


def test_neighbours_released_on_one_stream_merge_for_that_stream():
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=2 * MiB, max_backing=2 * MiB, thread_cache_bytes=0)
    s = sim.stream()
    sim.enqueue(s, 1e6)
    a, b = pool.allocate(1 * MiB, s), pool.allocate(1 * MiB, s)  # the whole backing
    pool.deallocate(a, s)
    pool.deallocate(b, s)
    reserved = pool.stats()["reserved_bytes"]
    assert pool.allocate(2 * MiB, s) == a  # the merged pending run, carved at once by s
    assert pool.stats()["reserved_bytes"] == reserved
    pool.validate()


def test_a_split_remainder_keeps_its_release_position():
    """Carving a stream's own pending block must not push the rest behind later releases: once the
    fence covering the original release completes, the remainder is free for every stream."""
    sim = pk.upstream.Simulated(latency_us=0)
    pool = pk.ArenaPool(sim, initial_backing=4 * MiB, max_backing=4 * MiB, thread_cache_bytes=0)
    s, other = sim.stream(), sim.stream()
    sim.enqueue(s, 100.0)
    big = pool.allocate(4 * MiB, s)
    pool.deallocate(big, s)
    pool.process_pending()  # fence recorded now: completes at t=100
    sim.enqueue(s, 1e6)  # then much more work on s
    part = pool.allocate(1 * MiB, s)  # carved from the pending block; the rest stays pending
    assert part == big
    sim.advance(100.0)  # the first fence completes; the later work has not
    pool.process_pending()
    assert pool.stats()["pending_bytes"] == 0  # the remainder kept the early position
    assert pool.allocate(3 * MiB, other) == big + 1 * MiB
    pool.validate()
