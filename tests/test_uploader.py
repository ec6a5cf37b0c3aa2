"""The Uploader on the Host upstream: bytes arrive intact, buffers are reused, fill overlaps copy."""
from __future__ import annotations

import ctypes
import io
import json
import math
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import poolkeeper as pk
from poolkeeper.errors import InvalidArgumentError, ReentrancyError
from poolkeeper.staging import PinnedStagingPool, Uploader, _engine
from poolkeeper.staging.sources import MemorySource, Source

CHUNK = 64 * 1024


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def host():
    return pk.upstream.Host()


@pytest.fixture(params=["python", "native"])
def uploader(host, request):
    """Both engines: memory sources go through the engine named; file sources always run on the
    Python engine (engine="native" would refuse them), so those get "auto"."""
    up = Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=3, depth=2,
                  engine="auto" if request.param == "native" else "python")
    up.kind = request.param
    yield up
    up.close()


def chunk_schedule(n: int, chunk: int, ramp: bool = True) -> list:
    """(offset, size) of each chunk: with the ramp, chunk/8, /4, /2, then whole chunks."""
    out, off = [], 0
    size = max(min(chunk, 256 * 1024), chunk // 8) if ramp else chunk
    while off < n:
        out.append((off, min(size, n - off)))
        off += out[-1][1]
        size = min(2 * size, chunk)
    return out


class RecordingSource(Source):
    """A memory source whose fills can be held and observed."""

    def __init__(self, data: bytes, before_fill=None) -> None:
        self._inner = MemorySource(data)
        self.data = data
        self.nbytes = self._inner.nbytes
        self.before_fill = before_fill
        self.filled: list = []

    def fill(self, buf, offset, n):
        if self.before_fill is not None:
            self.before_fill(offset)
        self._inner.fill(buf, offset, n)
        self.filled.append(offset)

    def close(self):
        self._inner.close()


SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 123, 40 * CHUNK + 4097]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy"])
def test_memory_sources_arrive_intact(uploader, n, kind):
    data = payload(n, seed=n)
    src = {
        "bytes": lambda: data,
        "bytearray": lambda: bytearray(data),
        "memoryview": lambda: memoryview(data),
        "numpy": lambda: np.frombuffer(data, dtype=np.uint8).copy(),
    }[kind]()
    dst = bytearray(n)
    report = uploader.upload(src, dst)
    assert dst == data
    assert report.nbytes == n and report.chunks == len(chunk_schedule(n, CHUNK))


def test_multi_dimensional_numpy_source_and_pointer_destination(uploader):
    src = np.arange(3 * 1000 * 77, dtype=np.uint32).reshape(3, 1000, 77)
    dst = np.zeros_like(src)
    uploader.upload(src, dst.ctypes.data)
    assert np.array_equal(src, dst)


def test_large_chunks_many_workers_arrive_intact(host):
    data = payload(5 * (4 << 20) + 12345, seed=7)
    dst = bytearray(len(data))
    with Uploader(PinnedStagingPool(host), chunk_bytes=4 << 20, workers=4, depth=2) as up:
        report = up.upload(data, dst)
    assert dst == data and report.workers == 4


def test_path_source(uploader, tmp_path):
    data = payload(7 * CHUNK + 99, seed=3)
    p = tmp_path / "weights.bin"
    p.write_bytes(data)
    dst = bytearray(len(data))
    uploader.upload(p, dst)
    assert dst == data
    dst2 = bytearray(len(data))
    uploader.upload(str(p), dst2)
    assert dst2 == data


def test_large_path_source_read_in_parallel(host, tmp_path):
    data = payload(2 * (4 << 20) + 777, seed=4)
    p = tmp_path / "big.bin"
    p.write_bytes(data)
    dst = bytearray(len(data))
    with Uploader(PinnedStagingPool(host), chunk_bytes=4 << 20, workers=3, depth=1) as up:
        up.upload(p, dst)
    assert dst == data


def test_file_object_source_from_its_current_position(uploader, tmp_path):
    data = payload(6 * CHUNK + 5, seed=5)
    p = tmp_path / "w.bin"
    p.write_bytes(b"HEADER" + data)
    with open(p, "rb") as f:
        f.read(6)
        dst = bytearray(len(data))
        uploader.upload(f, dst)
    assert dst == data


