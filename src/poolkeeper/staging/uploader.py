"""``Uploader``: stream a large host source to the device through a few reused staging buffers.

A pageable source cannot be DMA'd directly (the driver stages it through its own small pinned
buffers: 6.8 GB/s on the H200 host, against 55.3 GB/s from pinned memory). The uploader copies
it chunk by chunk into page-locked staging buffers and issues an asynchronous H2D copy per chunk.

Pipeline: ``workers`` threads (the calling thread is one of them) each take the next chunk, fill
one of their ``depth`` staging buffers from the source (a memmove or pread that releases the
GIL), enqueue its copy, and go on to the next chunk while that copy runs; a worker waits for its
oldest copy only when all its buffers are in flight. So fills overlap copies (within a worker and
across workers), and several cores fill at once: one core's memcpy (about 10 GB/s on the H200
host) is far slower than the link. Sources that must be read in order (file objects) get one
worker with all the buffers.

A buffer goes back to the pool only with the witness of its own completed copy. Before the first
upload the uploader pins its ``workers * depth`` buffers once (:meth:`Uploader.warm_up`); from then
on every chunk reuses one: the steady state makes no pinned allocation at all.

Two engines run that pipeline. ``"python"``: the workers above are Python threads (every source
kind). ``"native"``: for sources with a raw address (bytes, bytearray, memoryview, numpy), the
whole upload runs on the core's persistent native threads (``poolkeeper._core.UploadEngine``)
behind one GIL release; the calling thread only polls for progress. The uploader acquires its
staging buffers from the pool before the upload and retires each afterwards with a witness minted
once the engine has reported all its copies complete. ``engine="auto"`` (default) picks native
where it can.

    >>> up = Uploader(chunk_bytes=8 << 20, workers=12)
    >>> report = up.upload(numpy_array, device_ptr, progress=lambda done, total: ...)
    >>> handle = up.start("weights.bin", device_ptr); ...; handle.wait()
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import numbers
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

from poolkeeper import _core
from poolkeeper.errors import InvalidArgumentError, ReentrancyError, brief
from poolkeeper.staging import _engine
from poolkeeper.staging._engine import _device_dst, _host_dst, copy, copy_async
from poolkeeper.staging.pool import MiB, PinnedStagingPool
from poolkeeper.staging.sources import Source, open_source

Progress = Callable[[int, int], Any]


@dataclass(frozen=True)
class UploadReport:
    """What one upload did.

    ``pinned_alloc_calls`` / ``reuses``: the pool's counter deltas over the upload, warm-up
    included (they include other users of a shared pool); the python engine acquires once per
    chunk, the native engine once per staging buffer per upload. ``overlapped_fills``: chunks
    whose fill started while an earlier copy of the same worker was still in flight. ``workers``:
    workers that ran (1 for sequential sources). ``engine``: ``"python"`` or ``"native"``."""

    nbytes: int
    chunks: int
    chunk_bytes: int
    workers: int
    depth: int
    seconds: float
    pinned_alloc_calls: int
    reuses: int
    overlapped_fills: int
    engine: str = "python"
    #: Native engine only: ``fill_s``, ``wait_s``, ``enqueue_s`` (summed over workers),
    #: ``first_copy_s`` (start to the first copy enqueued), ``wall_s``, ``nt_fill``.
    phases: Optional[dict] = None

    @property
    def gbps(self) -> float:
        """Effective bandwidth in GB/s (1e9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _check_timeout(timeout: Any) -> Optional[float]:
    """``timeout`` as a float for a wait, or None for no limit.

    None, ``math.inf`` and anything above ``threading.TIMEOUT_MAX`` (about 292 years) mean no
    limit: no such deadline can pass, and Python's own waits raise ``OverflowError`` for them.
    NaN, negative numbers (``queue.Queue.get`` refuses them too; ``Lock.acquire`` takes only -1),
    booleans and non-numbers raise :class:`~poolkeeper.errors.InvalidArgumentError`. Checked
    before any wait: a lock or thread join that raises on its argument can leave the waited-on
    state changed (``Thread.join(nan)`` marks the running thread stopped)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgumentError(f"timeout must be None or a number of seconds >= 0; got {brief(timeout)}")
    try:
        t = float(timeout)
    except OverflowError:  # an int beyond float range
        t = math.inf if timeout > 0 else -math.inf
    if math.isnan(t) or t < 0:
        raise InvalidArgumentError(f"timeout must be None or a number of seconds >= 0; got {brief(timeout)}")
    return None if t > threading.TIMEOUT_MAX else t


class UploadHandle:
    """An upload running on a background thread."""

    def __init__(self, run: Callable[[], UploadReport]) -> None:
        self._result: Optional[UploadReport] = None
        self._error: Optional[BaseException] = None
        # done()/wait() read this event, not the thread: Thread.join() marks a still-running
        # thread stopped when its wait raises (a bad timeout, or Ctrl-C, bpo-45274), and the
        # handle would then report an upload finished while it still writes the destination.
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(run,), name="poolkeeper-upload", daemon=True)
        self._thread.start()

    def _main(self, run: Callable[[], UploadReport]) -> None:
        try:
            self._result = run()
        except BaseException as e:  # re-raised by wait()
            self._error = e
        finally:
            self._finished.set()

    def done(self) -> bool:
        """Whether the upload has finished (data at the destination, or failed)."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> UploadReport:
        """Block until the data is at the destination; raise the upload's error if it failed.

        ``timeout``: seconds to wait at most; None (default) or ``math.inf`` waits as long as it
        takes, 0 only looks. Raises ``TimeoutError`` if ``timeout`` seconds pass first, and
        :class:`~poolkeeper.errors.InvalidArgumentError` for a NaN, negative or non-number
        timeout (before waiting: the handle is unaffected)."""
        if not self._finished.wait(_check_timeout(timeout)):
            raise TimeoutError("upload still running")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


# The uploaders whose progress callback the current thread is running. upload()/start() from
# inside one would wait for the very upload that waits for the callback (the native engine's lock,
# the Python engine's busy helper threads), and close() would take that lock or join those threads
# (the calling one among them): refused at once with ReentrancyError instead.
_in_callback = threading.local()


def _call_progress(owner: "Uploader", progress: Progress, done: int, total: int) -> None:
    active = getattr(_in_callback, "uploaders", None)
    if active is None:
        active = _in_callback.uploaders = []
    active.append(owner)
    try:
        progress(done, total)
    finally:
        active.pop()


def _check_not_in_callback(owner: "Uploader", call: str) -> None:
    if any(u is owner for u in getattr(_in_callback, "uploaders", ())):
        raise ReentrancyError(
            f"{call} called from a progress callback of an upload running on the same Uploader: "
            "it would wait for the upload that is waiting for this callback; "
            + ("close the uploader after this upload returns" if call == "close()" else
               "use another Uploader, or start the next upload after this one returns")
        )


def _check_progress(progress: Any) -> None:
    # Up front: a non-callable would otherwise fail at the first landed chunk, mid-upload.
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(f"progress must be None or a callable (bytes_done, total); got {brief(progress)}")


RAMP_MIN = _core.UPLOAD_RAMP_MIN  # the ramp's smallest chunk (the schedule is _core.upload_ramp)
NATIVE_CHUNK = 4 * MiB  # H200: best at 2 GiB (51.8 GB/s), within 5% of the best at 256 MiB
PYTHON_CHUNK = 8 * MiB  # H200: the Python engine's best (44-46 GB/s at 2 GiB; 4 MiB gave 24)


class _Run:
    """Shared state of one upload: the next chunk, landed bytes, the first error.

    With ``ramp`` the first chunks are smaller (chunk/8, chunk/4, chunk/2, then chunk): the link
    idles until the first fill completes, and every worker starts filling at once, so a small
    first chunk gets the first copy going sooner. This matters for transfers of a few hundred MiB.
    The sizes are the native engine's own (``_core.upload_ramp``), so both engines cut an upload
    the same way.
    """

    def __init__(self, total: int, chunk: int, progress: Optional[Progress], ramp: bool) -> None:
        self.total = total
        self.chunk = chunk
        self.nchunks = 0
        self._off = 0
        self._head = _core.upload_ramp(chunk, total) if ramp else []
        self._lock = threading.Lock()
        self.done = 0
        self.overlapped = 0
        self.error: Optional[BaseException] = None
        self._progress = progress
        self._active = 0  # workers inside _work: what a failed run must wait for
        self._idle = threading.Condition(self._lock)

    def enter(self) -> None:
        with self._lock:
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def wait_idle(self) -> None:
        """Until no worker is inside ``_work``. A helper still queued (its future lost to a Ctrl-C
        during ``submit``) enters after the run failed and takes no chunk, so it needs no wait."""
        with self._lock:
            while self._active:
                self._idle.wait()

    def take(self) -> Optional[tuple[int, int]]:
        """The next chunk as ``(offset, nbytes)``, or None when there is none (or a worker failed)."""
        with self._lock:
            if self.error is not None or self._off >= self.total:
                return None
            k = self.nchunks
            off, n = self._off, min(self._head[k] if k < len(self._head) else self.chunk, self.total - self._off)
            self._off += n
            self.nchunks += 1
            return off, n

    def landed(self, n: int, owner: "Uploader") -> None:
        with self._lock:  # callbacks are serialized, so bytes_done only grows
            self.done += n
            if self._progress is not None:
                _call_progress(owner, self._progress, self.done, self.total)

    def overlap(self) -> None:
        with self._lock:
            self.overlapped += 1

    def fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e


def _give_back_unread(bufs: list) -> None:
    """Retire buffers nothing copied out of (an empty copy's witness), closing any that refuse.
    A Ctrl-C meanwhile is dropped: the exception already propagating, if any, tells the story."""
    while bufs:
        try:
            while bufs:
                b = bufs[-1]
                if b.state == "live":
                    try:
                        b.retire(copy(0, b, 0))
                    except Exception:
                        b.close()
                bufs.pop()
        except KeyboardInterrupt:
            continue


class Uploader:
    """Streams host data to a device allocation (or, on the Host upstream, a host buffer).

    Args:
        pool: the staging pool (default: a new :class:`PinnedStagingPool` on ``CudaPinned`` when
            CUDA is available, else ``Host``, with room for ``workers * depth`` chunks). Its bounds
            must let it retain ``workers * depth`` chunks, or the steady state would re-pin.
        chunk_bytes: bytes per chunk (default: 4 MiB on the native engine, 8 MiB on the Python
            one -- each engine's best on the H200 host, docs/staging.md). Staging buffers hold the
            larger, so either engine reuses them.
        workers: threads filling chunks concurrently, the caller's included (default
            ``min(8, os.cpu_count())``; on the H200 host 8 fill threads already saturate host
            memory bandwidth under the DMA, 12 measured no better, docs/staging.md).
        depth: staging buffers per worker (default 2); ``workers * depth`` must be at least 2 so a
            fill can overlap a copy.
        stream: where copies are ordered on the CUDA path (default: a stream the uploader creates on
            the calling thread's current device at its first upload).
        ramp: start with smaller chunks (chunk/8, /4, /2) so the first copy starts sooner
            (default True).
        engine: ``"native"`` (the core's upload engine; sources with a raw address only, others
            raise), ``"python"`` (Python worker threads; every source), or ``"auto"`` (default:
            native where the source has an address, python otherwise). One native upload runs at
            a time per uploader (concurrent calls wait their turn).
        tail_ramp: native engine only: end with pieces that halve toward the end (chunk/2 per
            worker, then chunk/4, ... down to 256 KiB), so the copies still queued when the last
            fill completes are a few small ones rather than one full chunk per worker. Default
            False: on the H200 it helped 8 MiB chunks (256 MiB: 36.1 vs 30.9 GB/s) and did nothing
            measurable for 2–4 MiB ones.
        nt_fill: native engine only: fill staging buffers with non-temporal stores (they bypass
            the cache: no read-for-ownership traffic competing with the DMA). Default False;
            whether it helps depends on the machine (``benchmarks/uploader_bench.py --nt on,off``).
    """

    def __init__(
        self,
        pool: Optional[PinnedStagingPool] = None,
        *,
        chunk_bytes: Optional[int] = None,
        workers: Optional[int] = None,
        depth: int = 2,
        stream: Any = None,
        ramp: bool = True,
        engine: str = "auto",
        nt_fill: bool = False,
        tail_ramp: bool = False,
    ) -> None:
        if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
            raise InvalidArgumentError(f"chunk_bytes must be a positive int; got {chunk_bytes!r}")
        # Each engine's measured best when not given (docs/staging.md): the native engine pays a
        # driver call per chunk and keeps its staging set in the last-level cache with small
        # chunks; the Python engine pays GIL hand-offs per chunk and wants fewer, larger ones.
        chunk_native = chunk_bytes or NATIVE_CHUNK
        chunk_python = chunk_bytes or PYTHON_CHUNK
        chunk_max = max(chunk_native, chunk_python)
        if workers is None:
            workers = min(8, os.cpu_count() or 1)
        for name, v in (("workers", workers), ("depth", depth)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int; got {v!r}")
        if workers * depth < 2:
            raise InvalidArgumentError("workers * depth must be at least 2 so a fill can overlap a copy")
        if engine not in ("auto", "native", "python"):
            raise InvalidArgumentError(f"engine must be 'auto', 'native' or 'python'; got {engine!r}")
        nbuf = workers * depth
        self._own_pool = pool is None
        if pool is None:
            pool = PinnedStagingPool(max_buffers=max(8, nbuf), max_bytes=max(512 * MiB, nbuf * -(-chunk_max // 4096) * 4096))
        cap = pool.capacity_for(chunk_max)
        if pool.max_buffers < nbuf or pool.max_bytes < nbuf * cap:
            raise InvalidArgumentError(
                f"the pool retains at most {pool.max_buffers} buffers / {pool.max_bytes} bytes; the uploader "
                f"keeps {nbuf} buffers of {cap} bytes, so its steady state would pin memory per chunk"
            )
        self._pool = pool
        self._chunk = chunk_max  # what the staging buffers hold (either engine fits in them)
        self._chunk_native, self._chunk_python = chunk_native, chunk_python
        self._workers = workers
        self._depth = depth
        self._stream = stream
        self._ramp = bool(ramp)
        self._own_stream: Any = None
        self._executor: Optional[cf.ThreadPoolExecutor] = None
        self._warm = False
        self._lock = threading.Lock()
        self._engine_kind = engine
        self._nt_fill = bool(nt_fill)
        self._tail_ramp = bool(tail_ramp)
        self._native: Any = None  # poolkeeper._core.UploadEngine, made at the first native upload
        self._native_pid = 0
        self._native_lock = threading.Lock()
        _live_uploaders.add(self)
        self._faults: dict = {}  # tests: fail_fill_at / fail_copy_at / fail_record_at (chunk index)

    @property
    def pool(self) -> PinnedStagingPool:
        return self._pool

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk of the native engine (the Python engine's is ``python_chunk_bytes``;
        both are ``chunk_bytes`` when it was given)."""
        return self._chunk_native

    @property
    def python_chunk_bytes(self) -> int:
        return self._chunk_python

    @property
    def workers(self) -> int:
        return self._workers

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def engine(self) -> str:
        """The engine setting: ``"auto"``, ``"native"`` or ``"python"``."""
        return self._engine_kind

    @property
    def buffers(self) -> int:
        """Staging buffers the uploader cycles through (``workers * depth``)."""
        return self._workers * self._depth

    def warm_up(self) -> int:
        """Make sure the pool holds this uploader's ``workers * depth`` staging buffers now (e.g.
        at model load), so no upload pays for pinning. Returns the pinned allocations it made.

        Each buffer is acquired and retired with the witness of an empty copy: nothing read it,
        so nothing can still be reading it."""
        before = self._pool.stats()["pinned_alloc_calls"]
        bufs: list = []
        try:
            for _ in range(self.buffers):
                bufs.append(self._pool.acquire(self._chunk))
        finally:
            _give_back_unread(bufs)  # also on failure or Ctrl-C: none may stay leased
        self._warm = True
        return self._pool.stats()["pinned_alloc_calls"] - before

    def upload(self, src: Any, dst: Any, nbytes: Optional[int] = None, *, progress: Optional[Progress] = None) -> UploadReport:
        """Copy ``src`` to ``dst`` and return once every byte is there.

        ``src``: bytes, bytearray, memoryview, a C-contiguous numpy array (any buffer), a path, or a
        binary file object (read from its current position). ``dst``: a device pointer (pinned
        pool), or a host address / writable buffer (Host pool). ``nbytes``: how much of the source
        (default all of it). ``progress(bytes_done, total)`` is called as chunks land (from worker
        threads, one call at a time); a non-callable ``progress`` raises
        :class:`~poolkeeper.errors.InvalidArgumentError` before anything is read. A callback that
        calls ``upload()``, ``start()`` or ``close()`` on this same uploader gets
        :class:`~poolkeeper.errors.ReentrancyError` (each would wait for the upload waiting on the
        callback).

        Every exit path (an error, an exception raised by ``progress`` or by the source,
        ``KeyboardInterrupt``) waits for the copies already issued and gives every staging buffer
        back to the pool (retired, or freed if its copy failed) before it propagates.
        """
        _check_not_in_callback(self, "upload()")
        _check_progress(progress)
        source = open_source(src, nbytes)
        try:
            return self._run(source, dst, progress)
        finally:
            if source is not src:
                source.close()

    def start(self, src: Any, dst: Any, nbytes: Optional[int] = None, *, progress: Optional[Progress] = None) -> UploadHandle:
        """Like :meth:`upload`, on a background thread; ``handle.wait()`` returns the report.
        The source is opened (and validated) before this returns. Refused with
        :class:`~poolkeeper.errors.ReentrancyError` from this uploader's own progress callback."""
        _check_not_in_callback(self, "start()")
        _check_progress(progress)
        source = open_source(src, nbytes)

        def run() -> UploadReport:
            try:
                return self._run(source, dst, progress)
            finally:
                if source is not src:
                    source.close()

        return UploadHandle(run)

    def close(self) -> None:
        """Stop the worker threads (Python and native); close the pool if the uploader created it.

        From this uploader's own progress callback it raises :class:`~poolkeeper.errors.ReentrancyError`
        and changes nothing: it would wait for the upload that is waiting for the callback."""
        _check_not_in_callback(self, "close()")
        with self._lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
        with self._native_lock:
            native, self._native = self._native, None
        if native is not None:
            native.close()
        if self._own_pool:
            self._pool.close()

    def __enter__(self) -> "Uploader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _helpers(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(self._workers - 1, thread_name_prefix="poolkeeper-upload")
            return self._executor

    def _copy_stream(self) -> Any:
        if self._stream is not None:
            return self._stream
        with self._lock:
            if self._own_stream is None:
                drv = _engine._driver()
                self._own_stream = drv.Stream(drv.current_device())
            return self._own_stream

    def _uses_native(self, source: Source) -> bool:
        has_address = source.parallel and getattr(source, "address", None) is not None
        if self._engine_kind == "native" and not has_address:
            raise InvalidArgumentError(
                "engine='native' needs a source with a raw address (bytes, bytearray, memoryview, numpy); "
                f"use engine='auto' or 'python' for {type(source).__name__}"
            )
        return has_address and self._engine_kind != "python"

    def _run(self, source: Source, dst: Any, progress: Optional[Progress]) -> UploadReport:
        if self._uses_native(source):
            return self._run_native(source, dst, progress)
        total = source.nbytes
        hold = None
        if self._pool.upstream.kind == "pinned":
            base = _device_dst(dst, total)
            stream = self._copy_stream() if total else None
        else:
            base, hold = _host_dst(dst, total)
            stream = None
        try:
            before = self._pool.stats()
            t0 = time.perf_counter()
            if not self._warm:
                self.warm_up()
            run = _Run(total, self._chunk_python, progress, self._ramp)
            if source.parallel:
                workers, depth = max(1, min(self._workers, -(-total // self._chunk_python))), self._depth
            else:
                workers, depth = 1, self.buffers
            helpers: list = []
            try:
                for _ in range(workers - 1):
                    helpers.append(self._helpers().submit(self._helper_work, run, source, base, stream, depth))
                self._work(run, source, base, stream, depth)
            except BaseException as e:  # Ctrl-C outside _work's own handler: stop the helpers
                run.fail(e)
                raise
            finally:
                # Helpers read the source and write the destination, both released next: they
                # must have stopped first, even on Ctrl-C (which then fails the run).
                self._join_helpers(run, helpers)
            seconds = time.perf_counter() - t0
        finally:
            if hold is not None:
                hold.release()
        if run.error is not None:
            raise run.error
        after = self._pool.stats()
        return UploadReport(
            nbytes=total,
            chunks=run.nchunks,
            chunk_bytes=self._chunk_python,
            workers=workers,
            depth=depth,
            seconds=seconds,
            pinned_alloc_calls=after["pinned_alloc_calls"] - before["pinned_alloc_calls"],
            reuses=after["reuses"] - before["reuses"],
            overlapped_fills=run.overlapped,
        )

    def _native_engine(self) -> Any:
        # Under _native_lock. A forked child inherits the object but not its threads: make a new one.
        if self._native is None or self._native_pid != os.getpid():
            from poolkeeper import _core

            self._native = _core.UploadEngine(self._workers)
            self._native_pid = os.getpid()
        return self._native

    def _run_native(self, source: Source, dst: Any, progress: Optional[Progress]) -> UploadReport:
        total = source.nbytes
        hold = None
        stream: Optional[int] = None
        if self._pool.upstream.kind == "pinned":
            base, backend = _device_dst(dst, total), "cuda"
            stream = _engine._stream_handle(self._copy_stream()) if total else None
        else:
            (base, hold), backend = _host_dst(dst, total), "host"
        try:
            with self._native_lock:
                before = self._pool.stats()
                t0 = time.perf_counter()
                if not self._warm:
                    self.warm_up()
                eng = self._native_engine()
                res = self._native_upload(eng, source, base, backend, stream, progress)
                seconds = time.perf_counter() - t0
        finally:
            if hold is not None:
                hold.release()
        after = self._pool.stats()
        return UploadReport(
            nbytes=total,
            chunks=res["chunks"],
            chunk_bytes=self._chunk_native,
            workers=res["workers"],
            depth=self._depth,
            seconds=seconds,
            pinned_alloc_calls=after["pinned_alloc_calls"] - before["pinned_alloc_calls"],
            reuses=after["reuses"] - before["reuses"],
            overlapped_fills=res["overlapped_fills"],
            engine="native",
            phases={
                "fill_s": res["fill_ns"] / 1e9,
                "wait_s": res["wait_ns"] / 1e9,
                "enqueue_s": res["enqueue_ns"] / 1e9,
                "first_copy_s": res["first_enqueue_ns"] / 1e9,
                "last_start_s": res["last_start_ns"] / 1e9,
                "last_fill_end_s": res["last_fill_end_ns"] / 1e9,
                "wall_s": res["wall_ns"] / 1e9,
                "nt_fill": res["nt_fill"],
            },
        )

    def _native_upload(
        self, eng: Any, source: Source, base: int, backend: str, stream: Optional[int], progress: Optional[Progress]
    ) -> dict:
        total = source.nbytes
        bufs: list = []
        try:
            for _ in range(self.buffers):
                bufs.append(self._pool.acquire(self._chunk))
        except BaseException:
            _give_back_unread(bufs)  # nothing copied out of them yet
            raise
        # Each buffer carries one job for the whole upload (_engine._begin_engine_run).
        run = _engine._EngineRun(eng)
        jobs = _engine._begin_engine_run(bufs, run)
        try:
            eng.start(source.address, total, base, [(b.ptr, b.capacity) for b in bufs], self._chunk_native,
                      self._ramp, backend, stream, self._nt_fill, tail_ramp=self._tail_ramp, **self._faults)
        except BaseException:
            run.unstarted()
            self._settle(bufs, jobs, run)
            raise
        try:
            last = 0
            while not eng.finished:  # short waits keep the caller responsive to signals
                done = eng.wait(0.002 if progress is not None else 0.1)
                if progress is not None and done > last:
                    last = done
                    _call_progress(self, progress, done, total)
        except BaseException:  # a progress callback raised, or KeyboardInterrupt: stop, then settle
            self._stop_engine(eng)
            run.observe(jobs)
            self._settle(bufs, jobs, run)
            raise
        res = run.observe(jobs)
        self._settle(bufs, jobs, run)
        if res["failed"]:
            eng.rethrow()
        if progress is not None and res["bytes"] > last:
            _call_progress(self, progress, res["bytes"], total)
        return res

    @staticmethod
    def _stop_engine(eng: Any) -> None:
        # Until the engine has finished, its workers read the source and write the destination,
        # which the caller releases next: a second Ctrl-C must not cut this wait short. Further
        # interrupts are dropped; the exception already propagating says the upload failed.
        while True:
            try:
                eng.cancel()
                while not eng.finished:
                    eng.wait(0.1)
                return
            except KeyboardInterrupt:
                continue

    @staticmethod
    def _settle(bufs: list, jobs: list, run: "_engine._EngineRun") -> None:
        # After the engine finished: completed buffers go back with their witness; lost ones are
        # closed, which leaks them (their copy's completion is unknowable), counted by the pool.
        for i, (b, job) in enumerate(zip(bufs, jobs)):
            if i in run.lost:
                b.close()
            else:
                b.retire(_engine._mint_engine_observed(b, job))

    @staticmethod
    def _join_helpers(run: _Run, helpers: list) -> None:
        # Not only the futures in ``helpers``: a Ctrl-C inside submit() can lose a queued helper's
        # future, so wait for the run to be idle. Ctrl-C meanwhile fails the run (helpers stop
        # taking chunks) and the wait goes on.
        while True:
            try:
                for h in helpers:
                    h.result()
                run.wait_idle()
                return
            except KeyboardInterrupt as e:
                run.fail(e)

    def _helper_work(self, run: _Run, source: Source, base: int, stream: Any, depth: int) -> None:
        # Counted so a failed run can wait for every helper (Ctrl-C reaches only the main thread,
        # so nothing interrupts a helper between enter and the try).
        run.enter()
        try:
            self._work(run, source, base, stream, depth)
        finally:
            run.leave()

    def _work(self, run: _Run, source: Source, base: int, stream: Any, depth: int) -> None:
        inflight: collections.deque = collections.deque()
        box: list = []  # the buffer being filled: acquired, not yet in flight
        try:
            while True:
                nxt = run.take()
                if nxt is None:
                    break
                off, n = nxt
                if len(inflight) >= depth:
                    run.landed(self._land_oldest(inflight), self)
                box.append(self._pool.acquire(run.chunk))
                buf = box[0]
                if inflight and not inflight[-1][1].done():  # copies complete in order: newest suffices
                    run.overlap()
                source.fill(buf, off, n)
                inflight.append((buf, copy_async(base + off, buf, n, stream)))
                box.clear()
            while inflight:
                run.landed(self._land_oldest(inflight), self)
        except BaseException as e:
            run.fail(e)
            self._abandon(inflight, box)

    @staticmethod
    def _land_oldest(inflight: collections.deque) -> int:
        # The buffer leaves ``inflight`` only once retired: an exception (Ctrl-C) during the wait
        # leaves it there for _abandon, never in nobody's hands.
        staged, pending = inflight[0]
        witness = pending.wait()  # this buffer's own copy, and only it, has completed
        staged.retire(witness)
        inflight.popleft()
        return pending.nbytes

    @staticmethod
    def _abandon(inflight: collections.deque, box: list) -> None:
        # On error nothing may be freed under a copy: wait for each, retire what completed cleanly,
        # free the rest. A second Ctrl-C must not cut this short (the buffers would be stranded):
        # it is dropped, the exception already propagating says the upload failed.
        while inflight or box:
            try:
                while inflight:
                    staged, pending = inflight[0]
                    if staged.state == "live":
                        try:
                            staged.retire(pending.wait())
                        except Exception:
                            staged.close()
                    inflight.popleft()
                while box:
                    box[0].close()  # no copy was issued from it (or close waits for it)
                    box.pop()
            except KeyboardInterrupt:
                continue


# A forked child inherits the uploaders' locks in whatever state the parent's threads left them
# (a lock held by another thread at the fork would never be released there), and none of their
# threads: give every live uploader fresh locks and no executor. Its native engine is replaced at
# the next upload (the old one is left to leak, see UploadEngine::close).
_live_uploaders: "weakref.WeakSet[Uploader]" = weakref.WeakSet()


def _reset_after_fork() -> None:
    for up in list(_live_uploaders):
        up._lock = threading.Lock()
        up._native_lock = threading.Lock()
        up._executor = None
        up._own_stream = None  # a CUDA stream of the parent's context is not valid in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


__all__ = ["Uploader", "UploadHandle", "UploadReport"]
