"""The lease of one staging buffer: its state machine, and the one owner of what a lease holds.

A :class:`~poolkeeper.staging.buffer.StagingBuffer` is the user's handle; :class:`Lease` is
everything behind it that decides when its memory may be written, copied from, recycled or
freed: the state, the count of live views, the copies issued from it (their jobs), and the
witnesses minted for them (their single-use tokens). Every transition is one method here; the
buffer, the copy path (``_engine``) and the pool call only these methods, and the lease calls
the pool only through its three lease hooks (``_take_back``, ``_free_unretired``,
``_leak_unconfirmed``).

States and transitions (docs/staging.md draws the same diagram)::

                 begin_copy
        LIVE  ------------->  COPYING          (StagingBuffer.state shows "live" for both)
          ^                      |
          +----------------------+  every copy seen complete (a poll)

  LIVE           -- retire(witness) ------------------------->  RETIRED  (pool._take_back)
  LIVE, COPYING  -- close(), no view ------------------------->  CLOSED   (waits for copies, frees)
  LIVE, COPYING  -- close(), views alive --------------------->  CLOSING  (.state shows "closed")
  CLOSING        -- last view released, no copy in flight --->  CLOSED   (frees at once)
  CLOSING        -- buffer collected ------------------------->  CLOSED   (waits for copies, frees)
  LIVE, COPYING  -- buffer collected ------------------------->  DROPPED  (waits for copies, frees)

RETIRED, CLOSED and DROPPED are terminal. ``COPYING`` leaves for ``LIVE`` when a poll
(``copies_in_flight``, a write, a retire, a mint) sees every issued copy complete. A copy whose
completion can never be confirmed keeps the lease out of ``LIVE`` for good: it can only be closed
or dropped, and then its memory is leaked (counted), never freed under a possible DMA.

What each event does in each state (anything else raises, and changes nothing):

============  ===========================  ==========================  =========================
event         LIVE                         COPYING                     CLOSING / terminal
============  ===========================  ==========================  =========================
write / view  allowed                      BufferStateError (flight)   BufferStateError (state)
begin_copy    -> COPYING                   stays COPYING               BufferStateError (state)
retire        -> RETIRED (checks witness,  WitnessError (others in     BufferStateError (state)
              views: BufferInUseError)     flight)
close         -> CLOSED / CLOSING          -> CLOSED / CLOSING         no-op (idempotent)
collected     -> DROPPED                   -> DROPPED                  CLOSING -> CLOSED
============  ===========================  ==========================  =========================

Locking: ``Lease.lock`` (re-entrant) guards ``_state``, ``_views``, ``_jobs``, ``_done``,
``_witnesses``, ``_seq``, ``_leaked`` and ``_collected``. It is a leaf lock: nothing blocks while
holding it (no pool lock, no upstream call, no wait for a copy; those run after it is released),
so the buffer's finalizer may take it on whatever thread the garbage collector runs. It is
re-entrant because a view can be released by the collector on this thread while it holds the
lock (any allocation under it may collect a memoryview of the buffer), and the release takes it.
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

from poolkeeper.errors import InvalidArgumentError, WitnessError, brief
from poolkeeper.staging import witness as _witness
from poolkeeper.staging._errors import BufferInUseError, BufferStateError

if TYPE_CHECKING:  # pragma: no cover
    from poolkeeper.staging.buffer import StagingBuffer
    from poolkeeper.staging.pool import PinnedStagingPool

LIVE, COPYING, CLOSING, RETIRED, CLOSED, DROPPED = "live", "copying", "closing", "retired", "closed", "dropped"
TERMINAL = frozenset((RETIRED, CLOSED, DROPPED))
# What StagingBuffer.state shows: a copy in flight is still a live lease to its user, and a
# closing one is closed (every access already refuses).
PUBLIC_STATE = {LIVE: "live", COPYING: "live", CLOSING: "closed", RETIRED: "retired", CLOSED: "closed", DROPPED: "closed"}


class Lease:
    """One lease of staging memory: ``pool``, ``ptr``, ``capacity``, ``nbytes`` and its state.

    Holds no strong reference to its StagingBuffer (a weak one, to bind witnesses), so the
    buffer's finalizer can end it.
    """

    __slots__ = (
        "pool", "ptr", "capacity", "nbytes", "lock", "_buffer_ref", "_state", "_views", "_jobs", "_done",
        "_witnesses", "_seq", "_leaked", "_collected", "_free_owed", "__weakref__",
    )

    def __init__(self, pool: "PinnedStagingPool", ptr: int, capacity: int, nbytes: int) -> None:
        self.pool = pool
        self.ptr = ptr
        self.capacity = capacity
        self.nbytes = nbytes
        self.lock = threading.RLock()
        self._buffer_ref: Callable[[], Optional["StagingBuffer"]] = lambda: None  # set by bind()
        self._state = LIVE
        # Buffer-protocol exports alive (memoryviews, numpy arrays over the memory), by the token the
        # native slot gives each: a release named by its token is idempotent, so the slot can repeat
        # one that a Ctrl-C cut short (poolkeeper._core.HostBufferExporter).
        self._views: set = set()
        self._jobs: list = []  # copies issued and not yet seen complete (non-empty iff COPYING)
        self._done: dict = {}  # copy seq -> job: seen complete, no witness minted yet
        self._witnesses: dict = {}  # copy seq -> (job, witness): minted, not consumed
        self._seq = 0  # copies issued so far; a copy's seq is its witness's copy_seq
        self._leaked = False  # ended while a copy's completion could not be confirmed
        # CLOSED by the release of its last view, its memory not yet handed to the pool's free: a
        # release cut short there (Ctrl-C) and repeated by the buffer slot frees it then.
        self._free_owed = False
        self._collected = False  # the buffer's finalizer ran (see dropped)

    def bind(self, buffer: "StagingBuffer") -> None:
        """Name the buffer this lease is behind (witnesses are bound to it). Once, at creation."""
        self._buffer_ref = weakref.ref(buffer)

    # -- facts -------------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """The state: ``live``, ``copying``, ``closing``, ``retired``, ``closed`` or ``dropped``."""
        return self._state

    @property
    def public_state(self) -> str:
        return PUBLIC_STATE[self._state]

    @property
    def views(self) -> int:
        return len(self._views)

    def copies_in_flight(self) -> int:
        with self.lock:
            return self._poll_locked()

    def issued(self, job: Any) -> bool:
        """Whether ``job`` is a copy issued from this lease and not yet turned into a used witness."""
        with self.lock:
            seq = getattr(job, "seq", None)
            if any(j is job for j in self._jobs) or self._done.get(seq) is job:
                return True
            minted = self._witnesses.get(seq)
            return minted is not None and minted[0] is job

    def check_range(self, offset: int, nbytes: Optional[int]) -> tuple[int, int]:
        """``(offset, nbytes)`` of a range inside the lease's ``nbytes``; InvalidArgumentError if not."""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgumentError(f"offset must be a non-negative int; got {brief(offset)}")
        if nbytes is None:
            if offset > self.nbytes:  # else the derived nbytes would be reported as the caller's
                raise InvalidArgumentError(
                    f"offset {brief(offset)} is past the end of this staging buffer of {self.nbytes} bytes",
                    requested=offset,
                    nbytes=self.nbytes,
                )
            nbytes = self.nbytes - offset
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int; got {brief(nbytes)}")
        if offset + nbytes > self.nbytes:
            raise InvalidArgumentError(
                f"range [{offset}, {offset + nbytes}) is outside this staging buffer of {self.nbytes} bytes",
                requested=offset + nbytes,
                nbytes=self.nbytes,
            )
        return offset, nbytes

    # -- writes ------------------------------------------------------------------------------------
    def check_writable(self, what: str) -> None:
        """Raise unless the memory may be written now (LIVE, no copy reading it)."""
        with self.lock:
            self._check_writable_locked(what)

    def export(self, token: int) -> None:
        """A view of the memory, named ``token``, is being created (the buffer protocol's export)."""
        with self.lock:
            self._check_writable_locked("view")
            self._views.add(token)

    def unexport(self, token: int) -> None:
        """The view ``token`` was released. The last view of a CLOSING lease frees its memory,
        unless a copy still reads it (then the finalizer does).

        Idempotent as a whole, so the buffer slot can repeat a release a Ctrl-C cut short: a token
        not counted is ignored, and a repeat still finishes what the first call began (the close,
        the free it owes)."""
        with self.lock:
            if self._collected:
                return
            self._views.discard(token)
            if self._state == CLOSING and not self._views and not self._poll_locked():
                self._to_terminal_locked(CLOSED)
                self._free_owed = True
            if not self._free_owed:
                return
            self._free_owed = False
        self.pool._free_unretired(self.ptr, self.capacity, "closed")

    def write(self, offset: int, address: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``address`` into the memory at ``offset`` (range already checked).
        Under the lock, so no copy can start reading the memory halfway through."""
        with self.lock:
            self._check_writable_locked("fill")
            if nbytes:
                ctypes.memmove(self.ptr + offset, address, nbytes)

    # -- copies and witnesses ----------------------------------------------------------------------
    def begin_copy(self, job_factory: Callable[[int], Any]) -> Any:
        """Register a copy out of the memory; ``job_factory(seq)`` builds its job (under the lock)."""
        with self.lock:
            if self._state not in (LIVE, COPYING):
                state = PUBLIC_STATE[self._state]
                raise BufferStateError(f"cannot copy from a staging buffer that was {state}", state=state)
            self._seq += 1
            job = job_factory(self._seq)
            self._jobs.append(job)
            self._state = COPYING
            return job

    def mint(self, job: Any) -> "_witness.CopyCompleted":
        """The witness of ``job``, a completed copy issued from this lease: one per copy (every
        call for the same copy returns the same witness), its token registered here until a
        retire consumes it. After the lease ended, the witness is not registered (a retire
        refuses it by state anyway)."""
        with self.lock:
            minted = self._witnesses.get(job.seq)
            if minted is not None and minted[0] is job:
                return minted[1]
            buffer = self._buffer_ref()
            if self._state in TERMINAL:
                return _witness._mint(buffer, job)
            if not self.issued(job):
                raise WitnessError("internal error: a witness was requested for a copy this buffer did not issue")
            w = _witness._mint(buffer, job)  # refuses an incomplete job
            self._poll_locked()
            self._done.pop(job.seq, None)
            self._witnesses[job.seq] = (job, w)
            return w

    # -- the ends ------------------------------------------------------------------------------------
    def retire(self, witness: Any) -> None:
        """End the lease into the pool (recycled), authorized by ``witness``. On any error nothing
        changes and the witness stays unused."""
        with self.lock:
            token, seq = _witness._fields(witness, self._buffer_ref())
            if self._state not in (LIVE, COPYING):
                state = PUBLIC_STATE[self._state]
                raise BufferStateError(f"this staging buffer was already {state}", state=state)
            minted = self._witnesses.get(seq)
            if minted is None or _witness._token(minted[1]) is not token:
                raise WitnessError("this CopyCompleted was not minted by poolkeeper's copy path for this buffer")
            others = self._poll_locked()
            if others:
                raise WitnessError(
                    f"{others} other copy(ies) from this buffer are still in flight; wait for them "
                    "before retiring (their memory reads are not covered by this witness)"
                )
            if self._views:
                raise BufferInUseError(
                    f"{len(self._views)} memory view(s) of this staging buffer are still alive; release "
                    "them before retire (they would write into the next user's data)",
                    views=len(self._views),
                )
            _witness._consume(witness)
            self._to_terminal_locked(RETIRED)
        self.pool._take_back(self.ptr, self.capacity)

    def close(self) -> None:
        """End the lease without recycling (idempotent). With views alive the memory is freed when
        the last of them goes (never under them)."""
        with self.lock:
            if self._state not in (LIVE, COPYING):
                return
            if self._views:
                self._state = CLOSING
                return
            self._to_terminal_locked(CLOSED)
        self._end("closed")

    def dropped(self) -> None:
        """The buffer was collected (its finalizer): free, never recycle. The lock is a leaf lock
        (module note), so taking it here cannot deadlock whatever thread the collector runs on.

        Views still counted now are garbage of the same collection (a view keeps its buffer
        alive otherwise): nothing can write through them, and their releases, which may come
        after this or never reach the lease at all, are ignored."""
        with self.lock:
            self._views = set()
            self._collected = True
            if self._state in (LIVE, COPYING):
                self._to_terminal_locked(DROPPED)
                how = "dropped"
            elif self._state == CLOSING:
                self._to_terminal_locked(CLOSED)
                how = "closed"
            else:
                return
        self._end(how)

    # -- invariants ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the lease's invariants; raises AssertionError naming the broken one."""
        with self.lock:
            s = self._state
            assert s in PUBLIC_STATE, f"unknown lease state {s!r}"
            assert (s == COPYING) == bool(self._jobs) or s not in (LIVE, COPYING), (
                f"state {s} with {len(self._jobs)} copies not yet seen complete"
            )
            seqs = [j.seq for j in self._jobs] + list(self._done) + list(self._witnesses)
            assert len(seqs) == len(set(seqs)), f"a copy is tracked twice: {sorted(seqs)}"
            assert all(1 <= q <= self._seq for q in seqs), f"a tracked copy was never issued: {sorted(seqs)}"
            for q, (job, w) in self._witnesses.items():
                assert job.seq == q and w.copy_seq == q and not w.consumed, f"witness of copy {q} is stale"
            if s in TERMINAL:
                assert not self._views, f"{s} lease with {len(self._views)} views"
                assert not self._witnesses and not self._done, f"{s} lease still holds witness tokens"
                assert not self._jobs or self._leaked or s != RETIRED, f"{s} lease with copies in flight"
            if self._leaked:
                assert s in (CLOSED, DROPPED), f"leaked lease in state {s}"

    # -- internals -----------------------------------------------------------------------------------
    def _check_writable_locked(self, what: str) -> None:
        if self._state not in (LIVE, COPYING):
            state = PUBLIC_STATE[self._state]
            raise BufferStateError(f"cannot {what}: this staging buffer was {state}", state=state)
        if self._poll_locked():
            raise BufferStateError(f"cannot {what}: a copy out of this staging buffer is still in flight", state="live")

    def _poll_locked(self) -> int:
        # COPYING -> LIVE once every issued copy is seen complete; completed jobs wait in _done
        # for their witness.
        jobs = self._jobs
        if jobs:
            still = []
            for j in jobs:
                if j.query():
                    self._done[j.seq] = j
                else:
                    still.append(j)
            jobs[:] = still
            if not still and self._state == COPYING:
                self._state = LIVE
        return len(jobs)

    def _to_terminal_locked(self, state: str) -> None:
        # A terminal lease authorizes nothing: its outstanding witnesses are void at once.
        self._state = state
        self._witnesses.clear()
        self._done.clear()

    def _end(self, how: str) -> None:
        # Freeing memory a DMA still reads is as bad as recycling it: wait first (outside the
        # lock). Host copies keep their StagingBuffer alive until done, so in a finalizer only
        # device copies can remain, and waiting on them needs no Python thread (no deadlock from
        # a GC on any thread). A copy whose completion cannot be confirmed leaks the memory.
        with self.lock:
            jobs = list(self._jobs)
        confirmed = True
        for job in jobs:
            confirmed = job.wait_complete() and confirmed
        with self.lock:
            if confirmed:
                self._jobs.clear()
            else:
                self._leaked = True
        if confirmed:
            self.pool._free_unretired(self.ptr, self.capacity, how)
        else:
            self.pool._leak_unconfirmed(self.capacity)


def of(buffer: "StagingBuffer") -> Lease:
    """The lease behind ``buffer``: how the copy path reaches it."""
    return buffer._lease


__all__: list = []