def test_unseekable_file_object_needs_nbytes(uploader):
    data = payload(3 * CHUNK + 1, seed=6)

    class Pipe:
        def __init__(self):
            self._b = io.BytesIO(data)

        def readinto(self, mv):
            return self._b.readinto(mv)

    with pytest.raises(InvalidArgumentError, match="nbytes is required"):
        uploader.upload(Pipe(), bytearray(len(data)))
    dst = bytearray(len(data))
    uploader.upload(Pipe(), dst, nbytes=len(data))
    assert dst == data


def test_regression_file_object_length_was_unchecked(uploader):
    # Found by the hostile tester: FileObjectSource measured a file object as
    # seek(0, SEEK_END) - tell() and never checked the result, so an ordinary BytesIO positioned
    # past its end gave a negative length (nanobind's bare TypeError out of upload()), and a tell()
    # returning a str a bare TypeError. The past-the-end file is now an empty source (a read there
    # gives nothing), and positions that are not non-negative ints, or a tell/seek that raises
    # something odd, are InvalidArgumentError.
    f = io.BytesIO(b"x" * 100)
    f.seek(1000)
    dst = bytearray(b"\xee" * 10)
    assert uploader.upload(f, dst).nbytes == 0 and dst == b"\xee" * 10 and f.tell() == 1000

    def junk(tell=0, end=0, raises=None):
        class Junk(io.RawIOBase):
            def readable(self):
                return True

            def readinto(self, mv):
                return 0

            def tell(self):
                if raises is not None:
                    raise raises
                return tell

            def seek(self, pos, whence=0):
                return end if whence == 2 else pos

        return Junk()

    for bad, match in ((junk(tell="0"), r"tell\(\) returned '0'"), (junk(tell=-1), r"tell\(\) returned -1"),
                       (junk(end=None), r"seek\(0, SEEK_END\) returned None"), (junk(end=True), "returned True"),
                       (junk(end=2.5), "returned 2.5"), (junk(raises=RuntimeError("boom")), "RuntimeError: boom")):
        with pytest.raises(InvalidArgumentError, match=match):
            uploader.upload(bad, bytearray(10))
    assert uploader.pool.stats()["live_buffers"] == 0
    uploader.pool.validate()


def test_partial_source(uploader):
    data = payload(4 * CHUNK, seed=8)
    dst = bytearray(len(data))
    report = uploader.upload(data, dst, nbytes=2 * CHUNK + 3)
    assert dst[: 2 * CHUNK + 3] == data[: 2 * CHUNK + 3] and not any(dst[2 * CHUNK + 3 :])
    assert report.nbytes == 2 * CHUNK + 3


def test_progress_reports_every_chunk_up_to_the_total(uploader):
    n = 10 * CHUNK + 17
    calls: list = []
    report = uploader.upload(payload(n), bytearray(n), progress=lambda done, total: calls.append((done, total)))
    assert report.chunks == len(chunk_schedule(n, CHUNK))
    if uploader.kind == "python":
        assert len(calls) == report.chunks  # one call per landed chunk
    else:
        assert 1 <= len(calls) <= report.chunks  # the caller polls: one call per change it sees
    assert all(t == n for _, t in calls)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == n and len(set(dones)) == len(dones)


@pytest.mark.parametrize("ramp", [True, False])
def test_chunk_schedule_ramps_up_then_stays_at_chunk_bytes(host, ramp):
    big = 4 << 20  # the ramp never goes below 256 KiB, so use chunks it can divide by 8
    n = 6 * big + 5
    src = RecordingSource(payload(n))
    dst = bytearray(n)
    with Uploader(PinnedStagingPool(host), chunk_bytes=big, workers=1, depth=2, ramp=ramp) as up:
        report = up.upload(src, dst)
    sched = chunk_schedule(n, big, ramp)
    assert src.filled == [o for o, _ in sched] and report.chunks == len(sched)
    if ramp:
        assert [m for _, m in sched[:4]] == [big // 8, big // 4, big // 2, big]
    else:
        assert all(m == big for _, m in sched[:-1])
    assert bytes(dst) == src.data
    src.close()


def expected_reuses(report, buffers: int) -> int:
    # Python engine: one acquire per chunk; native: each staging buffer acquired once per upload.
    return report.chunks if report.engine == "python" else buffers


@pytest.mark.parametrize("engine", ["python", "native"])
def test_steady_state_makes_no_pinned_allocations(host, engine):
    n = 20 * CHUNK + 1
    with Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=1, depth=3, engine=engine) as up:
        first = up.upload(payload(n), bytearray(n))
        assert first.engine == engine
        assert first.pinned_alloc_calls == 3  # one per staging buffer, then only reuse
        assert first.reuses == expected_reuses(first, 3)
        for seed in range(3):
            data = payload(n, seed)
            dst = bytearray(n)
            again = up.upload(data, dst)
            assert dst == data
            assert again.pinned_alloc_calls == 0 and again.reuses == expected_reuses(again, 3)
        s = up.pool.stats()
    assert host.counters()["allocations"] == 3
    assert s["live_buffers"] == 0 and s["retained_buffers"] == 3 and s["frees"] == 0


