"""The lease state machine behind StagingBuffer (poolkeeper.staging._lease), on the Host upstream.

Every legal path through the states, and every illegal transition: each raises its typed error,
leaves the lease where it was and the pool's accounting unchanged (``stats()`` before == after,
``validate()`` passes). The tests named after a bug fail on the code before the lease existed.
"""
from __future__ import annotations

import gc
import threading

import pytest

import poolkeeper as pk
from poolkeeper.errors import UpstreamError, WitnessError
from poolkeeper.staging import (
    BufferInUseError,
    BufferStateError,
    PinnedStagingPool,
    copy,
    copy_async,
)
from poolkeeper.staging import _engine
from staging_helpers import install_gate

N = 4096


@pytest.fixture
def pool():
    """A Host-upstream pool, validated (books and every lease) after the test."""
    p = PinnedStagingPool(pk.upstream.Host())
    yield p
    gc.collect()
    p.validate()
    p.close()


def lease_state(buf) -> str:
    return buf._lease.state


def consistent(pool) -> dict:
    """Validate the pool (and its leases) and check the upstream agrees; return the stats."""
    pool.validate()
    s = pool.stats()
    assert pool.upstream.counters()["outstanding_bytes"] == s["retained_bytes"] + s["live_bytes"] + s["refused_bytes"]
    return s


def refused(pool, error, call, match=None):
    """``call()`` raises ``error`` and changes no accounting."""
    before = consistent(pool)
    with pytest.raises(error, match=match):
        call()
    assert consistent(pool) == before


# -- legal paths -----------------------------------------------------------------------------------
def test_live_copying_live_retired(pool, monkeypatch):
    gate = install_gate(monkeypatch)
    b = pool.acquire(N)
    assert lease_state(b) == "live" and b.state == "live"
    pending = copy_async(bytearray(N), b)
    assert gate.entered.wait(20)
    assert lease_state(b) == "copying" and b.state == "live"  # users see a live lease
    consistent(pool)
    gate.open()
    w = pending.wait()
    assert b.copies_in_flight == 0 and lease_state(b) == "live"
    b.retire(w)
    assert lease_state(b) == "retired" and b.state == "retired"
    s = consistent(pool)
    assert s["retires"] == 1 and s["retained_buffers"] == 1 and s["live_buffers"] == 0


def test_blocking_copy_leaves_the_lease_live(pool):
    b = pool.acquire(N)
    w = copy(bytearray(N), b)
    assert lease_state(b) == "live"
    b.fill(b"again")  # writable again: nothing reads it
    b.retire(w)
    assert consistent(pool)["retires"] == 1


def test_live_closed(pool):
    b = pool.acquire(N)
    b.close()
    assert lease_state(b) == "closed"
    b.close()  # idempotent
    s = consistent(pool)
    assert s["closed_without_retire"] == 1 and s["live_buffers"] == 0


def test_copying_closed_waits_for_the_copy(pool, monkeypatch):
    gate = install_gate(monkeypatch)
    b = pool.acquire(N)
    copy_async(bytearray(N), b)
    assert gate.entered.wait(20)
    closer = threading.Thread(target=b.close)
    closer.start()
    closer.join(0.05)
    assert pool.stats()["frees"] == 0  # never freed under the copy
    gate.open()
    closer.join(20)
    assert not closer.is_alive() and lease_state(b) == "closed"
    assert consistent(pool)["closed_without_retire"] == 1


def test_live_dropped(pool):
    b = pool.acquire(N)
    lease = b._lease
    del b
    gc.collect()
    assert lease.state == "dropped"
    assert consistent(pool)["dropped_without_retire"] == 1


def test_closing_closed_when_the_buffer_is_collected(pool):
    b = pool.acquire(N)
    lease = b._lease
    holder = [b.view()]
    holder.append(holder)  # a cycle: the view goes only with a collection
    b.close()
    assert lease.state == "closing" and b.state == "closed"
    del b, holder
    gc.collect()
    assert lease.state == "closed"
    assert consistent(pool)["closed_without_retire"] == 1


