"""The copy path: the only place that observes a copy complete, so the only place that mints
:class:`~poolkeeper.staging.witness.CopyCompleted`.

Two engines, chosen by the staging buffer's upstream:

- ``"pinned"`` (``CudaPinned``): host-to-device through ``poolkeeper.cuda.driver``
  (``memcpy_htod`` / ``memcpy_htod_async`` + ``Event``), imported on first use so this module
  loads without CUDA. ``dst`` is a device pointer (an int, or an object with
  ``__cuda_array_interface__``).
- ``"host"`` (``Host``): ``ctypes.memmove`` into host memory (an int address or a writable buffer).
  Blocking copies run on the calling thread; asynchronous ones on one worker thread, in submission
  order, so the overlap of a fill with a copy is real (memmove releases the GIL) and testable.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from typing import Any, Optional

from poolkeeper.errors import InvalidArgumentError, UpstreamError
from poolkeeper.staging import _lease
from poolkeeper.staging import witness as _witness
from poolkeeper.staging._hostmem import BorrowedBuffer
from poolkeeper.staging.buffer import StagingBuffer

# Looked up at call time so instrumentation (tests) can wrap it.
_memmove = ctypes.memmove


def _driver() -> Any:
    from poolkeeper.cuda import driver

    return driver


# -- jobs: one copy out of one staging buffer -------------------------------------------------------
class _Job:
    __slots__ = ("seq", "nbytes", "error")

    def query(self) -> bool:  # has the copy completed (or failed before reading anything)?
        raise NotImplementedError

    def wait_complete(self) -> bool:
        """Block until complete; False if completion cannot be confirmed (memory must then leak)."""
        raise NotImplementedError


class _HostJob(_Job):
    __slots__ = ("_done", "_keepalive", "_dst_hold")

    def __init__(self, seq: int, nbytes: int, buffer: StagingBuffer) -> None:
        self.seq, self.nbytes, self.error = seq, nbytes, None
        self._done = threading.Event()
        # Until the memmove finishes, the job keeps its StagingBuffer alive: a dropped buffer's
        # finalizer then never has to wait on this worker (it may itself run on the worker).
        self._keepalive: Optional[StagingBuffer] = buffer
        self._dst_hold: Optional[BorrowedBuffer] = None

    def query(self) -> bool:
        return self._done.is_set()

    def wait_complete(self) -> bool:
        self._done.wait()
        return True

    def finish(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        if self._dst_hold is not None:
            self._dst_hold.release()
            self._dst_hold = None
        self._done.set()
        self._keepalive = None  # last: may run the buffer's finalizer, which sees this job done


class _DeviceJob(_Job):
    __slots__ = ("_event", "_done", "_lost")

    def __init__(self, seq: int, nbytes: int) -> None:
        self.seq, self.nbytes, self.error = seq, nbytes, None
        self._event: Any = None
        self._done = False
        self._lost = False  # enqueued but no event could be recorded: completion unknowable

    # Read the event once: another thread may be finishing this job concurrently.
    def query(self) -> bool:
        ev = self._event
        if not self._done and ev is not None and ev.query():
            self._done, self._event = True, None
        return self._done

    def wait_complete(self) -> bool:
        while not self._done:
            ev = self._event
            if ev is not None:
                ev.synchronize()
                self._done, self._event = True, None
            elif self._lost:
                return False
            else:  # another thread is enqueueing this copy right now: its event is moments away
                time.sleep(50e-6)
        return True


class _EngineRun:
    """One upload of the native engine (``poolkeeper._core.UploadEngine``) as its staging buffers
    see it: complete once the engine reports every copy complete, except for buffers the engine
    reports "lost" (a copy enqueued whose completion could not be tracked: never complete).

    The outcome is read once, right after the upload finishes and before the engine starts another
    one, and cached: a finalizer that asks later never sees a different upload's outcome."""

    __slots__ = ("_engine", "_lock", "finished", "lost", "result")

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.finished = False
        self.lost: frozenset = frozenset()
        self.result: Optional[dict] = None

    def observe(self, jobs: list) -> dict:
        """Block until the engine's upload finished (GIL released); record its outcome."""
        with self._lock:
            if self.result is None:
                self._engine.wait(-1.0)
                res = self._engine.result()
                for job, n in zip(jobs, res["buffer_bytes"]):
                    job.nbytes = n
                self.lost = frozenset(res["lost"])
                self.result = res
                self.finished = True
            return self.result

    def unstarted(self) -> None:
        """The engine refused to start: nothing was enqueued, nothing reads any buffer."""
        with self._lock:
            self.result = {"lost": [], "failed": True}
            self.finished = True