def test_steady_state_with_several_workers(uploader, host):
    # Warm-up pins workers * depth buffers up front, so the count is exact despite the threads.
    n = 30 * CHUNK + 5
    first = uploader.upload(payload(n), bytearray(n))
    assert first.engine == uploader.kind
    assert first.pinned_alloc_calls == 6 and first.reuses == expected_reuses(first, 6)
    for seed in range(3):
        again = uploader.upload(payload(n, seed), bytearray(n))
        assert again.pinned_alloc_calls == 0 and again.reuses == expected_reuses(again, 6)
    assert host.counters()["allocations"] == 6


def test_warm_up_pins_once(host):
    with Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2, depth=2) as up:
        assert up.warm_up() == 4
        assert up.warm_up() == 0
        report = up.upload(payload(9 * CHUNK), bytearray(9 * CHUNK))
        assert report.pinned_alloc_calls == 0


def test_fill_of_next_chunk_happens_while_previous_copy_is_in_flight(host, monkeypatch):
    """The copy of chunk 0 is held on the copy thread until the fill of chunk 1 has begun. An
    uploader that waited for each copy before filling the next chunk would never start that fill,
    the gate would time out, and this test would fail (no timing is measured)."""
    n = 4 * CHUNK
    data = payload(n, seed=9)
    next_fill_began = threading.Event()

    class Source(io.BytesIO):
        def readinto(self, mv):
            if self.tell() >= CHUNK:
                next_fill_began.set()
            return super().readinto(mv)

    observed: list = []

    def held_copy(dst, src, nbytes):
        if threading.current_thread().name == "poolkeeper-staging-copy" and not observed:
            observed.append(next_fill_began.wait(20))
        return ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(_engine, "_memmove", held_copy)
    dst = bytearray(n)
    with Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=1, depth=2) as up:
        report = up.upload(Source(data), dst)
    assert observed == [True]
    assert report.overlapped_fills >= 1
    assert dst == data


def test_start_returns_a_handle(uploader):
    n = 9 * CHUNK + 3
    data = payload(n, seed=10)
    dst = bytearray(n)
    handle = uploader.start(data, dst)
    report = handle.wait(timeout=60)
    assert handle.done() and dst == data and report.nbytes == n


def test_start_reports_errors_on_wait(uploader):
    handle = uploader.start(b"x" * 100, bytearray(10))
    with pytest.raises(InvalidArgumentError):
        handle.wait(timeout=60)


def test_short_file_fails_cleanly_without_leaking_buffers(uploader, host):
    data = payload(3 * CHUNK, seed=11)
    with pytest.raises(InvalidArgumentError, match="ended"):
        uploader.upload(io.BytesIO(data), bytearray(5 * CHUNK), nbytes=5 * CHUNK)
    s = uploader.pool.stats()
    assert s["live_buffers"] == 0
    assert host.counters()["outstanding_bytes"] == s["retained_bytes"]
    dst = bytearray(len(data))  # the uploader still works afterwards
    uploader.upload(data, dst)
    assert dst == data


def test_workers_fill_different_chunks_at_once(host):
    """The first two fills wait for each other at a barrier, so they must be running at the same
    moment: workers that filled one chunk at a time would break the barrier (timeout)."""
    barrier = threading.Barrier(2, timeout=20)
    first_two: list = []

    def hold(offset):
        if len(first_two) < 2:
            first_two.append(offset)
            barrier.wait()

    data = payload(8 * CHUNK, seed=12)
    src = RecordingSource(data, hold)
    dst = bytearray(len(data))
    with Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2, depth=2) as up:
        report = up.upload(src, dst)
    assert dst == data and not barrier.broken
    assert sorted(first_two) == [0, CHUNK] and sorted(src.filled) == [i * CHUNK for i in range(8)]
    assert report.workers == 2
    src.close()


