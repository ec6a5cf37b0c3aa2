"""Fault injection: an upstream that refuses chosen calls.

``poolkeeper.upstream.Faulty`` (this class) wraps another upstream and makes some of its calls
fail, so a test can show what a pool does when its upstream refuses: the pool must raise a typed
error (:class:`~poolkeeper.errors.OutOfMemoryError` or :class:`~poolkeeper.errors.UpstreamError`),
roll back whatever it had started, keep ``validate()`` clean and keep serving afterwards.

Which calls are watched: every ``allocate``, and every ``deallocate`` too when ``fail_frees`` is
set. Watched calls are numbered 0, 1, 2, ... in one sequence (``calls`` is the count so far,
armed or not). A watched call fails when the injector is ``armed`` and *any* rule matches:

- ``fail_every=N``: the N-th, 2N-th, ... watched call (index + 1 divisible by N);
- ``fail_at={i, j, ...}``: exactly those indices;
- ``fail_bytes_over=B``: any call for more than B bytes.

A refused call never reaches the inner upstream. An allocation fails as the upstream running out
of memory (``error="oom"``, which the pool turns into ``OutOfMemoryError`` with
``cause="upstream"`` after its own recovery) or as any other upstream failure
(``error="upstream"``, surfacing as ``UpstreamError`` with ``error_name=
"POOLKEEPER_INJECTED_FAULT"``). A refused free always fails as an upstream failure: the memory stays
with the upstream. What each pool then does with a refused free:

- ``Direct.deallocate``: the block is live again and ``UpstreamError`` is raised (free it again).
- ``ArenaPool`` (``trim``, shrink scans, recovery before an OOM): the backing is re-adopted as a
  wholly free backing, counted in ``stats()["upstream_free_failures"]`` and retried at the next
  trim or scan. At ``close()`` the pool is gone, so a refused backing is counted and leaked.
- ``SizeClassPool`` (``release_cached``/``trim``, ``max_cached_bytes`` overflow, OOM recovery,
  ``close()``): counted in ``upstream_free_failures`` and dropped from the pool's books (leaked;
  the upstream's ``outstanding_bytes`` still shows it).

Name, kind, alignment, the whole stream interface (events, synchronize) and the capture state
(which streams are capturing, the thread's capture mode, open capture scopes) are the inner
upstream's, so a pool over ``Faulty(Simulated(...))`` keeps its virtual streams and captures; drive the
virtual device (``stream()``, ``enqueue``, ``advance``) through ``inner``.

Example::

    sim = pk.upstream.Simulated(latency_us=0)
    up = pk.upstream.Faulty(sim, fail_at={1})
    pool = pk.ArenaPool(up, initial_backing=1 << 16)
"""
from __future__ import annotations

from typing import Iterable, Optional

from poolkeeper import _core


class Faulty(_core.FaultyUpstream):
    """An upstream decorator that refuses chosen calls (see the module docs for the rules).

    Args:
        inner: the upstream that serves the calls that are not refused.
        fail_every: refuse every N-th watched call (N > 0).
        fail_at: refuse the watched calls with these indices (0-based).
        fail_bytes_over: refuse calls for more than this many bytes.
        fail_frees: watch ``deallocate`` calls too (default: allocations only).
        error: ``"oom"`` (default) or ``"upstream"``: how a refused allocation fails.
        armed: start armed (default) or disarmed; ``armed`` can be switched at any time.
        refuse_after_us: a refused call first sleeps this many microseconds (at most ten
            seconds: the sleep cannot be interrupted), as a driver call that fails after its
            work, so a test can act on the pool while the refused call is under way (default 0).

    Attributes:
        calls: watched calls so far. injected: calls refused so far
        (``injected_allocations + injected_deallocations``). inner, armed, and the plan
        (``fail_every``, ``fail_at``, ``fail_bytes_over``, ``fail_frees``, ``error``).

    Raises:
        InvalidArgumentError: a non-positive ``fail_every``, a negative or non-integer index,
        a negative ``fail_bytes_over`` or an unknown ``error``.
    """

    def __init__(
        self,
        inner: _core.Upstream,
        *,
        fail_every: Optional[int] = None,
        fail_at: Optional[Iterable[int]] = None,
        fail_bytes_over: Optional[int] = None,
        fail_frees: bool = False,
        error: str = "oom",
        armed: bool = True,
        refuse_after_us: int = 0,
    ) -> None:
        super().__init__(
            inner, fail_every, fail_at, fail_bytes_over, bool(fail_frees), str(error), bool(armed), refuse_after_us
        )

    def __repr__(self) -> str:
        rules = []
        if self.fail_every:
            rules.append(f"fail_every={self.fail_every}")
        if self.fail_at:
            rules.append(f"fail_at={sorted(self.fail_at)}")
        if self.fail_bytes_over:
            rules.append(f"fail_bytes_over={self.fail_bytes_over}")
        rules.append(f"fail_frees={self.fail_frees}")
        rules.append(f"error={self.error!r}")
        if self.refuse_after_us:
            rules.append(f"refuse_after_us={self.refuse_after_us}")
        state = "armed" if self.armed else "disarmed"
        return f"Faulty({self.inner!r}, {', '.join(rules)}; {state}, {self.injected}/{self.calls} refused)"


__all__ = ["Faulty"]