class _EngineJob(_Job):
    """All copies out of one staging buffer during one native upload."""

    __slots__ = ("_run", "_index", "_jobs")

    def __init__(self, seq: int, run: _EngineRun, index: int, jobs: list) -> None:
        self.seq, self.nbytes, self.error = seq, 0, None
        self._run, self._index, self._jobs = run, index, jobs

    def query(self) -> bool:
        run = self._run
        return run.finished and self._index not in run.lost

    def wait_complete(self) -> bool:
        self._run.observe(self._jobs)
        return self._index not in self._run.lost


def _begin_engine_run(bufs: list, run: _EngineRun) -> list:
    """Register one native upload as one copy out of each of ``bufs``; returns their jobs (index
    ``i`` is ``bufs[i]``'s). While it runs, view/fill/retire refuse, and a drop or close waits for
    the engine before freeing."""
    jobs: list = []
    for i, b in enumerate(bufs):
        jobs.append(_lease.of(b).begin_copy(lambda seq, i=i: _EngineJob(seq, run, i, jobs)))
    return jobs


def _mint_engine_observed(buffer: StagingBuffer, job: _EngineJob) -> "_witness.CopyCompleted":
    """The witness for a buffer whose copies the native engine has reported complete.

    Same guarantees as every other witness (the lease re-checks completion, binds the witness to
    itself and registers its single-use token); only the job type differs.
    """
    lease = _lease.of(buffer)
    if type(job) is not _EngineJob or not lease.issued(job):
        raise UpstreamError("internal error: an engine witness was requested for a copy the engine did not run")
    return lease.mint(job)


# -- the host worker ---------------------------------------------------------------------------------
class _HostWorker:
    """One daemon thread running asynchronous host copies in submission order."""

    def __init__(self) -> None:
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, job: _HostJob, dst: int, src: int, nbytes: int) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="poolkeeper-staging-copy", daemon=True)
                self._thread.start()
        self._q.put((job, dst, src, nbytes))

    def _run(self) -> None:
        while True:
            job, dst, src, nbytes = self._q.get()
            try:
                if nbytes:
                    _memmove(dst, src, nbytes)
            except BaseException as e:  # reported by PendingCopy.wait(); the worker keeps going
                job.finish(e)
            else:
                job.finish()
            del job


_worker = _HostWorker()


def _reset_after_fork() -> None:
    global _worker
    _worker = _HostWorker()  # the parent's thread does not exist in the child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


# -- public API ----------------------------------------------------------------------------------------
class PendingCopy:
    """An asynchronous copy out of a staging buffer. ``wait()`` returns its :class:`CopyCompleted`."""

    __slots__ = ("_buffer", "_job", "_witness")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("PendingCopy is returned by poolkeeper.staging.copy_async()")

    @classmethod
    def _new(cls, buffer: StagingBuffer, job: _Job) -> "PendingCopy":
        self = object.__new__(cls)
        self._buffer, self._job, self._witness = buffer, job, None
        return self

    @property
    def buffer(self) -> StagingBuffer:
        return self._buffer

    @property
    def nbytes(self) -> int:
        return self._job.nbytes

    def done(self) -> bool:
        """Whether the copy has completed (non-blocking)."""
        return self._job.query()

    def wait(self) -> "_witness.CopyCompleted":
        """Block until the copy has completed; return its witness (the same one on every call).

        Raises the copy's error if it failed (then there is no witness: close the buffer)."""
        if self._witness is None:
            if not self._job.wait_complete():
                raise UpstreamError("the copy was enqueued but its completion could not be tracked")
            if self._job.error is not None:
                raise self._job.error
            self._witness = _lease.of(self._buffer).mint(self._job)
        return self._witness

    def __repr__(self) -> str:
        state = "done" if self._job.query() else "in flight"
        return f"<PendingCopy copy {self._job.seq} of 0x{self._buffer.ptr:x}, {self._job.nbytes} bytes, {state}>"


def copy(dst: Any, staged: StagingBuffer, nbytes: Optional[int] = None, stream: Any = None) -> "_witness.CopyCompleted":
    """Copy ``nbytes`` (default ``staged.nbytes``) from ``staged`` to ``dst`` and block until done.

    ``dst``: a device pointer (pinned staging) or, on the Host upstream, a host address or a
    writable buffer. With a ``stream`` the copy is ordered on it (then waited for). Returns the
    witness that lets ``staged.retire`` put the buffer back into its pool.
    """
    return _start(dst, staged, nbytes, stream, blocking=True).wait()


