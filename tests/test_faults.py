"""Fault injection (poolkeeper.upstream.Faulty): every pool surfaces a refused upstream call as a
typed error, rolls back what it had started, keeps validate() clean and keeps serving. A refused
upstream *free* follows each pool's stated policy (re-live and raise / re-adopt and retry /
re-adopt and retry), tested exactly. A seeded randomized campaign mixes faults with every operation.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

import poolkeeper as pk

KiB, MiB = 1 << 10, 1 << 20

POOLS = {
    "direct": lambda up: pk.Direct(up),
    "size_class": lambda up: pk.SizeClassPool(up),
    "arena": lambda up: pk.ArenaPool(up, initial_backing=64 * KiB, max_backing=1 * MiB),
    "arena_nocache": lambda up: pk.ArenaPool(up, initial_backing=64 * KiB, max_backing=1 * MiB, thread_cache_bytes=0),
}
KEYS = ("reserved_bytes", "live_bytes", "free_bytes", "pending_bytes", "overhead_bytes", "live_blocks", "backings")


def sim():
    return pk.upstream.Simulated(latency_us=0)


def books(pool):
    st = pool.stats()
    return {k: st[k] for k in KEYS}


def accounting_holds(pool):
    st = pool.stats()
    return st["reserved_bytes"] == st["live_bytes"] + st["free_bytes"] + st["pending_bytes"] + st["overhead_bytes"]


# ------------------------------------------------------------------ the injector itself


def test_faulty_counts_and_refuses_exactly_the_planned_calls():
    inner = pk.upstream.Host()
    f = pk.upstream.Faulty(inner, fail_every=3, fail_at={0}, fail_frees=True)
    outcomes = []
    for _ in range(7):
        try:
            p = f.allocate(4096)
            f.deallocate(p, 4096)
            outcomes.append("ok")
        except pk.errors.UpstreamError as e:
            outcomes.append(e.error_name)
    # Watched calls (allocations and frees in one sequence): 0 alloc (fail_at) | 1 alloc, 2 free
    # (3rd) | 3 alloc, 4 free | 5 alloc (6th) | 6 alloc, 7 free | 8 alloc (9th) | 9 alloc, 10 free.
    oom, fault = "POOLKEEPER_INJECTED_OOM", "POOLKEEPER_INJECTED_FAULT"
    assert outcomes == [oom, fault, "ok", oom, "ok", oom, "ok"]
    assert (f.calls, f.injected_allocations, f.injected_deallocations, f.injected) == (11, 3, 1, 4)
    # A refused call never reaches the inner upstream; a refused free leaves the memory there.
    c = inner.counters()
    assert (c["allocations"], c["deallocations"], c["outstanding_bytes"]) == (4, 3, 4096)
    assert c["failed_allocations"] == 0 and c["failed_deallocations"] == 0
    assert f.counters()["failed_allocations"] == 3 and f.counters()["failed_deallocations"] == 1


def test_faulty_indices_and_rules():
    inner = pk.upstream.Host()
    f = pk.upstream.Faulty(inner, fail_every=4)
    refused = []
    for i in range(12):
        try:
            f.deallocate(f.allocate(256), 256)  # frees are not watched: only allocations count
        except pk.errors.UpstreamError:
            refused.append(i)
    assert refused == [3, 7, 11]
    assert f.calls == 12 and f.injected == 3
    assert inner.counters()["allocations"] == 9 and inner.counters()["outstanding_bytes"] == 0

    g = pk.upstream.Faulty(inner, fail_bytes_over=1000, error="upstream")
    g.deallocate(g.allocate(1000), 1000)
    with pytest.raises(pk.errors.UpstreamError) as ei:
        g.allocate(1001)
    assert ei.value.error_name == "POOLKEEPER_INJECTED_FAULT" and ei.value.code == 990
    assert "Faulty(Host)" in ei.value.upstream

    h = pk.upstream.Faulty(inner, fail_every=1, armed=False)
    h.deallocate(h.allocate(256), 256)  # disarmed: passes through, still counted
    assert h.calls == 1 and h.injected == 0
    h.armed = True
    with pytest.raises(pk.errors.UpstreamError):
        h.allocate(256)
    assert h.calls == 2 and h.injected == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(fail_every=0),
        dict(fail_every=-2),
        dict(fail_at=[-1]),
        dict(fail_at=[1.5]),
        dict(fail_at="12"),
        dict(fail_at=5),
        dict(fail_bytes_over=-1),
        dict(error="segfault"),
        dict(refuse_after_us=-1),
        dict(refuse_after_us=10_000_001),
        dict(refuse_after_us=1.5),
    ],
)
def test_faulty_bad_plan_is_a_typed_error(kw):
    with pytest.raises(pk.errors.InvalidArgumentError):
        pk.upstream.Faulty(pk.upstream.Host(), **kw)


def test_faulty_refuse_after_us_delays_only_refused_calls():
    import time

    f = pk.upstream.Faulty(pk.upstream.Host(), fail_at={1}, refuse_after_us=200_000)
    assert f.refuse_after_us == 200_000 and "refuse_after_us=200000" in repr(f)
    t0 = time.monotonic()
    p = f.allocate(256)  # call 0: served at once
    served = time.monotonic() - t0
    with pytest.raises(pk.errors.OutOfMemoryError):
        f.allocate(256)  # call 1: refused after the delay
    refused = time.monotonic() - t0 - served
    f.deallocate(p, 256)
    assert refused >= 0.2 > served


def test_faulty_forwards_the_stream_interface():
    s = sim()
    f = pk.upstream.Faulty(s, fail_every=1, armed=False)
    assert f.streams_supported and f.kind == "device" and f.alignment == s.alignment and f.name == "Faulty(Simulated)"
    pool = pk.ArenaPool(f, initial_backing=64 * KiB)
    a, b = s.stream(), s.stream()
    s.enqueue(a, 100.0)
    p = pool.allocate(4 * KiB, a)
    pool.deallocate(p, a)
    q = pool.allocate(4 * KiB, b)  # a's work is not done: another block for b
    assert q != p
    assert pool.process_pending() == 0 and pool.stats()["pending_bytes"] >= 4 * KiB
    assert s.live_events >= 1  # the fence was recorded on the inner device
    s.advance(100.0)
    assert pool.process_pending() >= 4 * KiB
    pool.deallocate(q, b)
    pool.synchronize()  # forwarded: the inner clock jumps to the end of all work
    assert pool.stats()["pending_bytes"] == 0
    pool.validate()


# ------------------------------------------------------------------ refused allocations


def _warm(pool):
    """Some live, some free, some pending blocks, so a rollback has something to break."""
    live = [pool.allocate(n) for n in (1000, 5000, 70 * KiB)]
    for n in (3000, 40 * KiB):
        pool.deallocate(pool.allocate(n))
    return live


@pytest.mark.parametrize("kind", sorted(POOLS))
@pytest.mark.parametrize("inner", ["host", "simulated"])
def test_refused_allocation_upstream_error_rolls_back_everything(kind, inner):
    up = pk.upstream.Host() if inner == "host" else sim()
    f = pk.upstream.Faulty(up, fail_every=1, error="upstream", armed=False)
    pool = POOLS[kind](f)
    live = _warm(pool)
    before = books(pool)
    ups_before = up.counters()["allocations"]
    f.armed = True
    with pytest.raises(pk.errors.UpstreamError) as ei:
        pool.allocate(3 * MiB)  # nothing cached can serve it: the pool must ask the upstream
    assert ei.value.error_name == "POOLKEEPER_INJECTED_FAULT"
    assert f.injected == 1  # a failure that is not OOM is never retried
    assert books(pool) == before
    assert up.counters()["allocations"] == ups_before
    pool.validate()
    f.armed = False
    big = pool.allocate(3 * MiB)
    pool.deallocate(big)
    for p in live:
        pool.deallocate(p)
    pool.validate()
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0


# Exact recovery before an OutOfMemoryError: (injected calls, oom_retries delta).
OOM_POLICY = {
    "direct": (1, None),  # no recovery: one call, then the error
    "size_class": (2, 1),  # drain + release cached blocks, retry once
    "arena": (2, 1),  # oversize request: no smaller fallback; release free backings, retry once
    "arena_nocache": (2, 1),
}


@pytest.mark.parametrize("kind", sorted(POOLS))
def test_refused_allocation_oom_recovers_then_raises_typed(kind):
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, armed=False)
    pool = POOLS[kind](f)
    live = _warm(pool)
    before = books(pool)
    retries_before = pool.stats().get("oom_retries")
    f.armed = True
    with pytest.raises(pk.OutOfMemoryError) as ei:
        pool.allocate(3 * MiB)
    e = ei.value
    assert e.cause == "upstream" and "injected fault" in e.upstream_error
    assert e.requested == 3 * MiB
    injected, retries = OOM_POLICY[kind]
    assert f.injected == injected
    if retries is not None:
        assert pool.stats()["oom_retries"] == retries_before + retries
    after = books(pool)
    # Recovery may hand cached memory back upstream; live blocks are untouched.
    assert after["live_bytes"] == before["live_bytes"] and after["live_blocks"] == before["live_blocks"]
    assert after["reserved_bytes"] <= before["reserved_bytes"]
    if kind == "direct":
        assert after == before
    pool.validate()
    f.armed = False
    for p in live:
        pool.deallocate(p)
    big = pool.allocate(3 * MiB)
    pool.deallocate(big)
    pool.validate()
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0


def test_first_call_refused_direct_raises():
    f = pk.upstream.Faulty(sim(), fail_at={0})
    pool = pk.Direct(f)
    with pytest.raises(pk.OutOfMemoryError):
        pool.allocate(1000)
    assert books(pool)["reserved_bytes"] == 0
    p = pool.allocate(1000)  # call 1 passes
    pool.deallocate(p)
    pool.validate()


def test_first_call_refused_size_class_retries_once_and_serves():
    up = sim()
    f = pk.upstream.Faulty(up, fail_at={0})
    pool = pk.SizeClassPool(f)
    p = pool.allocate(1000)
    st = pool.stats()
    assert f.injected == 1 and st["oom_retries"] == 1 and st["upstream_allocations"] == 1
    assert up.counters()["allocations"] == 1
    pool.deallocate(p)
    pool.validate()


def test_first_call_refused_arena_falls_back_to_the_request_size():
    up = sim()
    f = pk.upstream.Faulty(up, fail_at={0})
    pool = pk.ArenaPool(f, initial_backing=64 * KiB, max_backing=1 * MiB)
    p = pool.allocate(1000)
    st = pool.stats()
    # The 64 KiB ramp backing was refused; the pool asked once more for just the request.
    assert f.injected == 1 and st["oom_retries"] == 0
    assert st["backings"] == 1 and st["reserved_bytes"] == 1024
    assert up.counters()["allocations"] == 1 and up.counters()["bytes_allocated"] == 1024
    pool.deallocate(p)
    pool.validate()


def test_arena_ramp_refused_above_a_size_serves_from_exact_backings():
    up = sim()
    f = pk.upstream.Faulty(up, fail_bytes_over=64 * KiB)
    pool = pk.ArenaPool(f, initial_backing=64 * KiB, max_backing=1 * MiB)
    a = pool.allocate(60 * KiB)  # first ramp backing: 64 KiB, allowed
    b = pool.allocate(60 * KiB)  # ramp asks 128 KiB: refused; falls back to 60 KiB
    st = pool.stats()
    assert st["reserved_bytes"] == 64 * KiB + 60 * KiB and st["backings"] == 2 and f.injected == 1
    with pytest.raises(pk.OutOfMemoryError) as ei:
        pool.allocate(100 * KiB)  # ramp and fallback both above the bound, twice (with recovery)
    assert ei.value.cause == "upstream"
    assert f.injected == 1 + 4
    assert pool.stats()["reserved_bytes"] == 124 * KiB
    pool.validate()
    pool.deallocate(a)
    pool.deallocate(b)
    pool.validate()


def test_size_class_oom_retry_releases_cached_blocks_first():
    up = sim()
    f = pk.upstream.Faulty(up, fail_bytes_over=512 * KiB, armed=False)
    pool = pk.SizeClassPool(f)
    for n in (1000, 10 * KiB, 100 * KiB):
        pool.deallocate(pool.allocate(n))
    assert pool.stats()["free_bytes"] > 0
    f.armed = True
    with pytest.raises(pk.OutOfMemoryError):
        pool.allocate(1 * MiB)
    st = pool.stats()
    assert st["free_bytes"] == 0 and st["reserved_bytes"] == 0 and st["oom_retries"] == 1
    assert up.counters()["outstanding_bytes"] == 0
    pool.validate()


# ------------------------------------------------------------------ refused frees: the policies


def test_direct_refused_free_leaves_the_block_live_and_raises():
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool = pk.Direct(f)
    p = pool.allocate(5000)
    before = books(pool)
    f.armed = True
    with pytest.raises(pk.errors.UpstreamError):
        pool.deallocate(p)
    assert books(pool) == before and pool.owns(p)
    pool.validate()
    f.armed = False
    pool.deallocate(p)  # the caller retries: now it goes
    assert books(pool)["reserved_bytes"] == 0 and up.counters()["outstanding_bytes"] == 0
    pool.validate()


@pytest.mark.parametrize("how", ["release_cached", "trim"])
def test_size_class_refused_free_is_counted_and_readopted(how):
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool = pk.SizeClassPool(f)
    pool.deallocate(pool.allocate(5000))
    size = pool.stats()["reserved_bytes"]
    f.armed = True
    getattr(pool, how)()  # never raises: the refusal is counted
    st = pool.stats()
    assert st["upstream_free_failures"] == 1 and f.injected_deallocations == 1
    assert st["reserved_bytes"] == size and st["free_bytes"] == size  # back on the books, cached
    assert up.counters()["outstanding_bytes"] == size
    pool.validate()
    f.armed = False
    assert getattr(pool, how)() == size  # retried: now it goes back
    assert pool.stats()["reserved_bytes"] == 0 and up.counters()["outstanding_bytes"] == 0
    pool.deallocate(pool.allocate(5000))  # keeps serving
    pool.validate()


def test_size_class_refused_free_at_close_is_counted_and_leaked():
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool = pk.SizeClassPool(f)
    pool.deallocate(pool.allocate(5000))
    size = pool.stats()["reserved_bytes"]
    f.armed = True
    pool.close()  # closes anyway: nothing is left to hold the block, so it can only be counted
    assert pool.stats()["upstream_free_failures"] == 1
    assert up.counters()["outstanding_bytes"] == size


def test_size_class_refused_free_over_the_cache_cap_is_counted_and_readopted():
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool = pk.SizeClassPool(f, max_cached_bytes=4 * KiB)
    p = pool.allocate(8 * KiB)
    f.armed = True
    pool.deallocate(p)  # beyond the cap: freed upstream, refused, counted, not raised
    st = pool.stats()
    assert st["upstream_free_failures"] == 1 and st["live_blocks"] == 0
    assert st["reserved_bytes"] == 8 * KiB and st["free_bytes"] == 8 * KiB  # re-adopted: retried later
    assert up.counters()["outstanding_bytes"] == 8 * KiB
    pool.validate()


def _arena_with_a_free_backing(f):
    pool = pk.ArenaPool(f, initial_backing=64 * KiB, max_backing=1 * MiB, thread_cache_bytes=0)
    keep = pool.allocate(60 * KiB)  # resident 64 KiB backing
    pool.deallocate(pool.allocate(100 * KiB))  # a 128 KiB ramp backing, now wholly free
    assert pool.stats()["backings"] == 2
    return pool, keep


@pytest.mark.parametrize("how", ["trim", "shrink_scan"])
def test_arena_refused_free_readopts_the_backing_and_retries_later(how):
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool, keep = _arena_with_a_free_backing(f)
    before = books(pool)
    f.armed = True
    if how == "trim":
        pool.trim()
    else:
        for _ in range(2):  # hysteresis: wholly free for two consecutive scans
            pool.shrink_scan()
    st = pool.stats()
    assert f.injected_deallocations == 1 and st["upstream_free_failures"] == 1
    assert books(pool) == before  # re-adopted: the bytes never left the books
    assert up.counters()["outstanding_bytes"] == before["reserved_bytes"]
    pool.validate()
    again = pool.allocate(100 * KiB)  # keeps serving from the re-adopted backing, no new upstream call
    assert pool.stats()["upstream_allocations"] == 2
    pool.deallocate(again)
    f.armed = False
    pool.trim()  # the retry succeeds
    st = pool.stats()
    assert st["backings"] == 1 and st["reserved_bytes"] == 64 * KiB
    assert up.counters()["outstanding_bytes"] == 64 * KiB
    pool.deallocate(keep)
    pool.validate()
    pool.close()
    assert up.counters()["outstanding_bytes"] == 0


def test_arena_refused_free_during_oom_recovery_is_readopted():
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool, keep = _arena_with_a_free_backing(f)
    f.armed = True
    with pytest.raises(pk.OutOfMemoryError):
        pool.allocate(900 * KiB)  # grow refused; recovery's free of the spare backing refused too
    st = pool.stats()
    assert st["upstream_free_failures"] == 1 and st["backings"] == 2 and st["live_blocks"] == 1
    pool.validate()
    f.armed = False
    p = pool.allocate(900 * KiB)
    pool.deallocate(p)
    pool.deallocate(keep)
    pool.validate()


def test_arena_refused_free_at_close_is_counted_and_leaked():
    up = sim()
    f = pk.upstream.Faulty(up, fail_every=1, fail_frees=True, armed=False)
    pool, keep = _arena_with_a_free_backing(f)
    pool.deallocate(keep)
    reserved = pool.stats()["reserved_bytes"]
    f.armed = True
    pool.close()  # closes anyway: the books are gone, so a refused backing can only be counted
    assert pool.closed
    assert pool.stats()["upstream_free_failures"] == 2
    assert up.counters()["outstanding_bytes"] == reserved


def test_regression_backing_counters_after_refused_free():
    f = pk.upstream.Faulty(sim(), fail_every=1, fail_frees=True, armed=False)
    pool, keep = _arena_with_a_free_backing(f)
    st = pool.stats()
    assert st["backings"] == st["backings_created"] - st["backings_released"] == 2
    f.armed = True
    pool.trim()  # refused: the backing is re-adopted, so nothing was created or released
    st = pool.stats()
    assert st["backings"] == 2
    assert (st["backings_created"], st["backings_released"]) == (2, 0)


# ------------------------------------------------------------------ the randomized campaign


@dataclass
class Campaign:
    """Figures of one seeded fault run."""

    pool: str
    error: str
    ops: int = 0
    faults_injected: int = 0
    ops_failed: int = 0
    errors: dict = field(default_factory=dict)
    validations: int = 0
    upstream_free_failures: int = 0
    leaked_bytes: int = 0


# Share of watched calls refused: an arena makes few upstream calls (it grows in backings), so it
# needs a denser plan to meet as many faults.
RATES = {"direct": 0.08, "size_class": 0.15, "arena": 0.5, "arena_nocache": 0.5}


def run_campaign(kind: str, error: str, ops: int, seed: int, rate: float | None = None) -> Campaign:
    """Random allocate/free/stream/trim operations over Faulty(Simulated) with about `rate` of
    the watched calls (allocations and frees) refused. Every operation must either succeed or
    raise OutOfMemoryError/UpstreamError, and validate() must pass after every operation; at the
    end, with faults off, everything is freed and the pool closes."""
    rng = random.Random(seed)
    rate = RATES[kind] if rate is None else rate
    up = sim()
    plan = {i for i in range(ops * 4) if rng.random() < rate}
    f = pk.upstream.Faulty(up, fail_at=plan, fail_frees=True, error=error)
    pool = POOLS[kind](f)
    streams = [None, up.stream(), up.stream(), up.stream()]
    live: dict[int, object] = {}
    out = Campaign(kind, error)
    for _ in range(ops):
        r = rng.random()
        out.ops += 1
        try:
            if r < 0.45 or not live:
                n = int(2 ** rng.uniform(0, 21)) + 1  # 2 B .. 2 MiB, log-uniform
                s = rng.choice(streams)
                live[pool.allocate(n, s)] = s
            elif r < 0.80:
                p = rng.choice(list(live))
                s = live[p] if rng.random() < 0.7 else rng.choice(streams)
                try:
                    pool.deallocate(p, s)
                except pk.errors.UpstreamError:
                    assert kind == "direct" and pool.owns(p)  # Direct: the block stays live
                    raise
                del live[p]
            elif r < 0.85:
                p = rng.choice(list(live))
                s = rng.choice(streams[1:])
                pool.record_stream(p, s)
            elif r < 0.90:
                s = rng.choice(streams[1:])
                up.enqueue(s, rng.uniform(0, 50))
                up.advance(rng.uniform(0, 40))
                pool.process_pending()
            elif r < 0.95:
                pool.trim()
            elif r < 0.97:
                pool.synchronize()
            elif kind.startswith("arena"):
                pool.shrink_scan()
            else:
                pool.process_pending()
        except (pk.OutOfMemoryError, pk.errors.UpstreamError) as e:
            out.ops_failed += 1
            out.errors[type(e).__name__] = out.errors.get(type(e).__name__, 0) + 1
        pool.validate()
        out.validations += 1
        assert accounting_holds(pool)
        assert pool.stats()["live_blocks"] == len(live)
    out.faults_injected = f.injected
    f.armed = False
    for p in list(live):
        pool.deallocate(p)
    pool.synchronize()
    pool.trim()
    pool.validate()
    out.validations += 1
    out.upstream_free_failures = pool.stats().get("upstream_free_failures", 0)
    pool.close()
    out.leaked_bytes = up.counters()["outstanding_bytes"]
    # Every pool re-adopts (or keeps live) what the upstream refused to take back, and the final
    # unarmed trim/close returns it: nothing leaks.
    assert out.leaked_bytes == 0
    return out


@pytest.mark.parametrize("error", ["oom", "upstream"])
@pytest.mark.parametrize("kind", sorted(POOLS))
def test_random_fault_campaign_keeps_invariants(kind, error):
    c = run_campaign(kind, error, ops=600, seed=20240 + len(kind) * 7 + (error == "oom"))
    assert c.faults_injected >= 5  # the run did meet faults ...
    assert c.ops_failed > 0  # ... and some surfaced as typed errors