def test_failing_fill_in_one_worker_fails_the_upload_cleanly(uploader, host):
    def boom(offset):
        if offset == 5 * CHUNK:
            raise OSError("disk on fire")

    src = RecordingSource(payload(12 * CHUNK), boom)
    with pytest.raises(OSError, match="disk on fire"):
        uploader.upload(src, bytearray(12 * CHUNK))
    s = uploader.pool.stats()
    assert s["live_buffers"] == 0 and s["closed_without_retire"] == 1
    assert host.counters()["outstanding_bytes"] == s["retained_bytes"]
    src.close()


def test_bad_arguments(host):
    for kw in ({"workers": 0}, {"depth": 0}, {"workers": 1, "depth": 1}, {"chunk_bytes": 0}, {"workers": True}):
        with pytest.raises(InvalidArgumentError):
            Uploader(PinnedStagingPool(host), **kw)
    with pytest.raises(InvalidArgumentError, match="steady state"):
        Uploader(PinnedStagingPool(host, max_buffers=2), workers=3, depth=1)
    with pytest.raises(InvalidArgumentError, match="steady state"):
        Uploader(PinnedStagingPool(host, max_bytes=CHUNK), chunk_bytes=CHUNK, workers=2, depth=1)
    up = Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2)
    with pytest.raises(InvalidArgumentError):
        up.upload(b"x" * 100, bytearray(99))
    with pytest.raises(InvalidArgumentError):
        up.upload(np.arange(100)[::2], bytearray(800))
    with pytest.raises(InvalidArgumentError):
        up.upload(b"x" * 100, bytearray(100), nbytes=101)
    assert up.pool.stats()["acquires"] == 0
    up.close()


def test_default_uploader_pool_fits_its_buffers():
    with Uploader(chunk_bytes=CHUNK, workers=5, depth=1) as up:
        assert up.pool.max_buffers >= 5 and up.buffers == 5
        if up.pool.upstream.kind == "host":
            data = payload(12 * CHUNK)
            dst = bytearray(len(data))
            up.upload(data, dst)
            assert dst == data and up.pool.stats()["pinned_alloc_calls"] == 5


def test_default_chunks_are_each_engines_measured_best_and_share_the_buffers(host, tmp_path):
    """Without chunk_bytes the native engine cuts 4 MiB chunks and the Python engine (file
    sources) 8 MiB ones; the staging buffers hold 8 MiB, so alternating the two never pins again."""
    MiB = 1 << 20
    n = 20 * MiB + 3
    data = payload(n, seed=7)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    pool = PinnedStagingPool(host, max_buffers=16, max_bytes=256 * MiB)
    with Uploader(pool, workers=2, depth=2) as up:
        assert (up.chunk_bytes, up.python_chunk_bytes) == (4 * MiB, 8 * MiB)
        reports = []
        for src in (data, str(path), data, str(path)):
            dst = bytearray(n)
            reports.append(up.upload(src, dst))
            assert dst == data
    assert [(r.engine, r.chunk_bytes) for r in reports] == [("native", 4 * MiB), ("python", 8 * MiB)] * 2
    assert sum(r.pinned_alloc_calls for r in reports) == 4  # the warm-up's 4 buffers, once
    assert pool.stats()["retained_bytes"] >= 4 * 8 * MiB


# -- regressions --------------------------------------------------------------------------------------


