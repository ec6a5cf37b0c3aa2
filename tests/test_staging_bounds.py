"""Property test: under any mix of sizes and endings, the pool matches a simple model of its rules
and never retains more than ``max_buffers`` buffers or ``max_bytes`` bytes."""
from __future__ import annotations

import bisect
import gc

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import poolkeeper as pk
from poolkeeper.staging import PinnedStagingPool, copy

G = 4096
SIZES = st.sampled_from([1, 100, G, G + 1, 3 * G, 5 * G - 7, 8 * G, 13 * G])


class Model:
    """The pool's rules, written as plainly as possible."""

    def __init__(self, max_buffers: int, max_bytes: int) -> None:
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self.retained: list[int] = []  # sorted capacities
        self.allocs = self.reuses = self.frees = 0

    def acquire(self, n: int) -> int:
        cap = max(G, -(-n // G) * G)
        i = bisect.bisect_left(self.retained, cap)
        if i < len(self.retained):
            self.reuses += 1
            return self.retained.pop(i)
        self.allocs += 1
        return cap

    def retire(self, cap: int) -> None:
        if len(self.retained) + 1 > self.max_buffers or sum(self.retained) + cap > self.max_bytes:
            self.frees += 1
        else:
            bisect.insort(self.retained, cap)

    def end_without_retire(self, cap: int) -> None:
        self.frees += 1


class StagingPoolMachine(RuleBasedStateMachine):
    @initialize(max_buffers=st.integers(0, 4), max_bytes=st.sampled_from([0, 2 * G, 10 * G, 40 * G]))
    def setup(self, max_buffers: int, max_bytes: int) -> None:
        self.up = pk.upstream.Host()
        self.pool = PinnedStagingPool(self.up, max_buffers=max_buffers, max_bytes=max_bytes)
        self.model = Model(max_buffers, max_bytes)
        self.held: list = []
        self.dst = bytearray(13 * G)

    @rule(n=SIZES)
    def acquire(self, n: int) -> None:
        b = self.pool.acquire(n)
        cap = self.model.acquire(n)
        assert b.capacity == cap and b.nbytes == n
        self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1 << 16), data=st.binary(min_size=1, max_size=16))
    def retire(self, i: int, data: bytes) -> None:
        b = self.held.pop(i % len(self.held))
        n = min(len(data), b.nbytes)
        b.fill(data[:n])
        w = copy(self.dst, b, n)
        assert bytes(self.dst[:n]) == data[:n]
        b.retire(w)
        self.model.retire(b.capacity)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1 << 16))
    def close(self, i: int) -> None:
        b = self.held.pop(i % len(self.held))
        b.close()
        self.model.end_without_retire(b.capacity)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1 << 16))
    def drop(self, i: int) -> None:
        b = self.held.pop(i % len(self.held))
        cap = b.capacity
        del b
        gc.collect()
        self.model.end_without_retire(cap)

    @invariant()
    def matches_model_and_bounds(self) -> None:
        s = self.pool.stats()
        m = self.model
        assert s["retained_buffers"] <= m.max_buffers
        assert s["retained_bytes"] <= m.max_bytes
        assert s["retained_capacities"] == m.retained
        assert (s["pinned_alloc_calls"], s["reuses"], s["frees"]) == (m.allocs, m.reuses, m.frees)
        c = self.up.counters()
        assert c["allocations"] == s["pinned_alloc_calls"] and c["deallocations"] == s["frees"]
        assert c["outstanding_bytes"] == s["retained_bytes"] + s["live_bytes"]
        assert s["live_buffers"] == len(self.held)

    def teardown(self) -> None:
        for b in self.held:
            b.close()
        self.pool.close()
        assert self.up.counters()["outstanding_bytes"] == 0


StagingPoolMachine.TestCase.settings = settings(derandomize=True, max_examples=60, stateful_step_count=40, deadline=None)
TestStagingPoolBounds = StagingPoolMachine.TestCase