def test_view_and_buffer_collected_in_one_cycle_release_cleanly(pool):
    # Bug: when a view and its buffer died in one garbage cycle, the collector could clear the
    # buffer's slots before the view released its export, and the release raised AttributeError
    # (reported as an unraisable exception) on whatever thread the collector ran.
    import sys

    errors: list = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: errors.append(repr(u.exc_value))
    try:
        for close in (False, True):
            b = pool.acquire(N)
            holder = [b.view()]
            holder.append(holder)
            if close:
                b.close()
            del b, holder
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert errors == []
    s = pool.stats()
    assert s["dropped_without_retire"] == 1 and s["closed_without_retire"] == 1 and s["live_buffers"] == 0
    consistent(pool)


def test_close_with_a_view_frees_when_the_last_view_goes_even_while_the_buffer_lives(pool):
    # Bug: docs/staging.md promised "close() with a live view defers the free until the last view
    # is released", but the memory was freed only when the StagingBuffer object itself was
    # collected: a buffer kept in a variable held its memory (and a live_buffers slot) forever.
    b = pool.acquire(N)
    v1, v2 = b.view(), b.numpy()
    b.close()
    assert b.state == "closed" and pool.stats()["frees"] == 0
    del v1
    assert pool.stats()["frees"] == 0  # one view still alive
    del v2
    s = pool.stats()
    assert s["frees"] == 1 and s["closed_without_retire"] == 1 and s["live_buffers"] == 0
    assert lease_state(b) == "closed" and b.state == "closed"
    consistent(pool)
    del b
    gc.collect()
    assert consistent(pool)["closed_without_retire"] == 1  # counted once


def test_closing_with_a_copy_in_flight_frees_only_when_collected(pool, monkeypatch):
    gate = install_gate(monkeypatch)
    b = pool.acquire(N)
    v = b.view()
    pending = copy_async(bytearray(N), b)
    assert gate.entered.wait(20)
    b.close()
    del v  # last view gone, but a copy still reads the memory: not freed now
    assert lease_state(b) == "closing" and pool.stats()["frees"] == 0
    gate.open()
    pending.wait()
    del b, pending
    gc.collect()
    assert consistent(pool)["closed_without_retire"] == 1


# -- illegal transitions ---------------------------------------------------------------------------
def test_retire_twice(pool):
    b = pool.acquire(N)
    w1, w2 = copy(bytearray(N), b), copy(bytearray(N), b)
    b.retire(w1)
    refused(pool, WitnessError, lambda: b.retire(w1), "already consumed")
    # The lease ended: its other witness is void, refused by state.
    refused(pool, BufferStateError, lambda: b.retire(w2), "already retired")
    assert not w2.consumed and lease_state(b) == "retired"


def test_write_and_retire_while_copying(pool, monkeypatch):
    gate = install_gate(monkeypatch)
    b = pool.acquire(N)
    w1 = copy(bytearray(N), b)
    pending = copy_async(bytearray(N), b)
    assert gate.entered.wait(20)
    refused(pool, BufferStateError, lambda: b.fill(b"x"), "in flight")
    refused(pool, BufferStateError, b.view, "in flight")
    refused(pool, WitnessError, lambda: b.retire(w1), "still in flight")
    assert lease_state(b) == "copying" and not w1.consumed
    gate.open()
    pending.wait()
    b.retire(w1)


def test_close_then_retire_copy_or_write(pool):
    b = pool.acquire(N)
    w = copy(bytearray(N), b)
    b.close()
    refused(pool, BufferStateError, lambda: b.retire(w), "already closed")
    refused(pool, BufferStateError, lambda: copy(bytearray(N), b), "closed")
    refused(pool, BufferStateError, lambda: b.fill(b"x"), "closed")
    assert not w.consumed and lease_state(b) == "closed"


def test_closing_refuses_everything_but_close(pool):
    b = pool.acquire(N)
    w = copy(bytearray(N), b)
    v = b.view()
    b.close()
    refused(pool, BufferStateError, lambda: b.retire(w), "already closed")
    refused(pool, BufferStateError, lambda: copy_async(bytearray(N), b), "closed")
    refused(pool, BufferStateError, b.view, "closed")
    b.close()
    assert lease_state(b) == "closing"
    del v
    assert lease_state(b) == "closed"


