"""The native upload engine (poolkeeper._core.UploadEngine) on its Host backend, through
``Uploader(engine="native")`` and directly: bytes arrive intact, the chunk schedule, progress, the
steady state, persistent threads, errors that leave the pool consistent, concurrent engines."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import os
import threading
import time

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError, PoolkeeperError, UpstreamError, WitnessError
from poolkeeper.staging import PinnedStagingPool, Uploader, _engine

CHUNK = 1 << 20  # large enough for the ramp (chunk/8 >= 128 KiB, floor 256 KiB) to show
RAMP_MIN = 256 * 1024


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def schedule(n: int, chunk: int, ramp: bool, tail_workers: int = 0) -> list:
    """The engine's chunk sizes: a head ramp (chunk/8, /4, /2), full chunks, and with
    ``tail_workers`` a tail of pieces halving toward the end (chunk/2 x workers, ..., 256 KiB x
    workers) where the upload is long enough for it."""
    head, total = [], 0
    if ramp:
        size = max(min(chunk, RAMP_MIN), chunk // 8)
        while size < chunk and total < n:
            head.append(size)
            total += size
            size = min(2 * size, chunk)
    tail: list = []
    if tail_workers and chunk // 2 >= RAMP_MIN:
        t, size = [], RAMP_MIN
        while size <= chunk // 2:
            t += [size] * tail_workers
            size *= 2
        if total + sum(t) + chunk <= n:
            tail = t[::-1]
    body = n - min(n, total + sum(tail))
    sizes = head + [chunk] * (body // chunk) + ([body % chunk] if body % chunk else []) + tail
    out, off = [], 0
    for sz in sizes:  # the head may run past a short upload: clipped, as the engine clips
        if off >= n:
            break
        out.append(min(sz, n - off))
        off += out[-1]
    return out


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def os_threads_settle(want: int, timeout: float = 2.0) -> int:
    """os_threads(), polled until it is `want` or `timeout` passes. A joined thread can stay listed
    in /proc/self/task for a moment after pthread_join returns (the kernel wakes the joiner before
    it releases the task): a single read right after close() failed about one run in six."""
    deadline = time.monotonic() + timeout
    while (n := os_threads()) != want and time.monotonic() < deadline:
        time.sleep(0.001)
    return n


def os_threads_stable(quiet: float = 0.05, timeout: float = 2.0) -> int:
    """os_threads() once it has stayed the same for `quiet` seconds: a thread an earlier test joined
    can still be listed when this test takes its baseline (the same lag os_threads_settle waits out
    after close()); a baseline read during it was one too high, and the count after starting the
    engine one short (CI, under load)."""
    deadline = time.monotonic() + timeout
    n, since = os_threads(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.002)
        m = os_threads()
        if m != n:
            n, since = m, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return n


@pytest.fixture
def host():
    return pk.upstream.Host()


def native(host, **kw) -> Uploader:
    kw.setdefault("chunk_bytes", CHUNK)
    return Uploader(PinnedStagingPool(host, max_buffers=32), engine="native", **kw)


def assert_pool_consistent(up: Uploader, host) -> dict:
    s = up.pool.stats()
    assert s["live_buffers"] == 0
    assert host.counters()["outstanding_bytes"] == s["retained_bytes"]
    return s


# ---- bytes arrive intact ----------------------------------------------------------------------------

SIZES = [0, 1, 4095, CHUNK // 8 - 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 12345, 9 * CHUNK + 7]


@pytest.mark.parametrize("n", SIZES + [40 * CHUNK + 7])
@pytest.mark.parametrize("ramp", [True, False])
@pytest.mark.parametrize("tail", [True, False])
def test_bytes_arrive_intact_with_the_planned_chunks(host, n, ramp, tail):
    data = payload(n, seed=n)
    dst = bytearray(n)
    with native(host, workers=3, depth=2, ramp=ramp, tail_ramp=tail) as up:
        report = up.upload(data, dst)
    assert dst == data
    assert report.engine == "native" and report.nbytes == n
    assert report.chunks == len(schedule(n, CHUNK, ramp, 3 if tail else 0))


@pytest.mark.parametrize("workers,depth", [(1, 2), (2, 1), (1, 5), (3, 3), (7, 1), (16, 2)])
def test_buffer_counts_and_more_workers_than_chunks(host, workers, depth):
    n = 2 * CHUNK + 99  # with the ramp: 5 chunks, fewer than some worker counts
    data = payload(n, seed=workers * 10 + depth)
    dst = np.zeros(n, np.uint8)
    with native(host, workers=workers, depth=depth) as up:
        report = up.upload(np.frombuffer(data, np.uint8), dst.ctypes.data)
        again = up.upload(data, dst)
    assert dst.tobytes() == data
    assert report.workers == min(workers, workers * depth)
    assert again.pinned_alloc_calls == 0 and again.reuses == workers * depth


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy2d"])
def test_memory_source_kinds(host, kind):
    data = payload(2 * CHUNK + 5, seed=5)
    src = {
        "bytes": lambda: data,
        "bytearray": lambda: bytearray(data),
        "memoryview": lambda: memoryview(data),
        "numpy2d": lambda: np.frombuffer(data[:-1], np.uint8).reshape(2, -1).copy(),
    }[kind]()
    want = bytes(memoryview(src).cast("B"))
    dst = bytearray(len(want))
    with native(host, workers=2) as up:
        up.upload(src, dst)
    assert dst == want


@pytest.mark.parametrize("nt", [False, True])
def test_nt_fill_delivers_the_same_bytes(host, nt):
    n = 5 * CHUNK + 333
    data = payload(n, seed=11)
    dst = bytearray(n)
    with native(host, workers=3, nt_fill=nt) as up:
        report = up.upload(memoryview(data)[7:], dst, nbytes=n - 7)  # an unaligned source
    assert dst[: n - 7] == data[7:]
    assert report.phases["nt_fill"] == (nt and _core.stream_copy_isa() != "")


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 127, 128, 129, 4096 + 77, 100003])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (0, 3), (5, 0), (9, 13)])
def test_stream_copy_matches_memmove(n, dst_off, src_off):
    src = np.frombuffer(payload(n + 64, seed=n), np.uint8)
    dst = np.zeros(n + 64, np.uint8)
    _core.stream_copy(dst.ctypes.data + dst_off, src.ctypes.data + src_off, n)
    assert dst[dst_off : dst_off + n].tobytes() == src[src_off : src_off + n].tobytes()
    assert not dst[:dst_off].any() and not dst[dst_off + n :].any()  # nothing outside the range


# ---- progress, steady state, engines and threads -----------------------------------------------------

def test_progress_is_monotone_and_ends_at_the_total(host):
    n = 12 * CHUNK + 1
    calls: list = []
    with native(host, workers=2) as up:
        up.upload(payload(n), bytearray(n), progress=lambda d, t: calls.append((d, t)))
    dones = [d for d, _ in calls]
    assert calls and all(t == n for _, t in calls)
    assert dones == sorted(dones) and len(set(dones)) == len(dones) and dones[-1] == n


def test_steady_state_makes_no_pinned_allocations(host):
    n = 10 * CHUNK + 3
    with native(host, workers=3, depth=2) as up:
        first = up.upload(payload(n), bytearray(n))
        assert first.pinned_alloc_calls == 6
        for seed in range(5):
            data = payload(n, seed)
            dst = bytearray(n)
            again = up.upload(data, dst)
            assert dst == data and again.pinned_alloc_calls == 0 and again.reuses == 6
        s = assert_pool_consistent(up, host)
    assert s["pinned_alloc_calls"] == 6 and s["retained_buffers"] == 6 and s["frees"] == 0
    assert s["acquires"] == 6 + 6 * 6 and s["retires"] == s["acquires"]  # warm-up + 6 uploads
    assert host.counters()["allocations"] == 6


def test_engine_threads_are_persistent_across_50_uploads_and_joined_at_close(host):
    n = 2 * CHUNK + 1
    data = payload(n, seed=3)
    base = os_threads_stable()
    up = native(host, workers=4, depth=2)
    up.upload(data, bytearray(n))
    started = os_threads()
    assert started == base + 4 + 1  # 4 workers + the host copy thread, nothing else
    eng = up._native
    for _ in range(50):
        dst = bytearray(n)
        up.upload(data, dst)
        assert dst == data
    assert os_threads() == started and eng.threads_created == 5 and eng.uploads == 51
    up.close()
    assert os_threads_settle(base) == base and eng.closed


def test_auto_picks_native_for_memory_and_python_for_files(host, tmp_path):
    data = payload(3 * CHUNK + 1, seed=4)
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    with Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2) as up:
        assert up.engine == "auto"
        assert up.upload(data, bytearray(len(data))).engine == "native"
        dst = bytearray(len(data))
        assert up.upload(p, dst).engine == "python" and dst == data
        dst = bytearray(len(data))
        assert up.upload(io.BytesIO(data), dst).engine == "python" and dst == data


def test_native_refuses_sources_without_an_address(host, tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(b"x" * 100)
    with native(host, workers=2) as up:
        with pytest.raises(InvalidArgumentError, match="raw address"):
            up.upload(p, bytearray(100))
        assert up.pool.stats()["acquires"] == 0
    with pytest.raises(InvalidArgumentError, match="engine"):
        Uploader(PinnedStagingPool(host), engine="fast")


def test_concurrent_uploads_from_two_threads_with_two_engines(host):
    n = 6 * CHUNK + 17
    pool = PinnedStagingPool(host, max_buffers=16)
    ups = [Uploader(pool, chunk_bytes=CHUNK, workers=2, depth=2, engine="native") for _ in range(2)]
    errors: list = []
    results: dict = {}

    def worker(k: int) -> None:
        try:
            for rep in range(10):
                data = payload(n, seed=100 * k + rep)
                dst = bytearray(n)
                ups[k].upload(data, dst)
                results.setdefault(k, []).append(dst == data)
        except BaseException as e:  # reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and results == {0: [True] * 10, 1: [True] * 10}
    assert ups[0]._native is not ups[1]._native
    for up in ups:
        up.close()
    s = pool.stats()
    # Each uploader keeps 4 buffers; one that finishes first may hand its 4 to the other, so the
    # pool pins between 4 and 8 -- never one per upload (20 uploads of 7 chunks each).
    assert s["live_buffers"] == 0 and 4 <= s["pinned_alloc_calls"] <= 8
    assert host.counters()["outstanding_bytes"] == s["retained_bytes"]


def test_one_uploader_shared_by_two_threads_serializes(host):
    n = 4 * CHUNK + 1
    with native(host, workers=2) as up:
        out: list = []

        def go(seed: int) -> None:
            data = payload(n, seed)
            dst = bytearray(n)
            up.upload(data, dst)
            out.append(dst == data)

        ts = [threading.Thread(target=go, args=(s,)) for s in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert out == [True] * 4
        assert_pool_consistent(up, host)


# ---- errors ------------------------------------------------------------------------------------------

def retire_log(monkeypatch, up: Uploader) -> list:
    """Record, at each retire, whether the engine had finished (every copy complete)."""
    log: list = []
    pool = up.pool
    orig = pool._take_back

    def take_back(ptr, cap):
        log.append(up._native.finished)
        return orig(ptr, cap)

    monkeypatch.setattr(pool, "_take_back", take_back)
    return log


@pytest.mark.parametrize("hook", ["fail_fill_at", "fail_copy_at"])
@pytest.mark.parametrize("k", [0, 3, 9])
def test_a_failing_fill_or_copy_raises_a_typed_error_and_leaves_the_pool_consistent(host, monkeypatch, hook, k):
    n = 8 * CHUNK + 5  # 10 chunks with the ramp: k = 9 is the last
    data = payload(n, seed=k)
    with native(host, workers=3, depth=2) as up:
        up.warm_up()
        up.upload(data, bytearray(n))
        total = up._native.result()["chunks"]  # the schedule's chunk count for n
        log = retire_log(monkeypatch, up)
        up._faults = {hook: k}
        with pytest.raises(UpstreamError, match=f"injected fault: {'fill' if hook == 'fail_fill_at' else 'copy'} of chunk {k}"):
            up.upload(data, bytearray(n))
        assert log == [True] * 6  # every buffer retired, each only after the engine finished
        res = up._native.result()
        # The failed chunk is never counted. How many the other workers finish before they see the
        # failure depends on scheduling (a bound of k + workers x depth failed under CI load).
        assert res["failed"] and res["lost"] == [] and res["chunks"] <= total - 1
        s = assert_pool_consistent(up, host)
        assert s["retained_buffers"] == 6 and s["leaked_unconfirmed"] == 0 and s["pinned_alloc_calls"] == 6
        up._faults = {}
        dst = bytearray(n)
        again = up.upload(data, dst)  # the engine and the pool still work
        assert dst == data and again.pinned_alloc_calls == 0


@pytest.mark.parametrize("hook", ["fail_fill_at", "fail_copy_at"])
@pytest.mark.parametrize("k", [0, 3, 9])
def test_one_worker_stops_at_the_chunk_that_failed(host, hook, k):
    # One worker takes the chunks in order, so every chunk before k was enqueued and none after.
    n = 8 * CHUNK + 5
    with native(host, workers=1, depth=2) as up:
        up.warm_up()
        up._faults = {hook: k}
        with pytest.raises(UpstreamError, match=f"of chunk {k}"):
            up.upload(payload(n, seed=k), bytearray(n))
        res = up._native.result()
        assert res["failed"] and res["lost"] == [] and res["chunks"] == k
        assert_pool_consistent(up, host)


def test_an_untrackable_copy_leaks_its_buffer_instead_of_recycling_it(host):
    n = 6 * CHUNK
    with native(host, workers=2, depth=2) as up:
        up.warm_up()
        up._faults = {"fail_record_at": 2}
        with pytest.raises(UpstreamError, match="completion record of chunk 2"):
            up.upload(payload(n), bytearray(n))
        res = up._native.result()
        assert len(res["lost"]) == 1
        s = up.pool.stats()
        assert s["leaked_unconfirmed"] == 1 and s["live_buffers"] == 0 and s["retained_buffers"] == 3
        # the leaked buffer is still allocated upstream and counted nowhere else
        assert host.counters()["outstanding_bytes"] == s["retained_bytes"] + up.pool.capacity_for(CHUNK)
        up._faults = {}
        data = payload(n, seed=1)
        dst = bytearray(n)
        again = up.upload(data, dst)
        assert dst == data and again.pinned_alloc_calls == 1  # one buffer to replace the leaked one


def test_a_raising_progress_callback_stops_the_upload_cleanly(host, monkeypatch):
    n = 20 * CHUNK
    with native(host, workers=2, depth=2) as up:
        up.warm_up()
        log = retire_log(monkeypatch, up)

        def progress(done, total):
            raise KeyError("stop")

        with pytest.raises(KeyError):
            up.upload(payload(n), bytearray(n), progress=progress)
        assert log == [True] * 4
        assert_pool_consistent(up, host)


def test_buffers_are_in_flight_for_the_whole_upload(host, monkeypatch):
    """Right after the engine starts, every staging buffer is leased and carries an in-flight copy:
    nobody can view, fill or retire it until the engine has finished."""
    n = 30 * CHUNK
    seen: list = []
    with native(host, workers=2, depth=2) as up:
        up.warm_up()
        real = up._native_engine()

        class Spy:
            def __getattr__(self, name):
                return getattr(real, name)

            def start(self, *a, **k):
                bufs = [b for b in live if b.copies_in_flight]
                real.start(*a, **k)
                s = up.pool.stats()
                seen.append((s["live_buffers"], s["retained_buffers"], len(bufs)))
                for b in live:
                    with pytest.raises(pk.staging.BufferStateError):
                        b.view()

        live: list = []
        orig_acquire = up.pool.acquire

        def acquire(nbytes):
            b = orig_acquire(nbytes)
            live.append(b)
            return b

        monkeypatch.setattr(up.pool, "acquire", acquire)
        monkeypatch.setattr(up, "_native_engine", lambda: Spy())
        data = payload(n)
        dst = bytearray(n)
        up.upload(data, dst)
        assert dst == data
    assert seen == [(4, 0, 4)]
    assert all(b.state == "retired" for b in live)


def test_engine_witness_needs_a_finished_engine_run(host):
    pool = PinnedStagingPool(host)
    b = pool.acquire(100)

    class Busy:  # an engine that never finishes
        def wait(self, t):
            return 0

    run = _engine._EngineRun(Busy())
    jobs: list = []
    jobs.append(b._begin_copy(lambda seq: _engine._EngineJob(seq, run, 0, jobs)))
    with pytest.raises(WitnessError, match="not completed"):
        _engine._mint_engine_observed(b, jobs[0])
    other = pool.acquire(100)
    with pytest.raises(UpstreamError, match="did not run"):
        _engine._mint_engine_observed(other, jobs[0])
    run.unstarted()
    w = _engine._mint_engine_observed(b, jobs[0])
    with pytest.raises(WitnessError):
        other.retire(w)  # bound to b
    b.retire(w)
    with pytest.raises(WitnessError):
        b.retire(w)  # single use
    other.retire(pk.staging.copy(0, other, 0))


# ---- the engine directly -----------------------------------------------------------------------------

def test_engine_rejects_bad_requests_and_a_second_upload_while_busy(host):
    eng = _core.UploadEngine(2)
    src = np.frombuffer(payload(8 * CHUNK), np.uint8)
    dst = np.zeros_like(src)
    bufs = [np.zeros(CHUNK, np.uint8) for _ in range(4)]
    spec = [(b.ctypes.data, b.nbytes) for b in bufs]
    with pytest.raises(InvalidArgumentError, match="at least 2"):
        eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, spec[:1], CHUNK)
    with pytest.raises(InvalidArgumentError, match="holds"):
        eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, spec, 2 * CHUNK)
    with pytest.raises(InvalidArgumentError, match="backend"):
        eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, spec, CHUNK, backend="dma")
    with pytest.raises(InvalidArgumentError, match="no upload"):
        eng.result()
    eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, spec, CHUNK)
    try:
        eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, spec, CHUNK)
        busy = False
    except InvalidArgumentError as e:
        busy = "busy" in str(e)
    eng.wait(-1)
    # either the second start found the first running (refused), or the first had already
    # finished and the second one ran: both leave dst intact
    if not busy:
        eng.wait(-1)
    res = eng.result()
    assert not res["failed"] and res["bytes"] == src.nbytes and sum(res["buffer_bytes"]) == src.nbytes
    assert np.array_equal(dst, src)
    eng.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, spec, CHUNK)
    eng.close()  # idempotent


def test_engine_counters_add_up(host):
    n = 10 * CHUNK + 1
    src = np.frombuffer(payload(n), np.uint8)
    dst = np.zeros_like(src)
    bufs = [np.zeros(CHUNK, np.uint8) for _ in range(6)]
    eng = _core.UploadEngine(3)
    eng.start(src.ctypes.data, n, dst.ctypes.data, [(b.ctypes.data, b.nbytes) for b in bufs], CHUNK, ramp=False,
                  tail_ramp=False)
    assert eng.wait(-1) == n
    r = eng.result()
    eng.close()
    assert np.array_equal(dst, src)
    assert r["chunks"] == 11 and r["workers"] == 3 and r["lost"] == []
    assert r["fill_ns"] > 0 and r["wall_ns"] >= r["first_enqueue_ns"] > 0
    assert len(r["buffer_bytes"]) == 6 and sum(r["buffer_bytes"]) == n


def test_close_while_running_cancels_and_waits(host):
    n = 64 * CHUNK
    src = np.frombuffer(payload(n), np.uint8)
    dst = np.zeros_like(src)
    bufs = [np.zeros(CHUNK, np.uint8) for _ in range(4)]
    base = os_threads_stable()
    eng = _core.UploadEngine(2)
    eng.start(src.ctypes.data, n, dst.ctypes.data, [(b.ctypes.data, b.nbytes) for b in bufs], CHUNK)
    eng.close()  # returns only once no copy reads the buffers
    assert eng.finished and os_threads_settle(base) == base
    r = eng.result()
    assert r["bytes"] == sum(r["buffer_bytes"]) <= n and r["lost"] == []


def test_errors_are_poolkeeper_errors():
    assert issubclass(UpstreamError, PoolkeeperError)


def test_the_tail_ends_in_pieces_that_halve_down_to_the_floor():
    n = 40 * CHUNK + 7
    with_tail, without = schedule(n, CHUNK, True, 4), schedule(n, CHUNK, True, 0)
    assert sum(with_tail) == sum(without) == n
    assert with_tail[-8:] == [RAMP_MIN * 2] * 4 + [RAMP_MIN] * 4  # CHUNK/2 x 4 workers, then 256 KiB x 4
    assert len(with_tail) == len(without) + 5  # 3 MiB of full chunks became 8 pieces


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_replaces_the_engine_without_touching_the_parents_threads(host):
    """The child inherits an engine whose threads wait on its condition variables but do not exist
    there: dropping it must not block (destroying a condition variable with waiters waits forever),
    and the child's own upload gets a fresh engine. Run in a subprocess so a hang is a timeout."""
    code = textwrap.dedent('''
        import gc, os, sys, numpy as np, poolkeeper as pk
        from poolkeeper.staging import PinnedStagingPool, Uploader
        up = Uploader(PinnedStagingPool(pk.upstream.Host(), max_buffers=16), chunk_bytes=1 << 20,
                      workers=3, engine="native")
        src = np.arange(5 << 20, dtype=np.uint8); dst = bytearray(5 << 20)
        up.upload(src, dst)                      # the engine's threads now sleep on its cv
        pid = os.fork()
        if pid == 0:
            ok = False
            try:
                d2 = bytearray(5 << 20)
                up.upload(src, d2)               # a fresh engine in the child
                ok = d2 == src.tobytes() and up._native_pid == os.getpid()
                del up; gc.collect()             # the child's engine closes normally
            finally:
                os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        up.close()
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "child 0" in r.stdout


@pytest.mark.parametrize("n, chunk", [(10 * CHUNK + 5, CHUNK), (300 * 1024, CHUNK), (64 << 20, 8 << 20), (5 * CHUNK, 128 * 1024)])
def test_both_engines_follow_the_one_ramp_schedule(n, chunk, monkeypatch):
    """The ramp lives in C++ (_core.upload_ramp); the Python engine reads it, so both engines cut an
    upload the same way, and changing the one schedule changes the Python engine's cut too."""
    from poolkeeper.staging import uploader

    def cut(ramp: bool) -> list:
        run, sizes = uploader._Run(n, chunk, None, ramp), []
        while (c := run.take()) is not None:
            sizes.append(c[1])
        return sizes

    assert cut(True) == schedule(n, chunk, ramp=True)
    assert cut(False) == schedule(n, chunk, ramp=False)
    assert uploader.RAMP_MIN == _core.UPLOAD_RAMP_MIN == RAMP_MIN
    monkeypatch.setattr(uploader._core, "upload_ramp", lambda c, t: [1000, 3000])
    assert cut(True)[:3] == [1000, 3000, min(chunk, n - 4000)]


def test_regression_engine_wait_passed_nan_into_a_timed_wait(host):
    # NaN is neither negative nor larger than the 1e6 s cap, so it reached the timed wait, where a
    # NaN duration converted to the clock's integer ticks is undefined behaviour (on x86 a deadline
    # far in the past: the wait returned at once). The public UploadHandle.wait checks its timeout
    # first; the engine refuses NaN itself now.
    eng = _core.UploadEngine(2)
    try:
        with pytest.raises(InvalidArgumentError, match="NaN"):
            eng.wait(float("nan"))
        src = np.frombuffer(payload(8 * CHUNK), np.uint8)
        dst = np.zeros_like(src)
        bufs = [np.zeros(CHUNK, np.uint8) for _ in range(2)]
        eng.start(src.ctypes.data, src.nbytes, dst.ctypes.data, [(b.ctypes.data, b.nbytes) for b in bufs], CHUNK)
        with pytest.raises(InvalidArgumentError, match="NaN"):
            eng.wait(float("nan"))
        assert eng.wait(-1) == src.nbytes and bytes(dst) == bytes(src)
    finally:
        eng.close()