def run_child(code: str, timeout: float = 60) -> dict:
    """Run ``code`` in a fresh interpreter (a hang fails by timeout); its last line is JSON."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-1500:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["python", "native"])
def test_regression_close_from_own_progress_callback_hung(engine):
    # Found: close() from the uploader's own progress callback hung. The native engine runs the
    # callback under _native_lock, which close() takes again; the Python engine runs it under the
    # run's lock while close() joined the helper threads blocked on that lock (or the calling
    # helper itself: "cannot join current thread"). ReentrancyError covered only upload()/start().
    out = run_child(f"""
        import json
        import poolkeeper as pk
        from poolkeeper.errors import ReentrancyError
        from poolkeeper.staging import PinnedStagingPool, Uploader
        up = Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=65536, workers=2, depth=2, engine="{engine}")
        data = bytes(range(256)) * 4096
        seen = []
        def caught(done, total):
            if not seen:
                for call in (up.close, lambda: up.__exit__(None, None, None)):
                    try:
                        call()
                        seen.append("no error")
                    except ReentrancyError as e:
                        seen.append(type(e).__name__)
        dst = bytearray(len(data))
        up.upload(data, dst, progress=caught)  # a refused close() changes nothing: the upload completes
        errors = []
        try:
            up.upload(data, bytearray(len(data)), progress=lambda done, total: up.close())
        except Exception as e:
            errors.append(type(e).__name__)
        try:
            up.start(data, bytearray(len(data)), progress=lambda done, total: up.close()).wait(30)
        except Exception as e:
            errors.append(type(e).__name__)
        up.pool.validate()
        dst2 = bytearray(len(data))
        up.upload(data, dst2)  # still usable
        live = up.pool.stats()["live_buffers"]
        up.close()  # and closes from outside
        print(json.dumps({{"seen": seen, "errors": errors, "ok": dst == data and dst2 == data, "live": live}}))
    """)
    assert out == {"seen": ["ReentrancyError", "ReentrancyError"], "errors": ["ReentrancyError", "ReentrancyError"],
                   "ok": True, "live": 0}


def test_regression_wait_with_bad_timeout_marked_a_running_upload_done(host):
    # Found: UploadHandle.wait(nan) raised a bare ValueError, and the handle then said done() while
    # the upload still wrote the destination (wait() then failed an assert). wait() passed the
    # timeout to Thread.join, whose failed lock wait marks the still-running thread stopped.
    entered, release = threading.Event(), threading.Event()

    def hold(done, total):
        entered.set()
        release.wait(60)

    up = Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2, engine="python")
    data = payload(16 * CHUNK, seed=21)
    dst = bytearray(len(data))
    try:
        handle = up.start(data, dst, progress=hold)
        assert entered.wait(60)
        for bad in (float("nan"), -1, -0.5, float("-inf"), True, "1", None.__class__, [1]):
            with pytest.raises(InvalidArgumentError):
                handle.wait(bad)
            assert not handle.done()
        with pytest.raises(TimeoutError):
            handle.wait(0)
        assert not handle.done()
    finally:
        release.set()
    report = handle.wait(math.inf)  # no limit, as None
    assert handle.done() and dst == data and report.nbytes == len(data)
    assert handle.wait(10**400) is report and handle.wait(0) is report
    up.close()


def test_regression_ctrl_c_in_wait_marked_a_running_upload_done():
    # Found with the NaN timeout above: the same Thread.join path marks the upload's thread stopped
    # when a KeyboardInterrupt lands in the wait; done() then said True mid-upload.
    out = run_child("""
        import json, os, signal, threading
        import poolkeeper as pk
        from poolkeeper.staging import PinnedStagingPool, Uploader
        up = Uploader(PinnedStagingPool(pk.upstream.Host()), chunk_bytes=65536, workers=2, engine="python")
        entered, release = threading.Event(), threading.Event()
        def hold(done, total):
            entered.set()
            release.wait(60)
        data = bytes(range(256)) * 4096
        dst = bytearray(len(data))
        handle = up.start(data, dst, progress=hold)
        entered.wait(60)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        interrupted = False
        try:
            handle.wait()
        except KeyboardInterrupt:
            interrupted = True
        done_mid_upload = handle.done()
        release.set()
        handle.wait(60)
        print(json.dumps({"interrupted": interrupted, "done_mid_upload": done_mid_upload, "ok": dst == data}))
    """)
    assert out == {"interrupted": True, "done_mid_upload": False, "ok": True}


@pytest.mark.parametrize("engine", ["python", "native"])
def test_regression_non_callable_progress_failed_mid_upload(host, engine):
    # Found: upload(progress=5) ran until the first chunk landed and then raised a bare TypeError
    # from the call; it is now refused before anything is staged.
    up = Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2, engine=engine)
    for call in (up.upload, up.start):
        with pytest.raises(InvalidArgumentError, match="progress"):
            call(b"x" * CHUNK, bytearray(CHUNK), progress=5)
    assert up.pool.stats()["acquires"] == 0
    up.close()


def test_regression_directory_source_failed_mid_upload(host, tmp_path):
    # Found: a directory given as the source path opened fine (Linux opens directories read-only)
    # and failed with IsADirectoryError only at the first read, mid-upload. It is now refused when
    # the source is opened, as a missing path is (FileNotFoundError): start() raises, not wait().
    up = Uploader(PinnedStagingPool(host), chunk_bytes=CHUNK, workers=2)
    for call in (up.upload, up.start):
        with pytest.raises(IsADirectoryError):
            call(tmp_path, bytearray(CHUNK))
        with pytest.raises(FileNotFoundError):  # the case it now matches
            call(tmp_path / "missing", bytearray(CHUNK))
    assert up.pool.stats()["acquires"] == 0
    up.close()