def test_witness_from_another_lease(pool):
    a, b = pool.acquire(N), pool.acquire(N)
    wa = copy(bytearray(N), a)
    refused(pool, WitnessError, lambda: b.retire(wa), "not this buffer")
    assert lease_state(b) == "live" and not wa.consumed
    a.retire(wa)
    again = pool.acquire(N)  # a's memory, a new lease
    assert again.ptr == a.ptr
    refused(pool, WitnessError, lambda: again.retire(wa), "already consumed")
    again.retire(copy(bytearray(N), again))
    b.retire(copy(bytearray(N), b))


def test_retire_with_a_view_alive(pool):
    b = pool.acquire(N)
    w = copy(bytearray(N), b)
    v = b.view()
    refused(pool, BufferInUseError, lambda: b.retire(w), "still alive")
    assert lease_state(b) == "live" and not w.consumed
    del v
    b.retire(w)


def test_mint_refuses_a_job_the_lease_did_not_issue(pool):
    b = pool.acquire(N)

    class Job:  # a completed job this lease never issued
        seq, nbytes, error = 1, N, None

        def query(self):
            return True

    refused(pool, WitnessError, lambda: b._lease.mint(Job()), "did not issue")
    b.close()


# -- one witness per copy --------------------------------------------------------------------------
def test_concurrent_waits_on_one_pending_copy_return_one_witness(pool, monkeypatch):
    # Bug: PendingCopy.wait() from two threads at once minted two witnesses for one copy, each with
    # a registered token (its docstring promises "the same one on every call").
    barrier = threading.Barrier(2, timeout=20)
    orig = _engine._HostJob.wait_complete

    def wait_complete(job):
        barrier.wait()  # both threads have seen "no witness yet"
        return orig(job)

    monkeypatch.setattr(_engine._HostJob, "wait_complete", wait_complete)
    b = pool.acquire(N)
    pending = copy_async(bytearray(N), b)
    got: list = []
    ts = [threading.Thread(target=lambda: got.append(pending.wait())) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert len(got) == 2 and got[0] is got[1]
    b.retire(got[0])


def test_engine_witness_survives_a_poll_of_copies_in_flight(pool):
    # Bug: polling copies_in_flight dropped completed jobs from the buffer's job list, and the
    # engine's mint looked for its job there: a poll between the engine finishing and the mint
    # made a good engine witness fail as "a copy the engine did not run".
    b = pool.acquire(100)

    class Idle:
        def wait(self, t):
            return 0

    run = _engine._EngineRun(Idle())
    jobs: list = []
    jobs.append(b._begin_copy(lambda seq: _engine._EngineJob(seq, run, 0, jobs)))
    assert b.copies_in_flight == 1
    run.unstarted()
    assert b.copies_in_flight == 0  # the poll that dropped the job from the buffer's list
    w = _engine._mint_engine_observed(b, jobs[0])
    assert _engine._mint_engine_observed(b, jobs[0]) is w  # one witness per copy
    other = pool.acquire(100)
    with pytest.raises(UpstreamError, match="did not run"):
        _engine._mint_engine_observed(other, jobs[0])
    b.retire(w)
    other.close()
    consistent(pool)


# -- validate ----------------------------------------------------------------------------------------
def test_validate_catches_a_broken_lease(pool):
    b = pool.acquire(N)
    pool.validate()
    b.retire(copy(bytearray(N), b))
    b._lease._views.add(7)  # a view counted on a lease that ended
    with pytest.raises(AssertionError, match="lease with 1 views"):
        b._lease.validate()
    b._lease._views.clear()
    pool.validate()


def test_validate_catches_broken_pool_books(pool):
    b = pool.acquire(N)
    b.retire(copy(bytearray(N), b))
    pool._retained_bytes += 1
    with pytest.raises(AssertionError, match="retained_bytes"):
        pool.validate()
    pool._retained_bytes -= 1
    pool.validate()