def copy_async(dst: Any, staged: StagingBuffer, nbytes: Optional[int] = None, stream: Any = None) -> PendingCopy:
    """Start the same copy without waiting; ``.wait()`` on the result returns the witness.

    On the CUDA path the copy is enqueued on ``stream`` (default: the legacy default stream 0);
    on the Host path it runs on poolkeeper's copy thread. Do not write to ``staged`` until then
    (``view``/``fill`` refuse while a copy is in flight).
    """
    return _start(dst, staged, nbytes, stream, blocking=False)


# -- internals -----------------------------------------------------------------------------------------
def _start(dst: Any, staged: Any, nbytes: Optional[int], stream: Any, blocking: bool) -> PendingCopy:
    if not isinstance(staged, StagingBuffer):
        raise InvalidArgumentError(
            f"staged must be a StagingBuffer from PinnedStagingPool.acquire(); got {type(staged).__name__}"
        )
    if nbytes is None:
        nbytes = staged.nbytes
    _, nbytes = _lease.of(staged).check_range(0, nbytes)
    handle = _stream_handle(stream)
    if staged.pool.upstream.kind == "pinned":
        return _start_device(dst, staged, nbytes, handle, blocking)
    return _start_host(dst, staged, nbytes, blocking)


def _stream_handle(stream: Any) -> Optional[int]:
    if stream is not None and not isinstance(stream, int) and hasattr(stream, "handle"):
        stream = stream.handle  # poolkeeper.cuda.driver.Stream
    from poolkeeper.streams import as_handle

    return as_handle(stream)


def _host_dst(dst: Any, nbytes: int) -> tuple[int, Optional[BorrowedBuffer]]:
    if isinstance(dst, int) and not isinstance(dst, bool):
        if dst < 0 or (dst == 0 and nbytes):
            raise InvalidArgumentError(f"dst address must be a positive int; got {dst!r}")
        return dst, None
    hold = BorrowedBuffer(dst, writable=True, what="dst")
    if hold.nbytes < nbytes:
        hold.release()
        raise InvalidArgumentError(f"dst holds {hold.nbytes} bytes; the copy needs {nbytes}", requested=nbytes)
    return hold.address, hold


def _device_dst(dst: Any, nbytes: int) -> int:
    if isinstance(dst, int) and not isinstance(dst, bool):
        ptr = dst
    elif hasattr(dst, "__cuda_array_interface__"):
        ptr = dst.__cuda_array_interface__["data"][0]
    else:
        raise InvalidArgumentError(
            "dst of a copy from pinned staging must be a device pointer (int) or an object with "
            f"__cuda_array_interface__; got {type(dst).__name__}"
        )
    if ptr < 0 or (ptr == 0 and nbytes):
        raise InvalidArgumentError(f"dst device pointer must be positive; got {ptr!r}")
    return ptr


def _start_host(dst: Any, staged: StagingBuffer, nbytes: int, blocking: bool) -> PendingCopy:
    address, hold = _host_dst(dst, nbytes)
    try:
        job = _lease.of(staged).begin_copy(lambda seq: _HostJob(seq, nbytes, staged))
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    job._dst_hold = hold
    if blocking:
        try:
            if nbytes:
                _memmove(address, staged.ptr, nbytes)
        except BaseException as e:
            job.finish(e)
            raise
        job.finish()
    else:
        _worker.submit(job, address, staged.ptr, nbytes)
    return PendingCopy._new(staged, job)


def _start_device(dst: Any, staged: StagingBuffer, nbytes: int, stream: Optional[int], blocking: bool) -> PendingCopy:
    ptr = _device_dst(dst, nbytes)
    job: _DeviceJob = _lease.of(staged).begin_copy(lambda seq: _DeviceJob(seq, nbytes))
    if nbytes == 0:
        job._done = True  # nothing to read: complete at once
        return PendingCopy._new(staged, job)
    drv = _driver()
    if blocking and stream is None:
        # cuMemcpyHtoD from page-locked memory returns only once the copy is complete.
        try:
            drv.memcpy_htod(ptr, staged.ptr, nbytes)
        except BaseException as e:
            job.error, job._done = e, True
            raise
        job._done = True
        return PendingCopy._new(staged, job)
    s = 0 if stream is None else stream
    try:
        drv.memcpy_htod_async(ptr, staged.ptr, nbytes, s)
    except BaseException as e:
        job.error, job._done = e, True  # nothing was enqueued: nothing reads the buffer
        raise
    try:
        job._event = drv.Event.record(s)
    except BaseException:
        # The copy is enqueued but untrackable: the buffer can never be proven free, so it is
        # never retired, and its memory is leaked rather than freed under a possible DMA.
        job._lost = True
        raise
    return PendingCopy._new(staged, job)


__all__ = ["PendingCopy", "copy", "copy_async"]
